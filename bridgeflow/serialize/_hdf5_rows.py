"""Rows of an HDF5 array column read straight from the file: one ``preadv`` a row, no libhdf5 call.

A column of fixed-shape arrays that :class:`~bridgeflow.serialize._hdf5_format.HDF5Serializer` writes is
chunked by whole rows and unfiltered, so row ``i``'s bytes lie as they are in memory, in one place of the
file that libhdf5's chunk index names. :func:`direct_rows` asks libhdf5 once per process for every
chunk's place (``H5Dchunk_iter``), checks each against the file (allocated, unfiltered, its full size,
inside the file) and returns a :class:`DirectRows` that reads a row, or a block of rows, with positioned
reads of the reader's pinned file (:mod:`bridgeflow.serialize._pinned`) into an array the datapoint owns.
Per row this skips libhdf5's selection machinery (about 20 µs of h5py's ``ds[i]``); the row CRC-32 is
still checked by the reader. A file cut short while it is read gives a short read, a
:class:`~bridgeflow.serialize.CorruptDataError` naming the file. Any other layout (filters,
chunks across rows, foreign byte order, unallocated chunks) returns ``None``: h5py reads it as before.

Example:
    >>> import h5py
    >>> from bridgeflow.serialize._pinned import PinnedFile
    >>> with h5py.File("rows.h5", "w") as f:
    ...     _ = f.create_dataset("x", data=np.arange(12, dtype=np.int32).reshape(4, 3), chunks=(1, 3))
    >>> pin = PinnedFile("rows.h5")
    >>> with h5py.File("rows.h5", "r") as f:
    ...     rows = direct_rows(f["x"], pin, "rows.h5")
    >>> rows.row(2), rows.rows(1, 3).tolist()
    (array([6, 7, 8], dtype=int32), [[3, 4, 5], [6, 7, 8]])
    >>> pin.close()
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ._lmdb_tree import cut_error
from ._pinned import PinnedFile

__all__ = ["DirectRows", "direct_rows"]


class DirectRows:
    """Rows of one array column at known places of a pinned file (see the module doc)."""

    def __init__(self, pin: PinnedFile, path: str, at: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.pin, self.path, self.at, self.shape, self.dtype = pin, path, at, tuple(shape), dtype
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    def row(self, i: int) -> np.ndarray:
        """Row ``i``, read into a new array."""
        out = np.empty(self.shape, self.dtype)
        off = int(self.at[i])
        if os.preadv(self.pin.ensure(), [out.reshape(-1).view(np.uint8).data], off) != self.nbytes:
            raise cut_error(self.pin, self.path, off, self.nbytes, f"row {i}")
        return out

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` as one ``(stop - start, *shape)`` array: one read for each run of rows lying
        end to end in the file (a chunk of several rows, or chunks written one after another)."""
        out = np.empty((stop - start, *self.shape), self.dtype)
        flat, fd, size = out.reshape(-1).view(np.uint8).data, self.pin.ensure(), self.nbytes
        at = self.at[start:stop]
        breaks = np.flatnonzero(np.diff(at) != size) + 1  # where a row does not follow the one before
        for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), len(at)]):
            off, n = int(at[a]), (b - a) * size
            if os.preadv(fd, [flat[a * size:b * size]], off) != n:
                raise cut_error(self.pin, self.path, off, n, f"rows {start + a}..{start + b - 1}")
        return out


def direct_rows(ds: Any, pin: PinnedFile, path: str) -> DirectRows | None:
    """A :class:`DirectRows` for the h5py dataset ``ds`` of the file ``pin`` holds, where its rows can be
    read straight from the file (see the module doc); else ``None``."""
    import h5py

    shape, n = tuple(ds.shape[1:]), int(ds.shape[0]) if ds.shape else 0
    chunks = ds.chunks
    if not n or not shape or chunks is None or tuple(chunks[1:]) != shape or sys.byteorder != "little" or \
            not ds.dtype.isnative or ds.dtype.hasobject or ds.dtype.kind not in "biufc":
        return None
    try:
        dcpl = ds.id.get_create_plist()
        if dcpl.get_layout() != h5py.h5d.CHUNKED or dcpl.get_nfilters() != 0:
            return None
        k = int(chunks[0])
        row = int(np.prod(shape, dtype=np.int64)) * ds.dtype.itemsize
        count = -(-n // k)
        places = np.full(count, -1, np.int64)
        sound = [True]

        def visit(info: Any) -> None:
            j, rest = divmod(int(info.chunk_offset[0]), k)
            if rest or not 0 <= j < count or info.byte_offset is None or info.filter_mask or \
                    info.size != k * row or places[j] != -1 or any(info.chunk_offset[1:]):
                sound[0] = False
                return
            places[j] = int(info.byte_offset)

        ds.id.chunk_iter(visit)
    except (AttributeError, TypeError, ValueError, OSError, RuntimeError, KeyError):
        return None  # an h5py without chunk_iter, or metadata libhdf5 refuses: h5py reads the rows
    if not sound[0] or (places < 0).any() or int(places.max()) + k * row > pin.size():
        return None
    at = (places[:, None] + np.arange(k, dtype=np.int64) * row).reshape(-1)[:n]
    return DirectRows(pin, path, at, shape, ds.dtype)
