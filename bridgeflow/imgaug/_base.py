"""Augmentors: random policies that decide, per image, a deterministic :class:`Transform`.

``aug.get_transform(img)`` draws the random parameters from ``aug.rng`` and returns the transform;
``aug.augment(img)`` is ``get_transform(img).apply_image(img)``. Images are ``(h, w)`` or ``(h, w, c)``
arrays, uint8 in ``[0, 255]`` or floating point.

Random numbers. ``aug.rng`` is a ``numpy.random.RandomState`` made by :func:`bridgeflow.get_rng` in
``reset_state()``: reproducible when ``aug.seed`` is set, and distinct per parallel worker, because
workers reset their copy of the flow (and so its augmentors) inside their own seed scope. Inside a
:class:`bridgeflow.sample_scope` (the torch ``DataLoader(seed_per_sample=True)`` enters one per sample),
``aug.rng`` is the sample's generator instead: what is drawn for a sample depends on its seed only.
``AugmentorList`` and the other augmentors that hold augmentors reset each child with a seed drawn from
their own generator, so no two augmentors of a pipeline draw the same stream. An augmentor that was
never reset seeds itself on first use; so does a copy in a forked or spawned process that nobody
reset (from OS entropy then, so that copies never repeat one another).

Subclassing, as in tensorpack: implement ``get_transform(img)`` returning a transform; or, for a
change of pixel values only, subclass :class:`PhotometricAugmentor` and implement
``_get_augment_params(img)`` and ``_augment(img, params)``.

Example:
    >>> class Invert(PhotometricAugmentor):
    ...     def _augment(self, img, _):
    ...         return 255 - img
    >>> Invert().augment(np.zeros((1, 2), np.uint8))
    array([[255, 255]], dtype=uint8)
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._rng import get_rng, sample_rng, worker_seed_scope
from ._transform import BaseTransform, PhotometricTransform, TransformFactory

__all__ = ["Augmentor", "ImageAugmentor", "MapImage", "PhotometricAugmentor", "check_dtype", "reset_children"]

log = logging.getLogger(__name__)


def check_dtype(img: Any, who: str = "augmentor input") -> None:
    """Images are numpy arrays, uint8 or floating point (other integer types are refused)."""
    if not isinstance(img, np.ndarray):
        raise TypeError(f"{who} must be a numpy array (an HWC or HW image), got {type(img).__name__}")
    if img.dtype.kind in "iub" and img.dtype != np.uint8:
        raise TypeError(f"{who} has dtype {img.dtype}; augmentors take uint8 or floating point images")


def _deprecated(call: str, instead: str) -> None:
    warnings.warn(f"imgaug: {call} is deprecated (as in tensorpack 0.11): use {instead}", DeprecationWarning,
                  stacklevel=3)


def reset_children(parent: ImageAugmentor, children: Sequence[Any]) -> None:
    """Reset each child augmentor with its own seed, drawn from ``parent.rng``."""
    for child in children:
        seed = int(parent.rng.randint(0, 2**62))
        reset = getattr(child, "reset_state", None)
        if reset is not None:
            with worker_seed_scope(seed):
                reset()


class ImageAugmentor:
    """Base of every augmentor. Subclasses implement ``get_transform(img)`` (see the module docstring).

    ``seed`` (a class attribute, or set on an instance) makes ``reset_state()`` reproducible.
    """

    seed: int | None = None

    def __init__(self) -> None:  # subclasses need not call it: the generator is made when first used
        pass

    def _init(self, params: dict | None = None) -> None:
        """tensorpack's helper: ``self._init(locals())`` stores the constructor's arguments as attributes."""
        for k, v in (params or {}).items():
            if k != "self" and not k.startswith("_"):
                setattr(self, k, v)

    # --- random numbers ---------------------------------------------------------------------------
    @property
    def rng(self) -> np.random.RandomState:
        sample = sample_rng()
        if sample is not None:  # inside a sample_scope: the sample's generator (see bridgeflow.sample_scope)
            return sample
        d = self.__dict__
        rng = d.get("_bf_rng")
        if rng is None or d.get("_bf_rng_pid") != os.getpid():
            if rng is not None or d.get("_bf_copied", False):
                # a forked or unpickled copy that nobody reset: never repeat the original's stream
                log.debug("%s: seeding a copy in process %d that was not reset", type(self).__name__,
                          os.getpid())
                self.rng = get_rng(self, None)
            else:
                self.reset_state()
            if d.get("_bf_rng") is None or d.get("_bf_rng_pid") != os.getpid():  # reset_state set none
                self.rng = get_rng(self, self.seed)
            rng = d["_bf_rng"]
        return rng

    @rng.setter
    def rng(self, value: np.random.RandomState) -> None:
        self.__dict__["_bf_rng"] = value
        self.__dict__["_bf_rng_pid"] = os.getpid()

    def reset_state(self) -> None:
        """Seed ``self.rng`` (``bridgeflow.get_rng``: from ``self.seed`` and the worker's seed, if any).

        The flow that applies the augmentor calls it in the process that iterates (see the module
        docstring); call it yourself to reuse an augmentor outside a flow.
        """
        self.rng = get_rng(self, self.seed)

    def _rand_range(self, low: float = 1.0, high: float | None = None, size: Any = None) -> Any:
        """A uniform float32 in ``[low, high)`` (``[0, low)`` with one argument), drawn from ``self.rng``."""
        if high is None:
            low, high = 0.0, low
        return self.rng.uniform(low, high, [] if size is None else size).astype("float32")

    # --- the API ----------------------------------------------------------------------------------
    def get_transform(self, img: np.ndarray) -> BaseTransform:
        """Draw this image's random parameters and return the deterministic transform that applies them.

        The default supports tensorpack's older augmentors, which define ``_get_augment_params(img)``
        and ``_augment(img, params)`` (and optionally ``_augment_coords(coords, params)``).
        """
        if not hasattr(self, "_augment"):
            raise NotImplementedError(f"{type(self).__name__} must implement get_transform(img) (or "
                                      "tensorpack's older _get_augment_params/_augment pair)")
        params = self._get_augment_params(img) if hasattr(self, "_get_augment_params") else None
        if isinstance(params, BaseTransform):
            return params
        coords = getattr(self, "_augment_coords", None)
        return TransformFactory(
            name=type(self).__name__,
            apply_image=lambda im: self._augment(im, params),
            apply_coords=(lambda c: coords(c, params)) if coords is not None else (lambda c: c))

    def augment(self, img: np.ndarray) -> np.ndarray:
        """Augment one image (for a transform to reuse on masks or coordinates, use get_transform)."""
        check_dtype(img)
        return self.get_transform(img).apply_image(img)

    # --- tensorpack's older calls, deprecated there (0.11) in favour of get_transform -------------------
    def augment_return_params(self, img: np.ndarray) -> tuple[np.ndarray, BaseTransform]:
        """Deprecated: ``(t.apply_image(img), t)`` for ``t = get_transform(img)``."""
        _deprecated("augment_return_params(img)", "t = get_transform(img); t.apply_image(img)")
        t = self.get_transform(img)
        return t.apply_image(img), t

    def augment_with_params(self, img: np.ndarray, params: BaseTransform) -> np.ndarray:
        """Deprecated: ``params.apply_image(img)``, ``params`` being what :meth:`augment_return_params` gave."""
        _deprecated("augment_with_params(img, t)", "t.apply_image(img)")
        return params.apply_image(img)

    def augment_coords(self, coords: np.ndarray, params: BaseTransform) -> np.ndarray:
        """Deprecated: ``params.apply_coords(coords)``."""
        _deprecated("augment_coords(coords, t)", "t.apply_coords(coords)")
        return params.apply_coords(coords)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_bf_rng", None)
        state.pop("_bf_rng_pid", None)
        state["_bf_copied"] = True
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if not k.startswith("_") and k not in ("rng",))
        return f"imgaug.{type(self).__name__}({fields})"


Augmentor = ImageAugmentor  # tensorpack's older name


class PhotometricAugmentor(ImageAugmentor):
    """An augmentor that changes pixel values only; coordinates pass through.

    Subclasses implement ``_get_augment_params(img)`` (draw the random parameters; default ``None``) and
    ``_augment(img, params)``.
    """

    def _get_augment_params(self, img: np.ndarray) -> Any:
        return None

    def _augment(self, img: np.ndarray, params: Any) -> np.ndarray:
        raise NotImplementedError(f"{type(self).__name__} must implement _augment(img, params)")

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        params = self._get_augment_params(img)
        return PhotometricTransform(lambda im: self._augment(im, params), name=type(self).__name__)


class MapImage(ImageAugmentor):
    """Apply ``func(img) -> img``; coordinates go through ``coord_func(coords) -> coords`` when given
    (without it, coordinates cannot follow and asking for them is an error)."""

    def __init__(self, func: Callable[[np.ndarray], np.ndarray],
                 coord_func: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        if not callable(func):
            raise TypeError(f"MapImage needs a function of an image, got {func!r}")
        self.func, self.coord_func = func, coord_func

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        name = getattr(self.func, "__qualname__", "MapImage")
        if self.coord_func is not None:
            return TransformFactory(name=name, apply_image=self.func, apply_coords=self.coord_func)
        return TransformFactory(name=name, apply_image=self.func)
