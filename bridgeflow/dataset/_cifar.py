"""CIFAR-10 and CIFAR-100 from their official "python version" batches; nothing is downloaded.

The layout, as the official archives extract::

    DIR/cifar-10-batches-py/data_batch_1 ... data_batch_5, test_batch, batches.meta
    DIR/cifar-100-python/train, test, meta

``DIR`` defaults to tensorpack's place: ``$TENSORPACK_DATASET/cifar10_data`` (``cifar100_data``), else
``~/tensorpack_data/cifar10_data``. The batches are Python pickles, and unpickling a file can run any
code in it: they are read only with ``allow_pickle=True`` (the one change a port from tensorpack needs),
which says that you trust the files.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._order import IndexedSource
from .._serialize_errors import PickleNotAllowedError
from ._files import dataset_path, require_path

__all__ = ["Cifar10", "Cifar100", "CifarBase"]

_SOURCES = {10: ("cifar-10-batches-py", "cifar-10-python.tar.gz"), 100: ("cifar-100-python", "cifar-100-python.tar.gz")}


def _files(dir: str, classnum: int) -> tuple[list[str], list[str], str]:
    folder = os.path.join(dir, _SOURCES[classnum][0])
    if classnum == 10:
        train = [os.path.join(folder, f"data_batch_{i}") for i in range(1, 6)]
        return train, [os.path.join(folder, "test_batch")], os.path.join(folder, "batches.meta")
    return [os.path.join(folder, "train")], [os.path.join(folder, "test")], os.path.join(folder, "meta")


def _text(key: Any) -> Any:
    return key.decode("latin1") if isinstance(key, bytes) else key


def _load(path: str) -> dict:
    """One pickled batch, with str keys (the official files come from Python 2: bytes or str keys)."""
    with open(path, "rb") as f:
        try:
            obj = pickle.load(f, encoding="bytes")
        except Exception as exc:
            raise ValueError(f"{path} is not a readable CIFAR python batch: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a CIFAR batch (a dict)")
    return {_text(k): v for k, v in obj.items()}


def _read(files: Sequence[str], classnum: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    key = "labels" if classnum == 10 else "fine_labels"
    for path in files:
        batch = _load(path)
        if "data" not in batch or key not in batch:
            raise ValueError(f"{path} lacks the 'data' or {key!r} entry of a CIFAR-{classnum} batch "
                             f"(it has {sorted(map(str, batch))})")
        data = np.asarray(batch["data"], dtype=np.uint8)
        lab = np.asarray(batch[key], dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(lab):
            raise ValueError(f"{path}: 'data' of shape {data.shape} does not hold one 32x32x3 image per label "
                             f"({len(lab)} labels)")
        images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.append(lab)
    imgs = np.ascontiguousarray(np.concatenate(images))
    imgs.flags.writeable = False  # yielded as views: an in-place change downstream must not alter the dataset
    return imgs, np.concatenate(labels)


class CifarBase(IndexedSource):
    """``[image, label]``: uint8 ``(32, 32, 3)`` RGB images and int labels of CIFAR-10 or CIFAR-100.

    Args:
        train_or_test: 'train' or 'test'.
        shuffle: a new random order every epoch; default True for 'train'.
        dir: the folder that holds the extracted archive (see the module docstring).
        cifar_classnum: 10 or 100.
        allow_pickle: read the pickled batches; required, because unpickling can run code.
        shard: ``(rank, world)`` or ``"auto"``: this rank's part of every epoch (see :mod:`bridgeflow._shard`).

    The images are read-only views of one array: copy before changing one in place
    (``AugmentImageComponent`` copies by default).
    """

    def __init__(self, train_or_test: str, shuffle: bool | None = None, dir: str | None = None,
                 cifar_classnum: int = 10, *, allow_pickle: bool = False, seed: int | None = None,
                 shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> None:
        if train_or_test not in ("train", "test"):
            raise ValueError(f"train_or_test must be 'train' or 'test', got {train_or_test!r}")
        if cifar_classnum not in (10, 100):
            raise ValueError(f"cifar_classnum must be 10 or 100, got {cifar_classnum!r}")
        self.cifar_classnum = cifar_classnum
        self.dir = os.path.expanduser(dir) if dir is not None else dataset_path(f"cifar{cifar_classnum}_data")
        folder, archive = _SOURCES[cifar_classnum]
        hint = (f"download {archive} from https://www.cs.toronto.edu/~kriz/cifar.html and extract it into "
                f"{self.dir}, or pass dir= to the folder holding {folder}/")
        train, test, self._meta_file = _files(self.dir, cifar_classnum)
        self.fs = train if train_or_test == "train" else test
        for path in self.fs:
            require_path(path, "file", hint)
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"CIFAR-{cifar_classnum}'s python batches ({self.fs[0]}, ...) are pickle files, and unpickling "
                "a file can run code in it: pass allow_pickle=True if you trust these files (the official "
                "archive from the CIFAR site)")
        self.allow_pickle = allow_pickle
        self.train_or_test = train_or_test
        self.shuffle = train_or_test == "train" if shuffle is None else shuffle
        self.seed = seed
        self._images, self._labels = _read(self.fs, cifar_classnum)
        self._init_order(len(self._labels), self.shuffle, shard, drop_last)

    def _identity(self) -> dict:
        return {"images": len(self._labels)}

    def _read(self, runs: list, pos: int) -> Iterator[list]:
        images, labels = self._images, self._labels
        for it, _, _ in self._order.iters(runs, pos):
            for k in it:
                yield [images[k], int(labels[k])]

    def _split_files(self, names: Sequence[str]) -> list[str]:
        train, test, _ = _files(self.dir, self.cifar_classnum)
        out: list[str] = []
        for name in names:
            if name not in ("train", "test"):
                raise ValueError(f"names must hold 'train' and/or 'test', got {name!r}")
            out += train if name == "train" else test
        return out

    def get_per_pixel_mean(self, names: Sequence[str] = ("train", "test")) -> np.ndarray:
        """The mean image (float32 ``(32, 32, 3)``) over the splits in ``names``."""
        files = self._split_files(names)
        if files == self.fs:
            images = self._images
        else:
            images = _read(files, self.cifar_classnum)[0]
        return images.mean(axis=0, dtype=np.float64).astype(np.float32)

    def get_per_channel_mean(self, names: Sequence[str] = ("train", "test")) -> np.ndarray:
        """The mean of each channel over the splits in ``names`` (3 values)."""
        return self.get_per_pixel_mean(names).mean(axis=(0, 1))

    def get_label_names(self) -> list[str]:
        """The class names, from the batches' meta file."""
        hint = f"it comes with the CIFAR-{self.cifar_classnum} archive; extract the whole archive"
        meta = _load(require_path(self._meta_file, "file", hint))
        key = "label_names" if self.cifar_classnum == 10 else "fine_label_names"
        if key not in meta:
            raise ValueError(f"{self._meta_file} has no {key!r} entry")
        return [_text(name) for name in meta[key]]


class Cifar10(CifarBase):
    """CIFAR-10: ``Cifar10('train', allow_pickle=True)`` (see :class:`CifarBase`)."""

    def __init__(self, train_or_test: str, shuffle: bool | None = None, dir: str | None = None,
                 *, allow_pickle: bool = False, seed: int | None = None,
                 shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> None:
        super().__init__(train_or_test, shuffle, dir, 10, allow_pickle=allow_pickle, seed=seed, shard=shard,
                         drop_last=drop_last)


class Cifar100(CifarBase):
    """CIFAR-100 with its 100 fine labels (see :class:`CifarBase`)."""

    def __init__(self, train_or_test: str, shuffle: bool | None = None, dir: str | None = None,
                 *, allow_pickle: bool = False, seed: int | None = None,
                 shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> None:
        super().__init__(train_or_test, shuffle, dir, 100, allow_pickle=allow_pickle, seed=seed, shard=shard,
                         drop_last=drop_last)
