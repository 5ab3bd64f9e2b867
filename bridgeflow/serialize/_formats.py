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
import warnings

from .._base import DataFlow
from .._serialize_errors import CorruptDataError, DatasetNotFoundError
from ._common import sniff
from ._pinned import PinnedFile

__all__ = ["EXTENSIONS", "FORMATS", "detect_format", "load", "load_dataset"]

FORMATS = ("lmdb", "hdf5", "npz")
EXTENSIONS = {".lmdb": "lmdb", ".mdb": "lmdb", ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".npz": "npz"}


def detect_format(path: str) -> str:
    """``lmdb``, ``hdf5`` or ``npz`` from the file's content, each format's signature at its real place (the
    extension only breaks ties); a path that is neither a regular file nor an LMDB folder is refused."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "data.mdb")):
            return "lmdb"
        raise CorruptDataError(f"{path} is a folder but not an LMDB folder (no data.mdb)")
    pin = PinnedFile(path, "load_dataset")  # refused unless a regular file: a FIFO is never waited on
    try:
        found = sniff(pin)
    finally:
        pin.close()
    if found is not None:
        return found
    ext = EXTENSIONS.get(os.path.splitext(path)[1].lower())
    if ext is None:
        raise CorruptDataError(f"{path}: not an LMDB, HDF5 or npz file (unknown content and extension)")
    return ext


def load_dataset(path: str | os.PathLike, *, shuffle: bool = False, seed: int | None = None,
                 allow_pickle: bool = False, format: str | None = None, fmt: str | None = None,
                 allow_external: bool = False) -> DataFlow:
    """The loaded flow of an LMDB, HDF5 or npz dataset file, its format recognised from its content.

    ``allow_external=True`` lets an HDF5 file read data that lies in other files (external links,
    external storage, virtual datasets), refused by default (:class:`ExternalDataError`): only for files
    you trust, as ``allow_pickle`` for pickled LMDB values.

    ``format`` (the name the loaders and ``bridgeflow serialize --format`` use): ``"lmdb"``, ``"hdf5"``,
    ``"npz"``, or ``"tensorpack"`` (an LMDB file written by tensorpack's ``LMDBSerializer.save``), to
    insist on one; ``fmt=`` is its deprecated name.
    """
    path = os.fspath(path)
    if fmt is not None:
        warnings.warn("load_dataset(fmt=...) is deprecated: pass format=... (the keyword every loader and "
                      "bridgeflow serialize --format use)", DeprecationWarning, stacklevel=2)
        if format is not None and format != fmt:
            raise ValueError(f"load_dataset: format={format!r} and fmt={fmt!r} disagree; pass format= only")
        format = fmt
    if format is not None and format not in (*FORMATS, "tensorpack"):
        raise ValueError(f"unknown format {format!r}; choose one of {[*FORMATS, 'tensorpack']}")
    if not os.path.exists(path):
        raise DatasetNotFoundError(f"no such dataset file: {path}")
    found = detect_format(path) if format in (None, "tensorpack") else format
    if found == "lmdb":
        from ._lmdb_format import LMDBDataset

        return LMDBDataset(path, shuffle=shuffle, seed=seed, allow_pickle=allow_pickle,
                           format="tensorpack" if format == "tensorpack" else None)
    if format == "tensorpack":
        raise CorruptDataError(f"{path} is not an LMDB file, so not one tensorpack's LMDBSerializer wrote "
                               f"(it is {found}); leave format=None to load it")
    if found == "hdf5":
        from ._hdf5_format import HDF5Data

        return HDF5Data(path, shuffle=shuffle, seed=seed, allow_external=allow_external)
    from ._npz_format import NumpyData

    return NumpyData(path, shuffle=shuffle, seed=seed)


load = load_dataset  # ``bridgeflow.serialize.load(path, shuffle=...)``
