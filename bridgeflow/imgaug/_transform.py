"""Deterministic transforms: what an augmentor decided, applied to images and to coordinates.

An augmentor draws its random parameters in ``get_transform(img)`` and returns a :class:`Transform`
that performs exactly that change, as many times as needed: on the image, on other images of the same
datapoint (a segmentation mask), and on coordinates. Coordinates are an ``(N, 2)`` float array of
``(x, y)`` rows in pixels, where pixel ``(i, j)`` (row, column) covers ``[j, j+1) x [i, i+1)``: a
horizontal flip of a ``w`` wide image maps ``x`` to ``w - x``.

``apply_*`` methods never modify their input: they return new arrays (or views of the input).

Example:
    >>> t = CropTransform(y0=2, x0=1, h=4, w=3)
    >>> t.apply_image(np.zeros((10, 10, 3), np.uint8)).shape
    (4, 3, 3)
    >>> t.apply_coords(np.array([[1.0, 2.0]]))
    array([[0., 0.]])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from .._deps import require

__all__ = [
    "INTER_AREA",
    "INTER_CUBIC",
    "INTER_LANCZOS4",
    "INTER_LINEAR",
    "INTER_NEAREST",
    "BaseTransform",
    "CropTransform",
    "FlipTransform",
    "LazyTransform",
    "NoOpTransform",
    "PhotometricTransform",
    "ResizeTransform",
    "Transform",
    "TransformFactory",
    "TransformList",
    "TransposeTransform",
]

# OpenCV's interpolation codes (stable across OpenCV releases), so defaults need no cv2 at import time.
INTER_NEAREST, INTER_LINEAR, INTER_CUBIC, INTER_AREA, INTER_LANCZOS4 = 0, 1, 2, 3, 4


def cv2() -> ModuleType:
    """The ``cv2`` module, or an error saying to install the ``images`` extra."""
    return require("cv2", "bridgeflow.imgaug")


def keep_channel_axis(out: np.ndarray, like: np.ndarray) -> np.ndarray:
    """OpenCV drops a trailing channel axis of size 1; put it back when ``like`` had one."""
    if like.ndim == 3 and out.ndim == 2:
        return out[:, :, np.newaxis]
    return out


def as_coords(coords: Any) -> np.ndarray:
    """A float copy of ``coords`` (shape ``(N, 2)``), so a transform never changes its input."""
    out = np.array(coords, dtype=np.result_type(np.asarray(coords).dtype, np.float32), copy=True)
    if out.ndim != 2 or out.shape[1] != 2:
        raise ValueError(f"coordinates must be an (N, 2) array of (x, y) rows, got shape {out.shape}")
    return out


class BaseTransform:
    """What every transform is an instance of (tensorpack's type-check base): it changes an image
    (``apply_image``) and, when it makes sense, coordinates in it (``apply_coords``)."""

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not implement apply_image")

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} does not implement apply_coords, so coordinates "
                                  "cannot follow this augmentation")


class Transform(BaseTransform):
    """A deterministic change of an image. Subclasses implement ``apply_image`` and, when it makes sense,
    ``apply_coords``; any other ``apply_<x>`` raises ``NotImplementedError`` naming the class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("apply_"):
            def missing(_x: Any) -> Any:
                raise NotImplementedError(f"{type(self).__name__} does not implement {name}")
            return missing
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"imgaug.{type(self).__name__}({fields})"


class ResizeTransform(Transform):
    """Resize an ``h x w`` image to ``new_h x new_w`` with OpenCV interpolation ``interp``."""

    def __init__(self, h: int, w: int, new_h: int, new_w: int, interp: int = INTER_LINEAR) -> None:
        self.h, self.w, self.new_h, self.new_w, self.interp = int(h), int(w), int(new_h), int(new_w), interp

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        if img.shape[:2] != (self.h, self.w):
            raise ValueError(f"ResizeTransform was made for {self.h}x{self.w} images, got {img.shape[:2]}")
        out = cv2().resize(img, (self.new_w, self.new_h), interpolation=self.interp)
        return keep_channel_axis(out, img)

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        out = as_coords(coords)
        out[:, 0] *= self.new_w / self.w
        out[:, 1] *= self.new_h / self.h
        return out


class CropTransform(Transform):
    """Keep the ``h x w`` window whose top-left pixel is ``(y0, x0)``."""

    def __init__(self, y0: int, x0: int, h: int, w: int) -> None:
        self.y0, self.x0, self.h, self.w = int(y0), int(x0), int(h), int(w)

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        H, W = img.shape[:2]
        if self.y0 < 0 or self.x0 < 0 or self.y0 + self.h > H or self.x0 + self.w > W:
            raise ValueError(f"CropTransform window {self.h}x{self.w} at (y0={self.y0}, x0={self.x0}) does "
                             f"not fit in a {H}x{W} image")
        return img[self.y0:self.y0 + self.h, self.x0:self.x0 + self.w]

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        out = as_coords(coords)
        out[:, 0] -= self.x0
        out[:, 1] -= self.y0
        return out


class FlipTransform(Transform):
    """Mirror an ``h x w`` image left-right (``horiz=True``) or top-bottom."""

    def __init__(self, h: int, w: int, horiz: bool = True) -> None:
        self.h, self.w, self.horiz = int(h), int(w), bool(horiz)

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        return img[:, ::-1] if self.horiz else img[::-1]

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        out = as_coords(coords)
        if self.horiz:
            out[:, 0] = self.w - out[:, 0]
        else:
            out[:, 1] = self.h - out[:, 1]
        return out


class TransposeTransform(Transform):
    """Swap rows and columns (x and y)."""

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        return keep_channel_axis(cv2().transpose(img), img)

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        return as_coords(coords)[:, ::-1].copy()


class NoOpTransform(Transform):
    """Leaves everything as it is (every ``apply_*`` returns its input)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("apply_"):
            return lambda x: x
        raise AttributeError(f"NoOpTransform has no attribute {name!r}")

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        return img

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        return coords


class PhotometricTransform(Transform):
    """Changes pixel values only: ``func(img)`` on images, coordinates unchanged."""

    def __init__(self, func: Callable[[np.ndarray], np.ndarray], name: str | None = None) -> None:
        self._func = func
        self._name = name

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        return self._func(img)

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        return coords

    def __repr__(self) -> str:
        return f"imgaug.PhotometricTransform({self._name or ''})"


class TransformFactory(Transform):
    """A transform from functions given by keyword: ``TransformFactory(apply_image=f, apply_coords=g)``."""

    def __init__(self, name: str | None = None, **kwargs: Callable[[Any], Any]) -> None:
        for key, func in kwargs.items():
            if not key.startswith("apply_"):
                raise TypeError(f"TransformFactory takes apply_<x>= functions, got {key}=")
            setattr(self, key, func)
        self._name = name

    def __repr__(self) -> str:
        return f"imgaug.TransformFactory({self._name or ''})"


class TransformList(BaseTransform):
    """Several transforms applied one after the other (``apply_<x>`` runs each one's ``apply_<x>``)."""

    def __init__(self, tfms: Sequence[BaseTransform]) -> None:
        for t in tfms:
            if not isinstance(t, BaseTransform) and not hasattr(t, "apply_image"):
                raise TypeError(f"TransformList takes transforms, got {t!r}")
        self.tfms = list(tfms)

    def _apply(self, x: Any, method: str) -> Any:
        for t in self.tfms:
            x = getattr(t, method)(x)
        return x

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        return self._apply(img, "apply_image")

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        return self._apply(coords, "apply_coords")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("apply_"):
            return lambda x: self._apply(x, name)
        raise AttributeError(f"TransformList has no attribute {name!r}")

    def __add__(self, other: BaseTransform) -> TransformList:
        return TransformList(self.tfms + (other.tfms if isinstance(other, TransformList) else [other]))

    def __radd__(self, other: BaseTransform) -> TransformList:
        return TransformList((other.tfms if isinstance(other, TransformList) else [other]) + self.tfms)

    def __repr__(self) -> str:
        inner = ",\n".join("  " + repr(t) for t in self.tfms)
        return f"imgaug.TransformList([\n{inner}])"


class LazyTransform(BaseTransform):
    """A transform decided by ``get_transform(img)`` when its first image arrives.

    An augmentor in a chain sees the previous one's output, so its transform can only be made once that
    output exists. Other ``apply_<x>`` calls must come after ``apply_image``.
    """

    def __init__(self, get_transform: Callable[[np.ndarray], BaseTransform]) -> None:
        self.get_transform = get_transform
        self._transform: BaseTransform | None = None

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        if self._transform is None:
            self._transform = self.get_transform(img)
        return self._transform.apply_image(img)

    def _apply(self, x: Any, method: str) -> Any:
        if self._transform is None:
            raise RuntimeError(f"{method} of a chained augmentor runs only after apply_image: the augmentor "
                               "decides its transform from the image it receives")
        return getattr(self._transform, method)(x)

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        return self._apply(coords, "apply_coords")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("apply_"):
            return lambda x: self._apply(x, name)
        raise AttributeError(f"LazyTransform has no attribute {name!r}")

    def __repr__(self) -> str:
        return repr(self._transform) if self._transform is not None else "imgaug.LazyTransform(pending)"
