"""Augmentors built from other augmentors or from plain functions.

Each one resets its children with seeds drawn from its own generator (see :mod:`bridgeflow.imgaug._base`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._base import ImageAugmentor, check_dtype, reset_children
from ._external import as_augmentor
from ._transform import BaseTransform, LazyTransform, NoOpTransform, TransformList

__all__ = ["AugmentorList", "Identity", "RandomApplyAug", "RandomChooseAug", "RandomOrderAug"]


def _augmentor(obj: Any, who: str) -> ImageAugmentor:
    return as_augmentor(obj, who)


class Identity(ImageAugmentor):
    """Changes nothing."""

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        return NoOpTransform()


class RandomApplyAug(ImageAugmentor):
    """Apply ``aug`` with probability ``prob``, else nothing."""

    def __init__(self, aug: Any, prob: float) -> None:
        self.aug = _augmentor(aug, "RandomApplyAug aug")
        self.prob = prob

    def reset_state(self) -> None:
        super().reset_state()
        reset_children(self, [self.aug])

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        if self.rng.rand() < self.prob:
            return self.aug.get_transform(img)
        return NoOpTransform()


class RandomChooseAug(ImageAugmentor):
    """Apply one augmentor picked at random: ``aug_lists`` holds augmentors (equally likely) or
    ``(augmentor, probability)`` pairs."""

    def __init__(self, aug_lists: Sequence[Any]) -> None:
        if not aug_lists:
            raise ValueError("RandomChooseAug needs at least one augmentor")
        if isinstance(aug_lists[0], (tuple, list)):
            augs = [a for a, _ in aug_lists]
            prob = [float(p) for _, p in aug_lists]
        else:
            augs, prob = list(aug_lists), [1.0 / len(aug_lists)] * len(aug_lists)
        if abs(sum(prob) - 1) > 1e-6:
            raise ValueError(f"RandomChooseAug probabilities must sum to 1, got {prob}")
        self.aug_lists = [_augmentor(a, f"RandomChooseAug item {i}") for i, a in enumerate(augs)]
        self.prob = prob

    def reset_state(self) -> None:
        super().reset_state()
        reset_children(self, self.aug_lists)

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        return self.aug_lists[self.rng.choice(len(self.aug_lists), p=self.prob)].get_transform(img)


class RandomOrderAug(ImageAugmentor):
    """Apply all of ``aug_lists`` in a random order.

    Every augmentor decides its transform from the input image, so they must not change the image's
    shape (photometric augmentors, flips).
    """

    def __init__(self, aug_lists: Sequence[Any]) -> None:
        self.aug_lists = [_augmentor(a, f"RandomOrderAug item {i}") for i, a in enumerate(aug_lists)]

    def reset_state(self) -> None:
        super().reset_state()
        reset_children(self, self.aug_lists)

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        order = self.rng.permutation(len(self.aug_lists))
        tfms = [aug.get_transform(img) for aug in self.aug_lists]
        return TransformList([tfms[k] for k in order])


class AugmentorList(ImageAugmentor):
    """Apply ``augmentors`` in order; each one decides its transform from the previous one's output.

    Items may be bridgeflow or tensorpack augmentors, albumentations or torchvision v2 transforms, or
    plain functions of an image (see :func:`bridgeflow.imgaug.as_augmentor`).
    """

    def __init__(self, augmentors: Sequence[Any]) -> None:
        if not isinstance(augmentors, (list, tuple)):
            raise TypeError(f"AugmentorList takes a list of augmentors, got {type(augmentors).__name__}")
        self.augmentors = [as_augmentor(a, f"augmentor {i}") for i, a in enumerate(augmentors)]

    def reset_state(self) -> None:
        super().reset_state()
        reset_children(self, self.augmentors)

    def get_transform(self, img: np.ndarray) -> BaseTransform:
        check_dtype(img)
        tfms: list[BaseTransform] = []
        for i, aug in enumerate(self.augmentors):
            t = aug.get_transform(img) if i == 0 else LazyTransform(aug.get_transform)
            tfms.extend(t.tfms if isinstance(t, TransformList) else [t])
        return TransformList(tfms)

    def augment(self, img: np.ndarray) -> np.ndarray:
        check_dtype(img)
        for aug in self.augmentors:
            img = aug.get_transform(img).apply_image(img)
        return img

    def __repr__(self) -> str:
        inner = ",\n".join("  " + repr(a) for a in self.augmentors)
        return f"imgaug.AugmentorList([\n{inner}])"
