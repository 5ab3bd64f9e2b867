"""ILSVRC12 (ImageNet-1k) from a local copy laid out as tensorpack expects; nothing is downloaded.

The images::

    DIR/train/n01440764/n01440764_10026.JPEG ...   one folder per synset
    DIR/val/ILSVRC2012_val_00000001.JPEG ...       flat ('original' layout), or one folder per synset
    DIR/test/ILSVRC2012_test_00000001.JPEG ...

The labels come from the metadata of Caffe's ``caffe_ilsvrc12.tar.gz``, extracted into ``meta_dir``
(default ``$TENSORPACK_DATASET/ilsvrc_metadata``, else ``~/tensorpack_data/ilsvrc_metadata``, as in
tensorpack): ``train.txt``, ``val.txt`` and ``test.txt`` list ``<relative path> <label>`` per line,
and ``synsets.txt`` lists the 1000 synset ids in label order (``synset_words.txt`` their names).
Files are listed in the metadata's order, so labels are tensorpack's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

from .._image_sources import read_image
from .._order import IndexedSource
from ._files import dataset_path, require_path

__all__ = ["ILSVRC12", "ILSVRC12Files", "ILSVRCMeta"]

log = logging.getLogger(__name__)

CAFFE_META = "caffe_ilsvrc12.tar.gz (http://dl.caffe.berkeleyvision.org/caffe_ilsvrc12.tar.gz)"
_NAMES = ("train", "val", "test")


class ILSVRCMeta:
    """The metadata files of ILSVRC12 in ``dir`` (see the module docstring)."""

    def __init__(self, dir: str | None = None) -> None:
        self.dir = os.path.expanduser(dir) if dir is not None else dataset_path("ilsvrc_metadata")
        require_path(self.dir, "folder", f"it holds ILSVRC12's metadata: get {CAFFE_META}, extract it there, "
                                         "or pass meta_dir= (or set $TENSORPACK_DATASET)")

    def _file(self, name: str) -> str:
        return require_path(os.path.join(self.dir, name), "file",
                            f"it is part of {CAFFE_META}; extract that archive into {self.dir}")

    def _lines(self, name: str) -> list[str]:
        with open(self._file(name)) as f:
            return [line.strip() for line in f if line.strip()]

    def get_synset_1000(self) -> dict[int, str]:
        """``{label: synset id}`` from synsets.txt."""
        return dict(enumerate(self._lines("synsets.txt")))

    def get_synset_words_1000(self) -> dict[int, str]:
        """``{label: synset id and words}`` from synset_words.txt."""
        return dict(enumerate(self._lines("synset_words.txt")))

    def get_image_list(self, name: str, dir_structure: str = "original") -> list[tuple[str, int]]:
        """``[(path relative to DIR/name, label)]`` from ``name``.txt; with ``dir_structure='train'`` the
        val/test paths get their synset folder in front."""
        if name not in _NAMES:
            raise ValueError(f"ILSVRC12 name must be one of {_NAMES}, got {name!r}")
        if dir_structure not in ("original", "train"):
            raise ValueError(f"dir_structure must be 'original' or 'train', got {dir_structure!r}")
        synsets = self.get_synset_1000() if name != "train" and dir_structure == "train" else None
        path = self._file(f"{name}.txt")
        out = []
        for lineno, line in enumerate(self._lines(f"{name}.txt"), 1):
            parts = line.split()
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise ValueError(f"{path} line {lineno}: expected '<image path> <label>', got {line!r}")
            fname, label = parts[0], int(parts[1])
            if synsets is not None:
                if label not in synsets:
                    raise ValueError(f"{path} line {lineno}: label {label} has no synset in synsets.txt")
                fname = os.path.join(synsets[label], fname)
            out.append((fname, label))
        if not out:
            raise ValueError(f"{path} lists no image")
        return out

    @staticmethod
    def guess_dir_structure(dir: str) -> str:
        """``'train'`` when ``dir`` holds synset folders (``n...``), else ``'original'``."""
        with os.scandir(dir) as entries:
            nested = any(e.is_dir() and e.name.startswith("n") for e in entries)
        structure = "train" if nested else "original"
        log.info("ILSVRC12: %s has the %r layout", dir, structure)
        return structure


class ILSVRC12Files(IndexedSource):
    """``[path, label]`` for every image of ILSVRC12 ``name`` ('train', 'val' or 'test').

    Args:
        dir: the folder holding ``train/``, ``val/``, ``test/``.
        name: which split.
        meta_dir: the metadata folder (see the module docstring).
        shuffle: a new random order every epoch; default True for 'train'.
        dir_structure: 'original' (flat val/test folders) or 'train' (synset folders); guessed when None.
            'train' is always 'train'.
        shard: ``(rank, world)`` or ``"auto"``: this rank's part of every epoch (see :mod:`bridgeflow._shard`).
    """

    def __init__(self, dir: str, name: str, meta_dir: str | None = None, shuffle: bool | None = None,
                 dir_structure: str | None = None, *, seed: int | None = None,
                 shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> None:
        if name not in _NAMES:
            raise ValueError(f"ILSVRC12 name must be one of {_NAMES}, got {name!r}")
        dir = os.path.expanduser(dir)
        require_path(dir, "folder", "pass the folder that holds ILSVRC12's train/, val/ and test/ folders")
        self.full_dir = require_path(os.path.join(dir, name), "folder",
                                     f"extract ILSVRC2012_img_{name}.tar there (the train archive holds one "
                                     "tar per synset: extract each into train/<synset>/)")
        self.name = name
        self.shuffle = name == "train" if shuffle is None else shuffle
        self.seed = seed
        if name == "train":
            dir_structure = "train"
        elif dir_structure is None:
            dir_structure = ILSVRCMeta.guess_dir_structure(self.full_dir)
        self.imglist = ILSVRCMeta(meta_dir).get_image_list(name, dir_structure)
        for fname, _ in self.imglist[:10]:  # a cheap check of the layout; every file is checked when read
            require_path(os.path.join(self.full_dir, fname), "file",
                         f"it is listed in {name}.txt of the metadata; is {self.full_dir} complete, and is "
                         f"dir_structure={dir_structure!r} right?")

        self._init_order(len(self.imglist), self.shuffle, shard, drop_last)

    def _identity(self) -> dict:
        return {"images": len(self.imglist)}

    def _read(self, runs: list, pos: int) -> Iterator[list]:
        for it, _, _ in self._order.iters(runs, pos):
            for k in it:
                fname, label = self.imglist[k]
                yield self._item(os.path.join(self.full_dir, fname), label)

    def _item(self, path: str, label: int) -> list:
        return [path, label]


class ILSVRC12(ILSVRC12Files):
    """``[image, label]`` for every image of ILSVRC12 ``name``: uint8 ``(h, w, 3)`` BGR, label in [0, 1000).

    Same arguments as :class:`ILSVRC12Files`; an image that cannot be read raises an error naming it.
    """

    def _item(self, path: str, label: int) -> list:
        return [read_image(path), label]
