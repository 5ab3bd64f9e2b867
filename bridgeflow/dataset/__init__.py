"""Datasets as flows, read from a local copy laid out as tensorpack expects (nothing is downloaded).

- :class:`ILSVRC12Files` / :class:`ILSVRC12`: ImageNet-1k file names or decoded BGR images, with labels
  from Caffe's ILSVRC12 metadata (:class:`ILSVRCMeta`).
- :class:`Cifar10` / :class:`Cifar100`: the official python batches (pickle files: read only with
  ``allow_pickle=True``).

A missing file or folder raises :class:`DatasetFilesMissingError` naming it and what to get.
:func:`write_fake_ilsvrc12` and :func:`write_fake_cifar` write small fake copies laid out the same way.
"""

from ._cifar import Cifar10, Cifar100, CifarBase
from ._fake import write_fake_cifar, write_fake_ilsvrc12
from ._files import DatasetFilesMissingError, dataset_path
from ._ilsvrc import ILSVRC12, ILSVRC12Files, ILSVRCMeta

__all__ = [
    "Cifar10",
    "Cifar100",
    "CifarBase",
    "DatasetFilesMissingError",
    "ILSVRC12",
    "ILSVRC12Files",
    "ILSVRCMeta",
    "dataset_path",
    "write_fake_cifar",
    "write_fake_ilsvrc12",
]
