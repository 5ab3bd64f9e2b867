"""Writing HDF5 datasets (format version 2): one chunked HDF5 dataset per component, a CRC-32 per row of
every component, and nothing variable-length.

Layout, per component ``name`` (see :mod:`bridgeflow.serialize._columns` for the kinds):

- ``array`` / ``scalar``: ``name`` holds ``(N, *shape)`` / ``(N,)`` values;
- ``str`` / ``bytes`` / ``ragged``: ``name`` holds every row's bytes (UTF-8 text, bytes, or the flat
  values of the arrays) end to end, ``__bf_offsets__/name`` the ``N + 1`` row boundaries, and for
  ``ragged`` ``__bf_shapes__/name`` each row's shape;
- ``__bf_crc__/name``: the CRC-32 of each row (:func:`row_crc`), checked on every read. fletcher32
  cannot tell a zeroed chunk, nor 0x0000 from 0xFFFF words, from the data; the CRC can. So the bulky
  datasets (arrays, the bytes of text, bytes and ragged rows) carry only the row CRCs: fletcher32 on them
  made sequential reads of 150 KB rows take 1.8x as long, for a weaker check. The small datasets (scalars,
  offsets, shapes, the CRCs themselves) keep fletcher32 as well.

Variable-length HDF5 types live in *global heaps*, which carry no checksum and which libhdf5 can loop on
when damaged: this format uses none, attributes included (fixed-length strings in the object header,
which is checksummed). Files are written with ``libver="latest"``, whose metadata carries checksums.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from .._errors import DatapointError
from ._atomic import write_error
from ._checksum import crc32
from ._columns import Column, classify, split_datapoint

__all__ = ["CRC", "CRC_SEED", "FLAT", "FORMAT_NAME", "FORMAT_VERSION", "OFFSETS", "SHAPES", "HDF5Writer",
           "hdf5_output", "row_crc", "rows_crc"]

log = logging.getLogger(__name__)

FORMAT_NAME = "bridgeflow-hdf5"
FORMAT_VERSION = 2
SHAPES = "__bf_shapes__"
OFFSETS = "__bf_offsets__"
CRC = "__bf_crc__"
FLAT = ("str", "bytes", "ragged")  # kinds stored end to end with row offsets
_CHUNK_BYTES = 256 << 10
_FLAT_CHUNK_BYTES = 64 << 10  # smaller: a random read of one short row reads its whole chunk
_FLUSH_BYTES = 16 << 20
CRC_SEED = 0x2F6B  # the CRC's start value: an empty row's CRC is not 0, as a zeroed checksum would be
# Checksummed metadata (superblock 3, version 2 object headers) that HDF5 1.10 to 1.14 read: "latest" with
# HDF5 2.0 (h5py 3.16) would write what h5py 3.14 (HDF5 1.14, TensorFlow's pin) may not open.
_LIBVER = ("v110", "v114")


class _Sink(io.RawIOBase):
    """The temporary file as libhdf5 writes it (h5py's file-object driver). A write that fails (disk
    full, ``ulimit -f``) is recorded in :attr:`failed` and it and every later write are dropped, but
    nothing is raised into libhdf5: h5py 3.14 turned such an exception into an ``OSError`` from the
    write that met it, but libhdf5 then failed to close the file, kept it open and crashed the process
    (SIGSEGV) when it shut down; h5py 3.16 (HDF5 2.0) loses the exception inside libhdf5, which goes on
    with a Python exception pending (a silently truncated file renamed into place, or SIGSEGV). The
    writer looks at :attr:`failed` after every call into libhdf5 instead (:func:`hdf5_output`'s
    ``check``) and raises there, from Python. The file is removed anyway."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.file = open(path, "r+b", buffering=0)
        self.failed: OSError | None = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self.file.readinto(buffer)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.failed is None:
            try:
                done = 0
                while done < len(view):  # libhdf5 does not look at the count: write it all, or give up
                    done += self.file.write(view[done:]) or 0
            except OSError as exc:
                self.failed = exc
        return len(view)

    def truncate(self, size: int | None = None) -> int:
        if self.failed is None:
            try:
                return self.file.truncate(size)
            except OSError as exc:
                self.failed = exc
        return self.tell() if size is None else size

    def flush(self) -> None:
        if self.failed is None and not self.file.closed:
            self.file.flush()

    def close(self) -> None:
        try:
            super().close()  # flushes
        finally:
            self.file.close()


class WriteCheck(Protocol):
    """``check(cause=None)``: raises the error libhdf5 reported while writing, if any (see :func:`hdf5_output`)."""

    def __call__(self, cause: BaseException | None = None, /) -> None: ...


@contextlib.contextmanager
def hdf5_output(h5py: Any, target: str, tmp: str) -> Iterator[tuple[Any, WriteCheck]]:
    """``(file, check)``: an ``h5py.File`` writing ``tmp`` for ``target``, and ``check()``, which raises
    :class:`DatasetWriteError` naming ``target`` once a write failed (see :class:`_Sink`): call it after
    every call into libhdf5 that may write. The file is always closed, and checked once more after it."""
    try:
        sink = _Sink(tmp)
        f = h5py.File(sink, "w", libver=_LIBVER, locking=False)
    except OSError as exc:
        raise write_error(target, exc, tmp) from exc

    def check(cause: BaseException | None = None) -> None:
        if sink.failed is not None:
            raise write_error(target, sink.failed, tmp) from cause or sink.failed

    try:
        try:
            yield f, check
        finally:
            try:
                f.close()  # the last flush
            except OSError as exc:
                f.close()  # later writes are dropped: this closes it for good
                check(exc)
                raise
        check()
    finally:
        sink.close()


def row_crc(value: bytes | np.ndarray | np.generic, seed: int = CRC_SEED) -> int:
    """CRC-32 of one row: the bytes, the UTF-8 text, or the array's (or number's) little-endian bytes.
    (Format version 1 files used ``seed=0``.)"""
    if isinstance(value, (np.ndarray, np.generic)):
        value = np.ascontiguousarray(value, value.dtype.newbyteorder("<"))
    return crc32()(value, seed)


def rows_crc(block: np.ndarray) -> np.ndarray:
    """``row_crc`` of every row of an ``(n, ...)`` array, at once."""
    n = len(block)
    if n == 0:
        return np.zeros(0, np.uint32)
    a = np.ascontiguousarray(block, block.dtype.newbyteorder("<"))
    flat = a.reshape(-1).view(np.uint8).data if a.size else memoryview(b"")
    step = a.nbytes // n
    crc = crc32()
    return np.array([crc(flat[j * step:(j + 1) * step], CRC_SEED) for j in range(n)], np.uint32)


def _text(v: str, name: str, index: int) -> bytes:
    try:
        return v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DatapointError(f"component {name!r} of datapoint {index}: {v[:40]!r} is not valid UTF-8 text "
                             f"({exc.reason}); store it as bytes, or use LMDBSerializer") from None


class HDF5Writer:
    """Appends datapoints to the column datasets of an open ``h5py.File``, buffering ~16 MiB."""

    def __init__(self, f: Any, data_paths: list[str] | None, size_hint: int | None = None) -> None:
        self.size_hint = size_hint
        self.f = f
        self.data_paths = data_paths
        self.columns: list[Column] = []
        self.structure = ""
        self.names: list[str] = []
        self.pending: list[list] = []
        self.pending_bytes = 0
        self.count = 0  # rows written to the datasets

    def _create(self, col: Column) -> None:
        if col.name.startswith("__bf_"):
            raise DatapointError(f"component {col.name!r}: names starting with '__bf_' are reserved")
        try:
            self._create_datasets(col)
        except (ValueError, TypeError, KeyError) as exc:  # h5py: empty, '.', or clashing names
            raise DatapointError(f"component {col.name!r} cannot be stored as HDF5 dataset {col.name!r} "
                                 f"({exc}); rename it or pass data_paths=") from exc

    def _dataset(self, name: str, shape: tuple, dtype: Any, chunks: tuple, fletcher32: bool = True) -> None:
        self.f.create_dataset(name, shape=shape, maxshape=(None, *shape[1:]), chunks=chunks, dtype=dtype,
                              fletcher32=fletcher32)

    def _create_datasets(self, col: Column) -> None:
        if col.kind == "array":
            row = max(1, int(np.prod(col.shape)) * np.dtype(col.dtype).itemsize)
            rows = max(1, min(_CHUNK_BYTES // row, self.size_hint or _CHUNK_BYTES))
            # HDF5 chunks must be positive: a zero-length axis gets chunk 1 and an unlimited max
            self.f.create_dataset(col.name, shape=(0, *col.shape),
                                  maxshape=(None, *(d or None for d in col.shape)),
                                  chunks=(rows, *(d or 1 for d in col.shape)), dtype=np.dtype(col.dtype))
        elif col.kind == "scalar":
            self._dataset(col.name, (0,), np.dtype(col.dtype), (1024,))
        else:
            dtype = np.dtype(col.dtype) if col.kind == "ragged" else np.dtype(np.uint8)
            self._dataset(col.name, (0,), dtype, (max(1, _FLAT_CHUNK_BYTES // dtype.itemsize),), fletcher32=False)
            self.f.create_dataset(f"{OFFSETS}/{col.name}", data=np.zeros(1, np.int64), maxshape=(None,),
                                  chunks=(4096,), fletcher32=True)
            if col.kind == "ragged":
                self._dataset(f"{SHAPES}/{col.name}", (0, len(col.shape)), np.int64,
                              (1024, max(1, len(col.shape))))
        self._dataset(f"{CRC}/{col.name}", (0,), np.uint32, (4096,))

    def add(self, dp: Any, index: int) -> None:
        structure, names, values = split_datapoint(dp, self.data_paths, index)
        if not self.columns:
            self.structure, self.names = structure, names
            self.columns = [classify(n, v, index) for n, v in zip(names, values)]
            for col in self.columns:
                self._create(col)
            self.pending = [[] for _ in self.columns]
        elif (structure, names) != (self.structure, self.names):
            raise DatapointError(
                f"datapoint {index} is a {structure} with components {names}; the first was a "
                f"{self.structure} with {self.names}")
        upgrades = [col.check(v, index) for col, v in zip(self.columns, values)]  # check before appending
        for k, upgraded in enumerate(upgrades):
            if upgraded is not None:
                self._make_ragged(k, upgraded)
        values = [_text(v, col.name, index) if col.kind == "str" else v for col, v in zip(self.columns, values)]
        for k, v in enumerate(values):
            self.pending[k].append(v)
            # bytes and str count by their size: encoded images must not pile up in memory
            self.pending_bytes += v.nbytes if isinstance(v, np.ndarray) else len(v) if isinstance(v, bytes) else 8
        if self.pending_bytes >= _FLUSH_BYTES:
            self.flush()

    def _make_ragged(self, k: int, col: Column) -> None:
        """A component changed shape: rewrite what was stacked so far as variable-length rows."""
        self.flush()
        old = self.f[col.name][...]
        del self.f[col.name]
        del self.f[f"{CRC}/{col.name}"]
        log.info("component %r has varying shapes: storing it as variable-length rows", col.name)
        self.columns[k] = col
        self._create(col)
        self._write(col, list(old), 0)

    def _append(self, name: str, values: np.ndarray) -> None:
        ds = self.f[name]
        at = ds.shape[0]
        ds.resize(at + len(values), axis=0)
        ds[at:] = values

    def _write(self, col: Column, values: list, at: int) -> None:
        n = len(values)
        if col.kind in ("array", "scalar"):
            block = np.stack(values) if col.kind == "array" else np.array(values, dtype=np.dtype(col.dtype))
            block = block.astype(np.dtype(col.dtype), copy=False)
            ds = self.f[col.name]
            ds.resize(at + n, axis=0)
            ds[at:at + n] = block
            crcs = rows_crc(block)
        else:
            if col.kind == "ragged":
                self._append(f"{SHAPES}/{col.name}",
                             np.array([v.shape for v in values], dtype=np.int64).reshape(n, -1))
                flat = [np.ascontiguousarray(v, np.dtype(col.dtype)).reshape(-1) for v in values]
                data = np.concatenate(flat) if flat else np.zeros(0, np.dtype(col.dtype))
                sizes = [v.size for v in flat]
            else:
                data = np.frombuffer(b"".join(values), np.uint8)
                sizes = [len(v) for v in values]
            offsets = self.f[f"{OFFSETS}/{col.name}"]
            ends = int(offsets[-1]) + np.cumsum(sizes, dtype=np.int64)
            self._append(col.name, data)
            self._append(f"{OFFSETS}/{col.name}", ends)
            crcs = np.array([row_crc(v) for v in values], np.uint32)
        crc = self.f[f"{CRC}/{col.name}"]
        crc.resize(at + n, axis=0)
        crc[at:at + n] = crcs

    def flush(self) -> None:
        if not self.columns or not self.pending[0]:
            return
        n = len(self.pending[0])
        for col, values in zip(self.columns, self.pending):
            self._write(col, values, self.count)
        self.count += n
        self.pending = [[] for _ in self.columns]
        self.pending_bytes = 0

    def finish(self, classes: str | None = None) -> None:
        """Write what is buffered and the file's description, as fixed-length attributes (``classes``:
        the JSON list of label names, if any)."""
        self.flush()
        attrs = {"bridgeflow_format": FORMAT_NAME, "structure": self.structure or "list",
                 "columns": json.dumps([c.to_json() for c in self.columns])}
        if classes is not None:
            attrs["classes"] = classes
        for key, value in attrs.items():
            self.f.attrs[key] = np.bytes_(value.encode("utf-8"))
        self.f.attrs["bridgeflow_version"] = np.int64(FORMAT_VERSION)
        self.f.attrs["count"] = np.int64(self.count)
