"""Augmentors that change pixel values only: brightness, contrast, colour, lighting, dtype, normalization.

Arguments and random draws follow tensorpack's augmentors of the same names. Arithmetic runs in
float32 and the result gets the input's dtype back; uint8 results are always clipped to ``[0, 255]``
first, and ``clip=True`` (the default) clips float results to that range too. Colour conversions are
OpenCV's (``cv2.cvtColor``); ``rgb`` says whether 3-channel images are RGB or BGR.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._base import PhotometricAugmentor
from ._transform import cv2, keep_channel_axis

__all__ = [
    "Brightness",
    "BrightnessScale",
    "Clip",
    "ColorSpace",
    "Contrast",
    "Gamma",
    "GaussianBlur",
    "Grayscale",
    "Hue",
    "Lighting",
    "MeanVarianceNormalize",
    "MinMaxNormalize",
    "SaltPepperNoise",
    "Saturation",
    "ToFloat32",
    "ToUint8",
]


def _finish(out: np.ndarray, dtype: np.dtype, clip: bool) -> np.ndarray:
    if clip or dtype == np.uint8:
        out = np.clip(out, 0, 255)
    return out.astype(dtype, copy=False)


def _gray_code(rgb: bool) -> int:
    c = cv2()
    return c.COLOR_RGB2GRAY if rgb else c.COLOR_BGR2GRAY


class Brightness(PhotometricAugmentor):
    """Add one random value in ``[-delta, delta)`` to every pixel."""

    def __init__(self, delta: float, clip: bool = True) -> None:
        if not delta > 0:
            raise ValueError(f"Brightness delta must be > 0, got {delta}")
        self.delta, self.clip = delta, clip

    def _get_augment_params(self, img: np.ndarray) -> Any:
        return self._rand_range(-self.delta, self.delta)

    def _augment(self, img: np.ndarray, v: Any) -> np.ndarray:
        return _finish(img.astype(np.float32) + v, img.dtype, self.clip)


class BrightnessScale(PhotometricAugmentor):
    """Multiply every pixel by one random factor in ``[range[0], range[1])``."""

    def __init__(self, range: tuple, clip: bool = True) -> None:
        self.range, self.clip = range, clip

    def _get_augment_params(self, img: np.ndarray) -> Any:
        return self._rand_range(*self.range)

    def _augment(self, img: np.ndarray, v: Any) -> np.ndarray:
        return _finish(img.astype(np.float32) * v, img.dtype, self.clip)


class Contrast(PhotometricAugmentor):
    """``x = (x - mean) * factor + mean`` with a random ``factor`` in ``factor_range``.

    ``rgb=None``: the mean is taken per channel; ``rgb=True``/``False``: the mean of the grey image of an
    RGB/BGR image.
    """

    def __init__(self, factor_range: tuple, rgb: bool | None = None, clip: bool = True) -> None:
        self.factor_range, self.rgb, self.clip = factor_range, rgb, clip

    def _get_augment_params(self, img: np.ndarray) -> Any:
        return self._rand_range(*self.factor_range)

    def _augment(self, img: np.ndarray, r: Any) -> np.ndarray:
        x = img.astype(np.float32)
        if img.ndim == 3 and self.rgb is not None:
            mean = np.mean(cv2().cvtColor(x, _gray_code(self.rgb)))
        elif img.ndim == 3:
            mean = np.mean(x, axis=(0, 1), keepdims=True)
        else:
            mean = np.mean(x)
        return _finish(x * r + mean * (1 - r), img.dtype, self.clip)


class SaltPepperNoise(PhotometricAugmentor):
    """Set each element (each channel of each pixel, on its own) to 255 with probability ``white_prob`` and to 0
    with probability ``black_prob``, from one uniform draw per element."""

    def __init__(self, white_prob: float = 0.05, black_prob: float = 0.05) -> None:
        if not (0 <= white_prob and 0 <= black_prob and white_prob + black_prob <= 1):
            raise ValueError(f"SaltPepperNoise needs probabilities >= 0 that sum to at most 1, got white_prob="
                             f"{white_prob} and black_prob={black_prob}")
        self.white_prob, self.black_prob = white_prob, black_prob

    def _get_augment_params(self, img: np.ndarray) -> Any:
        return self.rng.uniform(0, 1, img.shape)

    def _augment(self, img: np.ndarray, u: Any) -> np.ndarray:
        out = img.copy()
        out[u > 1 - self.white_prob] = 255
        out[u < self.black_prob] = 0
        return out


class Saturation(PhotometricAugmentor):
    """Blend the image with its grey version: ``x * v + grey * (1 - v)``, ``v`` in ``[1 - alpha, 1 + alpha)``."""

    def __init__(self, alpha: float = 0.4, rgb: bool = True, clip: bool = True) -> None:
        if not alpha < 1:
            raise ValueError(f"Saturation alpha must be < 1, got {alpha}")
        self.alpha, self.rgb, self.clip = alpha, bool(rgb), clip

    def _get_augment_params(self, img: np.ndarray) -> Any:
        return 1 + self._rand_range(-self.alpha, self.alpha)

    def _augment(self, img: np.ndarray, v: Any) -> np.ndarray:
        grey = cv2().cvtColor(img, _gray_code(self.rgb)).astype(np.float32)
        out = img.astype(np.float32) * v + (grey * (1 - v))[:, :, np.newaxis]
        return _finish(out, img.dtype, self.clip)


class Lighting(PhotometricAugmentor):
    """AlexNet's PCA lighting noise: add ``eigvec @ (alpha * eigval)`` to every pixel, ``alpha ~ N(0, std)``.

    Args:
        std: standard deviation of the three random weights.
        eigval: the 3 eigenvalues of the pixel covariance.
        eigvec: 3x3 matrix whose columns are the eigenvectors (in the image's channel order).
    """

    def __init__(self, std: float, eigval: Any, eigvec: Any, clip: bool = True) -> None:
        self.eigval = np.asarray(eigval, dtype=np.float32)
        self.eigvec = np.asarray(eigvec, dtype=np.float32)
        if self.eigval.shape != (3,) or self.eigvec.shape != (3, 3):
            raise ValueError(f"Lighting needs eigval of shape (3,) and eigvec of shape (3, 3), got "
                             f"{self.eigval.shape} and {self.eigvec.shape}")
        self.std, self.clip = std, clip

    def _get_augment_params(self, img: np.ndarray) -> Any:
        if img.ndim != 3 or img.shape[2] != 3:
            raise ValueError(f"Lighting works on 3-channel images, got shape {img.shape}")
        return (self.rng.randn(3) * self.std).astype(np.float32)

    def _augment(self, img: np.ndarray, v: Any) -> np.ndarray:
        inc = self.eigvec @ (v * self.eigval)
        return _finish(img.astype(np.float32) + inc, img.dtype, self.clip)


class Hue(PhotometricAugmentor):
    """Shift the hue by a random number of degrees/2 in ``range`` (OpenCV's 0-180 hue scale)."""

    def __init__(self, range: tuple = (0, 180), rgb: bool = True) -> None:
        self.range, self.rgb = range, bool(rgb)

    def _get_augment_params(self, img: np.ndarray) -> Any:
        return self._rand_range(*self.range)

    def _augment(self, img: np.ndarray, hue: Any) -> np.ndarray:
        c = cv2()
        hsv = c.cvtColor(img, c.COLOR_RGB2HSV if self.rgb else c.COLOR_BGR2HSV)
        if hsv.dtype == np.uint8:  # OpenCV: 0-179 for 8-bit images, 0-360 for float ones
            hsv[..., 0] = (hsv[..., 0].astype(np.float32) + hue) % 180
        else:
            hsv[..., 0] = (hsv[..., 0] + 2 * hue) % 360
        return c.cvtColor(hsv, c.COLOR_HSV2RGB if self.rgb else c.COLOR_HSV2BGR)


class Gamma(PhotometricAugmentor):
    """Gamma correction ``255 * (x / 255) ** (1 / (1 + g))`` with ``g`` in ``range``; returns the input dtype
    (values are clipped to uint8 first)."""

    def __init__(self, range: tuple = (-0.5, 0.5)) -> None:
        self.range = range

    def _get_augment_params(self, img: np.ndarray) -> Any:
        return self._rand_range(*self.range)

    def _augment(self, img: np.ndarray, gamma: Any) -> np.ndarray:
        lut = ((np.arange(256, dtype=np.float32) / 255) ** (1.0 / (1.0 + gamma)) * 255).astype(np.uint8)
        u8 = np.clip(img, 0, 255).astype(np.uint8)
        return keep_channel_axis(cv2().LUT(u8, lut), u8).astype(img.dtype)


class GaussianBlur(PhotometricAugmentor):
    """Gaussian blur with a random odd window ``2 * k + 1``, ``k`` in ``[size_range[0], size_range[1])``, and
    a random sigma in ``sigma_range`` (0: OpenCV derives it from the window)."""

    def __init__(self, size_range: Any = (0, 3), sigma_range: tuple = (0, 0), symmetric: bool = True) -> None:
        if not isinstance(size_range, (list, tuple)):
            size_range = (0, size_range)
        self.size_range, self.sigma_range, self.symmetric = tuple(size_range), tuple(sigma_range), symmetric

    def _get_augment_params(self, img: np.ndarray) -> Any:
        size = self.rng.randint(self.size_range[0], self.size_range[1], size=(2,)) * 2 + 1
        sigma = self._rand_range(*self.sigma_range, size=(2,))  # type: ignore[misc]  # (low, high): mypy cannot
        # tell that a tuple of unknown length leaves `size` to the keyword
        if self.symmetric:
            size[1], sigma[1] = size[0], sigma[0]
        return (int(size[0]), int(size[1])), (float(sigma[0]), float(sigma[1]))

    def _augment(self, img: np.ndarray, params: Any) -> np.ndarray:
        c = cv2()
        size, sigma = params
        out = c.GaussianBlur(img, size, sigmaX=sigma[0], sigmaY=sigma[1], borderType=c.BORDER_REPLICATE)
        return out.reshape(img.shape)


class Clip(PhotometricAugmentor):
    """Clip pixel values to ``[min, max]``."""

    def __init__(self, min: float = 0, max: float = 255) -> None:
        self.min, self.max = min, max

    def _augment(self, img: np.ndarray, _: Any) -> np.ndarray:
        return np.clip(img, self.min, self.max)


class ColorSpace(PhotometricAugmentor):
    """Convert with ``cv2.cvtColor(img, mode)`` (e.g. ``cv2.COLOR_BGR2HSV``); ``keepdims`` keeps a channel
    axis that OpenCV drops."""

    def __init__(self, mode: int, keepdims: bool = True) -> None:
        self.mode, self.keepdims = mode, keepdims

    def _augment(self, img: np.ndarray, _: Any) -> np.ndarray:
        out = cv2().cvtColor(img, self.mode)
        return keep_channel_axis(out, img) if self.keepdims else out


class Grayscale(ColorSpace):
    """Grey image of an RGB (``rgb=True``) or BGR image: ``(h, w, 1)`` with ``keepdims``, 3 equal channels
    with ``keepshape``."""

    def __init__(self, keepdims: bool = True, rgb: bool = False, keepshape: bool = False) -> None:
        if keepshape and not keepdims:
            raise ValueError("Grayscale(keepshape=True) needs keepdims=True")
        super().__init__(_gray_code(rgb), keepdims)
        self.rgb, self.keepshape = rgb, keepshape

    def _augment(self, img: np.ndarray, _: Any) -> np.ndarray:
        out = super()._augment(img, _)
        return np.concatenate([out] * 3, axis=2) if self.keepshape else out


class ToUint8(PhotometricAugmentor):
    """Clip to ``[0, 255]`` and convert to uint8 (smaller datapoints to send between processes)."""

    def _augment(self, img: np.ndarray, _: Any) -> np.ndarray:
        return np.clip(img, 0, 255).astype(np.uint8)


class ToFloat32(PhotometricAugmentor):
    """Convert to float32 (later augmentors then work without rounding to uint8 in between)."""

    def _augment(self, img: np.ndarray, _: Any) -> np.ndarray:
        return img.astype(np.float32)


class MinMaxNormalize(PhotometricAugmentor):
    """Scale linearly to ``[min, max]`` (float32), over all channels or each channel apart."""

    def __init__(self, min: float = 0, max: float = 255, all_channel: bool = True) -> None:
        self.min, self.max, self.all_channel = min, max, all_channel

    def _augment(self, img: np.ndarray, _: Any) -> np.ndarray:
        x = img.astype(np.float32)
        axis = None if self.all_channel else (0, 1)
        lo = np.min(x, axis=axis, keepdims=axis is not None)
        hi = np.max(x, axis=axis, keepdims=axis is not None)
        span = np.where(hi > lo, hi - lo, 1)  # a constant image maps to min instead of NaN
        return (self.max - self.min) * (x - lo) / span + self.min


class MeanVarianceNormalize(PhotometricAugmentor):
    """Zero mean, unit standard deviation (float32); the deviation is at least ``1 / sqrt(img.size)``."""

    def __init__(self, all_channel: bool = True) -> None:
        self.all_channel = all_channel

    def _augment(self, img: np.ndarray, _: Any) -> np.ndarray:
        x = img.astype(np.float32)
        axis = None if self.all_channel else (0, 1)
        mean = np.mean(x, axis=axis, keepdims=axis is not None)
        std = np.std(x, axis=axis, keepdims=axis is not None)
        std = np.maximum(std, np.float32(1.0 / np.sqrt(x.size)))
        return (x - mean) / std
