"""``bridgeflow.dataflow``: the module path tensorpack code imports from.

``from tensorpack.dataflow import ...`` ports as ``from bridgeflow.dataflow import ...``: this module
re-exports every public name of :mod:`bridgeflow` (``from bridgeflow.dataflow import *`` included) plus
the ``imgaug`` and ``dataset`` packages, so ``from bridgeflow.dataflow import imgaug, dataset`` works.
Neither package imports OpenCV until an augmentor or dataset needs it.

Example:
    >>> from bridgeflow.dataflow import AugmentImageComponent, BatchData, dataset, imgaug
"""

from __future__ import annotations

import bridgeflow as _bf
from bridgeflow import *  # noqa: F403 - the whole public surface, by design
from bridgeflow import dataset, imgaug

__all__ = [*_bf.__all__, "dataset", "imgaug"]
