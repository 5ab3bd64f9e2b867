"""Augmentations from other libraries, and plain functions, as augmentors.

:func:`as_augmentor` is what ``AugmentorList`` and ``AugmentImageComponent`` apply to each item they
are given:

- a bridgeflow augmentor, or any tensorpack-style object with ``get_transform`` and ``reset_state``
  (tensorpack's own augmentors included), is used as it is;
- an albumentations transform or ``Compose`` becomes :class:`Albumentations`;
- a torchvision transform (v2, or v1 on tensors) or ``Compose`` becomes :class:`TorchvisionAugmentor`;
- any other callable ``f(img) -> img`` becomes ``MapImage(f)``.

The two library wrappers draw one seed per image from the augmentor's generator and seed the library
with it for that call, so they follow bridgeflow's per-worker seeding, and the same random parameters
can be applied to several images of one datapoint (``AugmentImageComponents``). Neither can move
coordinates; asking for it is an error that says so.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from .._deps import require
from ._base import ImageAugmentor, MapImage
from ._transform import BaseTransform, Transform

__all__ = ["Albumentations", "TorchvisionAugmentor", "as_augmentor"]


def _library(obj: Any) -> str:
    return (type(obj).__module__ or "").split(".")[0]


def as_augmentor(obj: Any, who: str = "augmentor") -> Any:
    """``obj`` as an object with ``get_transform(img)`` and ``reset_state()`` (see the module docstring)."""
    if isinstance(obj, ImageAugmentor):
        return obj
    if callable(getattr(obj, "get_transform", None)) and callable(getattr(obj, "reset_state", None)):
        return obj
    library = _library(obj)
    if library == "albumentations":
        return Albumentations(obj)
    if library == "torchvision":
        return TorchvisionAugmentor(obj)
    if callable(obj):
        return MapImage(obj)
    raise TypeError(f"{who}: {obj!r} is not an augmentor; give a bridgeflow.imgaug or tensorpack augmentor, "
                    "an albumentations or torchvision transform, or a function of an image")


class _SeededCall(Transform):
    """Calls the library pipeline with the same seed for every image it is applied to."""

    def __init__(self, owner: Any, seed: int) -> None:
        self._owner, self._seed = owner, seed

    def apply_image(self, img: np.ndarray) -> np.ndarray:
        return self._owner._call(img, self._seed)

    def apply_coords(self, coords: np.ndarray) -> np.ndarray:
        raise NotImplementedError(f"{type(self._owner).__name__} cannot move coordinates; use bridgeflow.imgaug "
                                  "augmentors for datapoints with coordinates")

    def __repr__(self) -> str:
        return f"imgaug.{type(self._owner).__name__}Transform(seed={self._seed})"


class _LibraryAugmentor(ImageAugmentor):
    _lock_attr = "_bf_lock"

    def _lock(self) -> threading.Lock:
        # one call at a time per pipeline: seeding then calling it must not interleave between threads
        lock = self.__dict__.get(self._lock_attr)
        if lock is None:
            lock = self.__dict__.setdefault(self._lock_attr, threading.Lock())
        return lock

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        return _SeededCall(self, int(self.rng.randint(0, 2**31 - 1)))

    def _call(self, img: np.ndarray, seed: int) -> np.ndarray:
        raise NotImplementedError

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop(self._lock_attr, None)
        return state


class Albumentations(_LibraryAugmentor):
    """An albumentations transform or ``Compose`` (albumentations >= 2.0) as an augmentor.

    Example:
        >>> import albumentations as A
        >>> aug = Albumentations(A.Compose([A.HorizontalFlip(p=1.0)]))
        >>> aug.augment(np.array([[[1], [2], [3]]], np.uint8))[..., 0]
        array([[3, 2, 1]], dtype=uint8)
    """

    def __init__(self, augmentor: Any) -> None:
        if not callable(getattr(augmentor, "set_random_seed", None)):
            raise TypeError(f"Albumentations needs an albumentations (>= 2.0) transform or Compose, got "
                            f"{augmentor!r}")
        self.augmentor = augmentor

    def _call(self, img: np.ndarray, seed: int) -> np.ndarray:
        with self._lock():
            self.augmentor.set_random_seed(seed)
            out = self.augmentor(image=img)
        return np.asarray(out["image"])


class TorchvisionAugmentor(_LibraryAugmentor):
    """A torchvision transform (v2, or v1 working on tensors) as an augmentor of HWC numpy images.

    The image goes to the transform as a CHW ``torch.Tensor`` and comes back as an HWC array (a 2-D
    image stays 2-D), so v2 transforms treat it as an image; torch's random generator is seeded for the
    call and restored afterwards.
    """

    def __init__(self, transform: Any) -> None:
        if not callable(transform):
            raise TypeError(f"TorchvisionAugmentor needs a callable transform, got {transform!r}")
        self.transform = transform

    def _call(self, img: np.ndarray, seed: int) -> np.ndarray:
        torch = sys.modules.get("torch") or require("torch", "TorchvisionAugmentor")
        chw = np.ascontiguousarray(np.moveaxis(img if img.ndim == 3 else img[:, :, np.newaxis], -1, 0))
        with self._lock(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.transform(torch.from_numpy(chw))
        if isinstance(out, torch.Tensor):
            arr = np.moveaxis(out.detach().cpu().numpy(), 0, -1)
        else:  # a PIL image from a ToPILImage at the end
            arr = np.asarray(out)
        if arr.ndim == 3 and img.ndim == 2 and arr.shape[2] == 1:
            arr = arr[:, :, 0]
        return np.ascontiguousarray(arr)
