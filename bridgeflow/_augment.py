"""Flows that augment image components: tensorpack's AugmentImageComponent(s) and AugmentImageCoordinates.

``augmentors`` is an ``imgaug.AugmentorList`` or a list whose items may be bridgeflow or tensorpack
augmentors, albumentations or torchvision transforms, or functions of an image (a single pipeline
object, such as an albumentations ``Compose``, is taken as a list of one). ``reset_state()`` seeds the
augmentors in the process that iterates, so parallel workers that reset their copy of the flow
augment differently from one another, reproducibly for a fixed worker seed.

``copy=True`` gives the augmentors a copy of each image, so augmentors that work in place never change
the source's arrays (turn it off when the source makes new arrays anyway, e.g. decoding from files).
``catch_exceptions=True`` drops a datapoint whose augmentation raises, logging the first ten errors
and every hundredth after; without it the error propagates.

Example:
    >>> import numpy as np
    >>> from bridgeflow import DataFromList, imgaug
    >>> augs = [imgaug.RandomCrop(224), imgaug.Flip(horiz=True)]
    >>> images_and_labels = DataFromList([[np.zeros((256, 256, 3), np.uint8), 7]])
    >>> df = AugmentImageComponent(images_and_labels, augs)
    >>> df.reset_state(); [np.shape(c) for c in next(iter(df))]
    [(224, 224, 3), ()]
    >>> image_mask_points = DataFromList([[np.zeros((256, 256, 3), np.uint8), np.zeros((256, 256), np.uint8),
    ...                                    np.array([[10.0, 20.0]])]])
    >>> df = AugmentImageComponents(image_mask_points, augs, index=(0, 1), coords_index=(2,))
    >>> df.reset_state(); [np.shape(c) for c in next(iter(df))]  # same crop and flip for all three
    [(224, 224, 3), (224, 224), (1, 2)]
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from ._base import DataFlow
from ._proxy import ProxyDataFlow
from ._state import child_state, rng_state, set_rng_state
from ._state_schema import Child, Rngs
from ._transforms import get_component
from .imgaug._base import ImageAugmentor, check_dtype
from .imgaug._meta import AugmentorList

__all__ = ["AugmentImageComponent", "AugmentImageComponents", "AugmentImageCoordinates"]

log = logging.getLogger(__name__)


def _as_list(augmentors: Any) -> AugmentorList:
    if isinstance(augmentors, AugmentorList):
        return augmentors
    if not isinstance(augmentors, (list, tuple)):
        augmentors = [augmentors]
    return AugmentorList(list(augmentors))


def _augmentors_in(obj: Any, out: list, seen: set) -> list:
    """Every augmentor in the tree under ``obj`` (lists, combinators, wrapped augmentors), in a fixed order."""
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    if isinstance(obj, ImageAugmentor):
        out.append(obj)
        values = list(vars(obj).values())
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    else:
        return out
    for value in values:
        if isinstance(value, (ImageAugmentor, list, tuple)):
            _augmentors_in(value, out, seen)
    return out


def check_coords(coords: Any, who: str) -> None:
    """Coordinates are a floating point ``(N, 2)`` array of ``(x, y)`` rows."""
    if not isinstance(coords, np.ndarray) or coords.ndim != 2 or coords.shape[1] != 2:
        shape = getattr(coords, "shape", type(coords).__name__)
        raise ValueError(f"{who}: coordinates must be an (N, 2) numpy array of (x, y) rows, got {shape}")
    if coords.dtype.kind != "f":
        raise TypeError(f"{who}: coordinates must be floating point, got {coords.dtype}")


class _AugmentBase(ProxyDataFlow):
    """Holds the augmentors, resets them with the flow, and drops (or raises on) failed datapoints."""

    state_fields = (Child(), Rngs("rngs", lambda f: len(_augmentors_in(f.augs, [], set())), "augmentors' generators"))

    def __init__(self, ds: DataFlow, augmentors: Any, copy: bool, catch_exceptions: bool) -> None:
        super().__init__(ds)
        self.augs = _as_list(augmentors)
        self._copy = copy
        self.catch_exceptions = catch_exceptions
        self._nr_error = 0

    def _on_reset(self) -> None:
        super()._on_reset()
        self.augs.reset_state()

    def _own_state(self) -> dict:
        """The wrapped flow's state and the state of every augmentor's random generator: resuming draws
        the same random parameters for the datapoints that follow."""
        rngs = [rng_state(a.rng) for a in _augmentors_in(self.augs, [], set())]
        return {"child": child_state(self.ds), "rngs": rngs}

    def _augment(self, dp: Any) -> Any:
        raise NotImplementedError

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        if resume is not None:  # applied as the epoch starts, after any reset_state()
            for aug, saved in zip(_augmentors_in(self.augs, [], set()), resume["rngs"]):
                if saved is not None:
                    set_rng_state(aug.rng, saved)
        return self._augmented(iter(self.ds))

    def _augmented(self, source: Iterator) -> Iterator:
        for dp in source:
            if not self.catch_exceptions:
                yield self._augment(dp)
                continue
            try:
                out = self._augment(dp)
            except Exception:
                self._nr_error += 1
                if self._nr_error <= 10 or self._nr_error % 100 == 0:
                    log.exception("%s: augmentation failed, datapoint dropped (%d so far)", type(self).__name__,
                                  self._nr_error)
                continue
            yield out

    def _own_stats(self) -> dict[str, float]:
        return {"augment_errors": float(self._nr_error)}


def _mutable(dp: Any) -> Any:
    return dict(dp) if isinstance(dp, dict) else list(dp)


def _restore(dp: Any, like: Any) -> Any:
    return tuple(dp) if isinstance(like, tuple) else dp


class AugmentImageComponent(_AugmentBase):
    """Augment the image at ``index`` (a position, or a key of dict datapoints) of every datapoint."""

    def __init__(self, ds: DataFlow, augmentors: Any, index: Hashable = 0, copy: bool = True,
                 catch_exceptions: bool = False) -> None:
        super().__init__(ds, augmentors, copy, catch_exceptions)
        self.index = index

    def _augment(self, dp: Any) -> Any:
        who = f"{type(self).__name__} component {self.index!r}"
        img = get_component(dp, self.index, type(self).__name__)
        check_dtype(img, who)
        if self._copy:
            img = img.copy()
        out = _mutable(dp)
        out[self.index] = self.augs.augment(img)
        return _restore(out, dp)


class AugmentImageComponents(_AugmentBase):
    """Augment several images of a datapoint with the same random parameters, and move coordinates along.

    The first image in ``index`` decides the parameters; every other image in ``index`` (a mask, a depth
    map of the same size) gets the same transforms, and every ``(N, 2)`` coordinate array in
    ``coords_index`` is transformed to match.
    """

    def __init__(self, ds: DataFlow, augmentors: Any, index: Sequence[Hashable] = (0, 1),
                 coords_index: Sequence[Hashable] = (), copy: bool = True, catch_exceptions: bool = False) -> None:
        super().__init__(ds, augmentors, copy, catch_exceptions)
        if isinstance(index, (str, bytes)) or not isinstance(index, Sequence) or not index:
            raise ValueError(f"AugmentImageComponents index must be a non-empty sequence of positions or keys, "
                             f"got {index!r}")
        self.index = tuple(index)
        self.coords_index = tuple(coords_index)

    def _augment(self, dp: Any) -> Any:
        who = type(self).__name__
        out = _mutable(dp)
        first = get_component(dp, self.index[0], who)
        check_dtype(first, f"{who} component {self.index[0]!r}")
        first = first.copy() if self._copy else first
        tfms = self.augs.get_transform(first)
        out[self.index[0]] = tfms.apply_image(first)
        for idx in self.index[1:]:
            img = get_component(dp, idx, who)
            check_dtype(img, f"{who} component {idx!r}")
            out[idx] = tfms.apply_image(img.copy() if self._copy else img)
        for idx in self.coords_index:
            coords = get_component(dp, idx, who)
            check_coords(coords, f"{who} component {idx!r}")
            out[idx] = tfms.apply_coords(coords.copy() if self._copy else coords)
        return _restore(out, dp)


class AugmentImageCoordinates(AugmentImageComponents):
    """Augment the image at ``img_index`` and move the ``(N, 2)`` coordinates at ``coords_index`` along."""

    def __init__(self, ds: DataFlow, augmentors: Any, img_index: Hashable = 0, coords_index: Hashable = 1,
                 copy: bool = True, catch_exceptions: bool = False) -> None:
        super().__init__(ds, augmentors, index=(img_index,), coords_index=(coords_index,), copy=copy,
                         catch_exceptions=catch_exceptions)
        self.img_index = img_index
