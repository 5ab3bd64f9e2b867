"""Which dataset format a file is, and one loader for all of them.

Example:
    >>> from bridgeflow import DataFromList
    >>> from bridgeflow.serialize import HDF5Serializer
    >>> HDF5Serializer.save(DataFromList([[1], [2]]), "train.data", progress=False)
    2
    >>> detect_format("train.data")  # from the file's first bytes, not its name
    'hdf5'
    >>> ds = load("train.data", shuffle=True)
    >>> sorted(int(dp[0]) for dp in ds)
    [1, 2]
"""

from __future__ import annotations

import os

from ..base import DataFlow
from .errors import CorruptDataError, DatasetNotFoundError

__all__ = ["EXTENSIONS", "FORMATS", "detect_format", "load", "load_dataset"]

FORMATS = ("lmdb", "hdf5", "npz")
EXTENSIONS = {".lmdb": "lmdb", ".mdb": "lmdb", ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".npz": "npz"}
_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")


def detect_format(path: str) -> str:
    """``lmdb``, ``hdf5`` or ``npz`` from the file's first bytes (the extension only breaks ties)."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "data.mdb")):
            return "lmdb"
        raise CorruptDataError(f"{path} is a folder but not an LMDB folder (no data.mdb)")
    with open(path, "rb") as f:
        head = f.read(32)
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "hdf5"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "npz"
    if head[16:20] == _LMDB_MAGIC:
        return "lmdb"
    ext = EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if ext is None:
        raise CorruptDataError(f"{path}: not an LMDB, HDF5 or npz file (unknown content and extension)")
    return ext


def load_dataset(path: str | os.PathLike, *, shuffle: bool = False, seed: int | None = None,
                 allow_pickle: bool = False, fmt: str | None = None) -> DataFlow:
    """The loaded flow of an LMDB, HDF5 or npz dataset file, format detected from its content."""
    path = os.fspath(path)
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    if not os.path.exists(path):
        raise DatasetNotFoundError(f"no such dataset file: {path}")
    fmt = fmt or detect_format(path)
    if fmt == "lmdb":
        from .lmdb_format import LMDBDataset

        return LMDBDataset(path, shuffle=shuffle, seed=seed, allow_pickle=allow_pickle)
    if fmt == "hdf5":
        from .hdf5_format import HDF5Data

        return HDF5Data(path, shuffle=shuffle, seed=seed)
    from .npz_format import NumpyData

    return NumpyData(path, shuffle=shuffle, seed=seed)


load = load_dataset  # ``bridgeflow.serialize.load(path, shuffle=...)``
