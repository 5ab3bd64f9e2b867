"""Augmentors that move pixels: flips, resizes, crops and pastes (coordinates follow them).

Arguments and random draws follow tensorpack's augmentors of the same names, so a pipeline ported
from tensorpack behaves the same; the pixel work is OpenCV's (``cv2.resize``) or numpy slicing.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ._base import ImageAugmentor
from ._transform import (
    INTER_LINEAR,
    BaseTransform,
    CropTransform,
    FlipTransform,
    NoOpTransform,
    ResizeTransform,
    Transform,
    TransformList,
    TransposeTransform,
    as_coords,
)

__all__ = [
    "BackgroundFiller",
    "CenterCrop",
    "CenterPaste",
    "ConstantBackgroundFiller",
    "Flip",
    "GoogleNetRandomCropAndResize",
    "RandomCrop",
    "RandomResize",
    "Resize",
    "ResizeShortestEdge",
    "Transpose",
]

log = logging.getLogger(__name__)


def shape2d(value: Any, who: str) -> tuple[int, int]:
    """``(h, w)`` from an int (a square) or a pair."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value), int(value)
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    raise ValueError(f"{who}: a shape is an int or an (h, w) pair, got {value!r}")


def _check_fits(img_shape: tuple[int, ...], crop: tuple[int, int], who: str) -> None:
    if img_shape[0] < crop[0] or img_shape[1] < crop[1]:
        raise ValueError(f"{who}: cannot crop {crop[0]}x{crop[1]} out of a {img_shape[0]}x{img_shape[1]} "
                         "image; resize it first (e.g. ResizeShortestEdge)")


class Flip(ImageAugmentor):
    """Mirror the image left-right (``horiz=True``) or top-bottom (``vert=True``) with probability ``prob``."""

    def __init__(self, horiz: bool = False, vert: bool = False, prob: float = 0.5) -> None:
        if horiz == vert:
            raise ValueError("Flip needs exactly one of horiz=True or vert=True (use two Flips for both)")
        self.horiz, self.vert, self.prob = horiz, vert, prob

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        h, w = img.shape[:2]
        if self._rand_range() < self.prob:
            return FlipTransform(h, w, self.horiz)
        return NoOpTransform()


class Transpose(ImageAugmentor):
    """Swap the image's rows and columns with probability ``prob``."""

    def __init__(self, prob: float = 0.5) -> None:
        self.prob = prob

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        return TransposeTransform() if self.rng.rand() < self.prob else NoOpTransform()


class Resize(ImageAugmentor):
    """Resize to ``shape`` (``(h, w)``, or an int for a square) with OpenCV interpolation ``interp``."""

    def __init__(self, shape: Any, interp: int = INTER_LINEAR) -> None:
        self.shape = shape2d(shape, "Resize")
        self.interp = interp

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        return ResizeTransform(img.shape[0], img.shape[1], self.shape[0], self.shape[1], self.interp)


class ResizeShortestEdge(ImageAugmentor):
    """Resize so that the shorter side is ``size`` pixels, keeping the aspect ratio (rounded)."""

    def __init__(self, size: int, interp: int = INTER_LINEAR) -> None:
        self.size = int(size)
        self.interp = interp

    def get_transform(self, img: np.ndarray) -> ResizeTransform:
        h, w = img.shape[:2]
        scale = self.size / min(h, w)
        if h < w:
            new_h, new_w = self.size, int(scale * w + 0.5)
        else:
            new_h, new_w = int(scale * h + 0.5), self.size
        return ResizeTransform(h, w, new_h, new_w, self.interp)


class RandomResize(ImageAugmentor):
    """Resize to a random width and height.

    Args:
        xrange: ``(low, high)`` of the new width: a scale of the old width when the values are floats,
            pixels when they are ints.
        yrange: the same for the height; ``None`` with ``aspect_ratio_thres=0`` (the height follows).
        minimum: ``(min_w, min_h)`` in pixels.
        aspect_ratio_thres: draws that change the aspect ratio by more than this fraction are redrawn
            (up to 50 times, then the image is kept); ``0`` keeps the aspect ratio exactly.
        interp: OpenCV interpolation.
    """

    def __init__(self, xrange: tuple, yrange: tuple | None = None, minimum: tuple = (0, 0),
                 aspect_ratio_thres: float = 0.15, interp: int = INTER_LINEAR) -> None:
        if aspect_ratio_thres < 0:
            raise ValueError(f"RandomResize aspect_ratio_thres must be >= 0, got {aspect_ratio_thres}")
        is_scale = isinstance(xrange[0], float) or isinstance(xrange[1], float)
        if yrange is not None and is_scale != (isinstance(yrange[0], float) or isinstance(yrange[1], float)):
            raise ValueError("RandomResize: xrange and yrange must both be scales (floats) or both pixels (ints)")
        if aspect_ratio_thres > 0 and yrange is None:
            raise ValueError("RandomResize needs yrange unless aspect_ratio_thres=0 (aspect ratio kept)")
        if aspect_ratio_thres == 0 and is_scale and yrange is not None and tuple(yrange) != tuple(xrange):
            raise ValueError("RandomResize with aspect_ratio_thres=0 scales both sides by one factor: "
                             "leave yrange out")
        self.xrange, self.yrange, self.minimum = xrange, yrange, minimum
        self.aspect_ratio_thres, self.interp = aspect_ratio_thres, interp
        self._is_scale = is_scale

    def _draw(self, h: int, w: int) -> tuple[int, int]:
        sx = self._rand_range(*self.xrange)
        yrange = self.yrange if self.yrange is not None else ()  # None: aspect_ratio_thres=0, then unused
        if self._is_scale:
            sy = sx if self.aspect_ratio_thres == 0 else self._rand_range(*yrange)
            new_w, new_h = max(sx * w, self.minimum[0]), max(sy * h, self.minimum[1])
        else:
            sy = sx / w * h if self.aspect_ratio_thres == 0 else self._rand_range(*yrange)
            new_w, new_h = max(sx, self.minimum[0]), max(sy, self.minimum[1])
        return int(new_w + 0.5), int(new_h + 0.5)

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        h, w = img.shape[:2]
        for _ in range(51):
            new_w, new_h = self._draw(h, w)
            if self.aspect_ratio_thres == 0:
                return ResizeTransform(h, w, new_h, new_w, self.interp)
            change = abs(new_w / new_h - w / h) / (w / h)
            if change < self.aspect_ratio_thres + 1e-5:
                return ResizeTransform(h, w, new_h, new_w, self.interp)
        log.warning("RandomResize: no size within the aspect ratio threshold in 51 draws for a %dx%d image; "
                    "keeping its size", h, w)
        return ResizeTransform(h, w, h, w, self.interp)


class CenterCrop(ImageAugmentor):
    """Keep the central ``crop_shape`` window (``(h, w)`` or an int)."""

    def __init__(self, crop_shape: Any) -> None:
        self.crop_shape = shape2d(crop_shape, "CenterCrop")

    def get_transform(self, img: Any) -> BaseTransform:
        shape = img.shape
        _check_fits(shape, self.crop_shape, "CenterCrop")
        y0 = int((shape[0] - self.crop_shape[0]) * 0.5)
        x0 = int((shape[1] - self.crop_shape[1]) * 0.5)
        return CropTransform(y0, x0, *self.crop_shape)


class RandomCrop(ImageAugmentor):
    """Keep a ``crop_shape`` window at a uniformly random position."""

    def __init__(self, crop_shape: Any) -> None:
        self.crop_shape = shape2d(crop_shape, "RandomCrop")

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        shape = img.shape
        _check_fits(shape, self.crop_shape, "RandomCrop")
        y0 = self.rng.randint(shape[0] - self.crop_shape[0] + 1)
        x0 = self.rng.randint(shape[1] - self.crop_shape[1] + 1)
        return CropTransform(y0, x0, *self.crop_shape)


class _Shape:
    """Stands in for an image when only its shape matters."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


class GoogleNetRandomCropAndResize(ImageAugmentor):
    """The Inception-style crop: a random window covering ``crop_area_fraction`` of the image with an
    aspect ratio in ``aspect_ratio_range``, resized to ``target_shape`` squared.

    Up to 10 draws are tried; when none fits, the image gets ResizeShortestEdge then CenterCrop.
    """

    def __init__(self, crop_area_fraction: tuple = (0.08, 1.0), aspect_ratio_range: tuple = (0.75, 1.333),
                 target_shape: int = 224, interp: int = INTER_LINEAR) -> None:
        self.crop_area_fraction = crop_area_fraction
        self.aspect_ratio_range = aspect_ratio_range
        self.target_shape = int(target_shape)
        self.interp = interp

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        h, w = img.shape[:2]
        rng = self.rng
        for _ in range(10):
            area = rng.uniform(*self.crop_area_fraction) * h * w
            ratio = rng.uniform(*self.aspect_ratio_range)
            cw, ch = int(np.sqrt(area * ratio) + 0.5), int(np.sqrt(area / ratio) + 0.5)
            if rng.uniform() < 0.5:
                cw, ch = ch, cw
            if ch <= h and cw <= w:
                x0 = rng.randint(0, w - cw + 1)
                y0 = rng.randint(0, h - ch + 1)
                return TransformList([CropTransform(y0, x0, ch, cw),
                                      ResizeTransform(ch, cw, self.target_shape, self.target_shape, self.interp)])
        resize = ResizeShortestEdge(self.target_shape, self.interp).get_transform(img)
        crop = CenterCrop(self.target_shape).get_transform(_Shape((resize.new_h, resize.new_w)))
        return TransformList([resize, crop])


class BackgroundFiller:
    """Makes the canvas that CenterPaste pastes onto; subclasses implement ``_fill(shape, img)``."""

    def fill(self, background_shape: tuple, img: np.ndarray) -> np.ndarray:
        return self._fill(tuple(background_shape), img)

    def _fill(self, background_shape: tuple, img: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class ConstantBackgroundFiller(BackgroundFiller):
    """A canvas of one value, with the image's dtype and channels."""

    def __init__(self, value: float) -> None:
        self.value = value

    def _fill(self, background_shape: tuple, img: np.ndarray) -> np.ndarray:
        return np.full(background_shape + img.shape[2:], self.value, dtype=img.dtype)


class _PasteTransform(Transform):
    def __init__(self, background_shape: tuple[int, int], filler: BackgroundFiller, y0: int, x0: int) -> None:
        self.background_shape, self.filler, self.y0, self.x0 = background_shape, filler, y0, x0

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        h, w = img.shape[:2]
        canvas = self.filler.fill(self.background_shape, img)
        canvas[self.y0:self.y0 + h, self.x0:self.x0 + w] = img
        return canvas

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        out = as_coords(coords)
        out[:, 0] += self.x0
        out[:, 1] += self.y0
        return out


class CenterPaste(ImageAugmentor):
    """Paste the image at the centre of a ``background_shape`` canvas (zeros unless a filler is given)."""

    def __init__(self, background_shape: Any, background_filler: BackgroundFiller | None = None) -> None:
        self.background_shape = shape2d(background_shape, "CenterPaste")
        self.background_filler = background_filler or ConstantBackgroundFiller(0)

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        h, w = img.shape[:2]
        bh, bw = self.background_shape
        if bh < h or bw < w:
            raise ValueError(f"CenterPaste: a {h}x{w} image does not fit on a {bh}x{bw} canvas")
        return _PasteTransform(self.background_shape, self.background_filler, int((bh - h) * 0.5),
                               int((bw - w) * 0.5))
