"""HDF5 datasets: one chunked HDF5 dataset per component, random access and block-wise sequential reads.

Components (see :mod:`bridgeflow.serialize._columns`): fixed-shape arrays are stacked into ``(N, *shape)``
datasets chunked to about 256 KiB (small enough for random reads); numbers as ``(N,)``; text, bytes and
arrays whose shape varies are stored end to end with each row's offsets (and shapes) beside them (see
:mod:`bridgeflow.serialize._hdf5_write` for the layout). The file attributes ``bridgeflow_format``,
``bridgeflow_version``, ``count``, ``structure`` and ``columns`` (JSON) describe it.

Damage is reported, in bounded time: files are written with ``libver="latest"``, whose metadata carries
checksums that libhdf5 verifies, and every row of every component has a CRC-32 in
``__bf_crc__/<name>``, checked on every read (the small index datasets also use the fletcher32
filter). Nothing is variable-length in
HDF5's sense: the global heaps that hold such data have no checksum, and libhdf5 can loop forever on a
damaged one. Before libhdf5 sees a file, :mod:`bridgeflow.serialize._hdf5_check` refuses files in HDF5's
original format (no metadata checksums; ``verify=False`` reads them anyway) and walks the global heaps of
files that have them (format version 1 files, written before this layout, and foreign files with
variable-length data) once per file and process, so that they too load or fail, never hang.

The reader opens the path once and reads everything through that open file (see
:mod:`bridgeflow.serialize._pinned`): a file renamed over the path meanwhile is never mixed in. Nothing
outside the file is read: a dataset reached through an external link (or a soft link leading out
through one), whose raw data lies in other files, or that is virtual raises
:class:`~bridgeflow.serialize.ExternalDataError` naming it and what it points at, unless
``allow_external=True`` vouches for the file and what it points at. Every
dataset read must hold the bytes its shape declares (a compressed one, no more than deflate could give),
so memory stays in proportion to the file, whatever counts it claims.

``load`` also reads HDF5 files written by other tools when ``data_paths`` names their datasets (all
of the same length; the first axis indexes datapoints).

Example:
    >>> from bridgeflow import DataFromList
    >>> df = DataFromList([[np.zeros((2, 2), np.uint8), i] for i in range(3)], shuffle=False)
    >>> HDF5Serializer.save(df, "train.h5", data_paths=["image", "label"], progress=False)
    3
    >>> ds = HDF5Serializer.load("train.h5", shuffle=False)
    >>> len(ds), ds[2][0].shape, ds[2][1]
    (3, (2, 2), 2)
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._base import DataFlow
from .._deps import require
from .._errors import BridgeflowError
from .._order import IndexedSource
from .._serialize_errors import ComponentNotFoundError, CorruptDataError, UnsupportedFormatError
from ._atomic import atomic_path, write_error
from ._columns import Column, assemble
from ._common import classes_json, existing_path, iterate_source, normalize_index, parse_classes, source_length
from ._hdf5_check import check_global_heaps, check_stored, check_superblock, contained_dataset, is_variable_length
from ._hdf5_chunks import CheckedChunks, cache_bytes, check_chunks, compressed, open_with_cache, read_failure
from ._hdf5_rows import DirectRows, direct_rows
from ._hdf5_write import (
    CRC,
    FLAT,
    FORMAT_NAME,
    FORMAT_VERSION,
    OFFSETS,
    SHAPES,
    HDF5Writer,
    hdf5_output,
    row_crc,
    rows_crc,
)
from ._pinned import PinnedFile

__all__ = ["HDF5Data", "HDF5Serializer"]

log = logging.getLogger(__name__)

_VLEN = ("str", "bytes", "ragged")
_BLOCK_BYTES = 1 << 20
_SCALARS_IN_MEMORY = 64 << 20  # a column of numbers up to this size is read whole, once per process


def _h5py(feature: str = "HDF5Serializer") -> Any:
    return require("h5py", feature)


class HDF5Serializer:
    """Save a flow to an HDF5 file, one dataset per component, and load it back."""

    @staticmethod
    def save(df: DataFlow, path: str | os.PathLike, data_paths: Sequence[str] | None = None, *,
             overwrite: bool = False, progress: bool = True, classes: Sequence[str] | None = None) -> int:
        """Write every datapoint of ``df`` to ``path``; returns the count.

        ``data_paths`` names the datasets of list/tuple components (default ``"0"``, ``"1"``, ...) or
        picks and orders the keys of dict datapoints. Written to a temporary file and renamed at the end.
        ``classes`` (the names of the labels) is stored in the file and comes back as ``.classes``.
        """
        h5py = _h5py()
        names = None if data_paths is None else [str(p) for p in data_paths]
        target = os.fspath(path)
        with atomic_path(path, overwrite=overwrite, sidecars=()) as tmp, \
                hdf5_output(h5py, target, tmp) as (f, check):
            writer = HDF5Writer(f, names, source_length(df))
            desc = f"HDF5 {os.path.basename(target)}"
            for i, dp in enumerate(iterate_source(df, progress=progress, desc=desc)):
                try:
                    writer.add(dp, i)
                except OSError as exc:  # libhdf5 failed to write (the source's own errors are not caught here)
                    check(exc)
                    raise write_error(target, exc, tmp) from exc
                check()  # a write that failed inside libhdf5 (see _hdf5_write._Sink)
            try:
                writer.finish(None if classes is None else classes_json(classes))
            except OSError as exc:
                check(exc)
                raise write_error(target, exc, tmp) from exc
            check()
        return writer.count

    @staticmethod
    def load(path: str | os.PathLike, data_paths: Sequence[str] | None = None, shuffle: bool = True, *,
             seed: int | None = None, verify: bool = True, shard: tuple[int, int] | str | None = None,
             drop_last: bool = False, allow_external: bool = False) -> HDF5Data:
        """The flow of datapoints stored at ``path`` (see :class:`HDF5Data`); ``shard=(rank, world)`` or
        ``"auto"`` reads this rank's part only; ``allow_external=True`` follows links and data that lie in
        other files (only for files you trust)."""
        return HDF5Data(path, data_paths=data_paths, shuffle=shuffle, seed=seed, verify=verify, shard=shard,
                        drop_last=drop_last, allow_external=allow_external)


def _open(pin: PinnedFile, path: str) -> Any:
    """An ``h5py.File`` on the pinned file, never on another file now at the path.

    libhdf5's own driver (``sec2``, its own descriptor) reads about 7% faster than reads through a Python
    file object, so the path is opened that way first and kept if it still holds the pinned file (same
    device and inode, checked on libhdf5's descriptor); otherwise, the file having been replaced, the
    pinned descriptor is read through a file object.
    """
    h5py = _h5py("HDF5Data")
    try:  # libhdf5 parses what it opens: open the path only while it holds the file checked before
        st = os.stat(path)
        f = h5py.File(path, "r") if (st.st_dev, st.st_ino) == pin.ident else None
    except (OSError, ValueError):
        f = None
    if f is not None:
        try:
            st = os.fstat(f.id.get_vfd_handle())
            same = (st.st_dev, st.st_ino) == pin.ident
        except (OSError, ValueError, TypeError, AttributeError):
            same = False
        if same:
            return f
        f.close()
    pin.ensure()  # a replaced file is refused here: raised in h5py's callbacks, 3.13 makes it a SystemError
    try:
        return h5py.File(pin.fileobj(), "r")
    except OSError as exc:
        raise CorruptDataError(f"{path}: cannot open as HDF5 ({exc})") from exc


class _Held:
    """What one reader holds in one process: its pinned file and the open ``h5py.File``; released by
    ``close()`` or by a finalizer when a reader is dropped without it."""

    __slots__ = ("pin", "file", "pid")

    def __init__(self, pin: PinnedFile) -> None:
        self.pin = pin
        self.file: Any = None  # an h5py.File
        self.pid: int | None = None  # the process that opened it

    def release(self) -> None:
        f, self.file = self.file, None
        if f is not None and self.pid == os.getpid():
            f.close()
        self.pin.close()

    def __getstate__(self) -> dict:
        return {"pin": self.pin}

    def __setstate__(self, state: dict) -> None:
        self.pin, self.file, self.pid = state["pin"], None, None


def _attr(f: Any, name: str, vlen_ok: Any) -> Any:
    """A file attribute's value (text decoded), or None; ``vlen_ok()`` runs first if it is
    variable-length (format version 1 files), since reading it parses a global heap."""
    attrs = f.attrs
    if name not in attrs:
        return None
    if is_variable_length(attrs.get_id(name).get_type()):
        vlen_ok()
    value = attrs[name]
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _describe(f: Any, path: str, data_paths: list[str] | None, vlen_ok: Any,
              dataset: Any) -> tuple[str, list[Column], int, int]:
    """(structure, columns, count, format version; 0 for foreign files) from our attributes, or from
    ``data_paths`` for foreign files. ``vlen_ok()`` runs before anything variable-length is read;
    ``dataset(f, name)`` opens a dataset (checked to lie inside the file), or gives ``None``."""

    def attr(name: str) -> Any:
        return _attr(f, name, vlen_ok)

    if attr("bridgeflow_format") == FORMAT_NAME:
        version = int(attr("bridgeflow_version") or -1)
        if version not in (1, FORMAT_VERSION):
            raise UnsupportedFormatError(f"{path}: HDF5 format version {version}; this bridgeflow reads "
                                         f"versions 1 and {FORMAT_VERSION}")
        try:
            columns = [Column.from_json(c) for c in json.loads(attr("columns"))]
            structure, count = str(attr("structure")), int(attr("count"))
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptDataError(f"{path}: damaged bridgeflow attributes ({exc})") from exc
        if count < 0:
            raise CorruptDataError(f"{path}: damaged bridgeflow attributes (count {count})")
        if data_paths is not None:
            by_name = {c.name: c for c in columns}
            missing = [p for p in data_paths if p not in by_name]
            if missing:
                raise ComponentNotFoundError(f"{path} has no component {missing[0]!r}; it has {list(by_name)}")
            columns = [by_name[p] for p in data_paths]
        return structure, columns, count, version
    if data_paths is None:
        raise CorruptDataError(f"{path}: an HDF5 file not written by HDF5Serializer; pass data_paths= to "
                               "name the datasets to read")
    columns, lengths = [], set()
    for p in data_paths:
        ds = dataset(f, p)
        if ds is None or not hasattr(ds, "shape") or len(ds.shape) == 0:
            raise ComponentNotFoundError(f"{path} has no dataset {p!r} with a first axis to index")
        if is_variable_length(ds.id.get_type()):
            vlen_ok()
        lengths.add(ds.shape[0])
        columns.append(Column(p, "array", ds.dtype.str, tuple(ds.shape[1:])))
    if len(lengths) != 1:
        raise CorruptDataError(f"{path}: datasets {data_paths} have different lengths {sorted(lengths)}")
    return "list", columns, lengths.pop(), 0


class HDF5Data(IndexedSource):
    """Datapoints of an HDF5 dataset: ``len()``, ``ds[i]``, sequential (block reads) or shuffled order.

    The path is opened once, here, and that file is read for the reader's lifetime; libhdf5 opens it
    lazily (in ``reset_state()`` or on first access) through that one open file, again in a process that
    finds a handle inherited through ``fork``. Sequential epochs read ~1 MiB blocks of rows (about one
    chunk); arrays of one block share its memory (writable). Shuffled epochs and ``ds[i]`` read row by
    row. ``data_paths`` picks and orders the components to read. ``verify=False`` skips the checks made
    before libhdf5 reads the file (see the module doc): only for files you trust; so does
    ``allow_external=True``, which reads datasets whose data lies in other files (external links, external
    storage, virtual datasets; refused by default with :class:`ExternalDataError`). ``shard=(rank, world)``
    or ``"auto"`` reads this rank's contiguous part of every epoch (see :mod:`bridgeflow._shard`);
    ``state_dict()`` is the epoch, the position and the shuffle's entropy (see :mod:`bridgeflow._order`).
    """

    def __init__(self, path: str | os.PathLike, data_paths: Sequence[str] | None = None, shuffle: bool = True,
                 seed: int | None = None, *, verify: bool = True, shard: tuple[int, int] | str | None = None,
                 drop_last: bool = False, allow_external: bool = False) -> None:
        self.path = existing_path(path, "HDF5Data")
        self.shuffle = shuffle
        self.seed = seed
        self.verify = verify
        self.allow_external = bool(allow_external)
        paths = None if data_paths is None else [str(p) for p in data_paths]
        self._held = _Held(PinnedFile(self.path, "HDF5Data"))  # the one open of the path
        self._finalizer = weakref.finalize(self, self._held.release)
        try:
            check_superblock(self._held.pin, self.path, trust_old_format=not verify)
            f = _open(self._held.pin, self.path)
            try:
                self.structure, self.columns, self._len, self.version = _describe(f, self.path, paths,
                                                                                  self._check_heaps, self._dataset)
                self._check_lengths(f)
                self.classes: list[str] | None = parse_classes(_attr(f, "classes", self._check_heaps)
                                                               if self.version else None, self.path)
            except BridgeflowError:
                raise
            except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:  # damaged HDF5 metadata
                raise CorruptDataError(f"{self.path}: damaged HDF5 file ({type(exc).__name__}: {exc})") from exc
            finally:
                f.close()
        except BaseException:
            self._held.release()
            raise
        self.names = [c.name for c in self.columns]
        self._ds: list = []
        self._init_order(self._len, shuffle, shard, drop_last)

    def _check_heaps(self) -> None:
        if self.verify:
            check_global_heaps(self._held.pin, self.path)

    def _dataset(self, f: Any, name: str) -> Any:
        """The dataset ``name`` of ``f``, checked to lie inside the file (unless ``allow_external``), or
        ``None``."""
        return contained_dataset(f, name, self.path, allow_external=self.allow_external)

    def _check_lengths(self, f: Any) -> None:
        """Every dataset a column reads lies inside the file, holds as many rows as the count says and
        stores the bytes its shape declares (metadata only)."""
        n = self._len
        for c in self.columns:
            want: dict[str, tuple[int, ...] | None] = {c.name: (n,)}
            if self.version == FORMAT_VERSION:
                want[f"{CRC}/{c.name}"] = (n,)
                if c.kind in FLAT:
                    want = {c.name: None, f"{OFFSETS}/{c.name}": (n + 1,), f"{CRC}/{c.name}": (n,)}
                if c.kind == "ragged":
                    want[f"{SHAPES}/{c.name}"] = (n, len(c.shape))
            for name, shape in want.items():
                ds = self._dataset(f, name)
                if ds is None or not hasattr(ds, "shape"):
                    raise CorruptDataError(f"{self.path}: dataset {name!r} is missing")
                if shape is not None and ds.shape[:len(shape)] != shape:
                    raise CorruptDataError(f"{self.path}: dataset {name!r} has shape {ds.shape}, where "
                                           f"{self._len} rows belong")
                check_stored(ds, name, self.path)
                if self.verify:
                    check_chunks(ds, name, self.path)
                if self.version == FORMAT_VERSION and is_variable_length(ds.id.get_type()):
                    raise CorruptDataError(f"{self.path}: dataset {name!r} is variable-length, which "
                                           "HDF5Serializer never writes")
                if self.version == 1 and is_variable_length(ds.id.get_type()):
                    self._check_heaps()

    def _identity(self) -> dict:
        return {"count": self._len, "bytes": self._held.pin.size()}

    def _datasets(self) -> list[tuple[Column, Any, Any, Any, Any]]:
        """(column, dataset, shapes, CRC-32 per row, row offsets) per column, opened once per process.
        Checksums, offsets and shapes are read whole (a few bytes a row) and checked against each other;
        so are columns of numbers (labels), whose rows are then read from memory (still CRC-checked).
        Version 1 files keep their variable-length datasets (no offsets) and checksum only those."""
        held = self._held
        if held.file is None or held.pid != os.getpid():
            f = _open(held.pin, self.path)
            try:
                self._ds = [self._column(f, c) for c in self.columns]
            except BridgeflowError:
                f.close()
                raise
            except MemoryError as exc:
                f.close()
                raise MemoryError(f"{self.path}: not enough memory to read the row index of its columns") from exc
            except OSError as exc:
                f.close()
                raise read_failure(exc, self.path, "the row index of its columns") from exc
            except (KeyError, ValueError, TypeError) as exc:
                f.close()
                raise CorruptDataError(f"{self.path}: damaged HDF5 file ({exc})") from exc
            held.file, held.pid = f, os.getpid()
        return self._ds

    def _column(self, f: Any, c: Column) -> tuple[Column, Any, Any, Any, Any]:
        ds = self._opened(f, c.name)
        if self.version != FORMAT_VERSION:
            shapes = self._opened(f, f"{SHAPES}/{c.name}") if c.kind == "ragged" else None
            return c, ds, shapes, self._crcs(f, c), None
        crcs = self._whole(f, f"{CRC}/{c.name}", (self._len,), np.uint32)
        if c.kind == "scalar" and self._len * ds.dtype.itemsize <= _SCALARS_IN_MEMORY:
            ds = self._whole(f, c.name, (self._len,), ds.dtype)  # read once: a row is then no libhdf5 call
        if c.kind == "array" and ds.dtype == np.dtype(c.dtype) and not isinstance(ds, CheckedChunks):
            ds = direct_rows(ds, self._held.pin, self.path) or ds  # rows read straight from the file, if they lie so
        if c.kind not in FLAT:
            return c, ds, None, crcs, None
        offsets = self._whole(f, f"{OFFSETS}/{c.name}", (self._len + 1,), np.int64)
        sizes = np.diff(offsets)
        if offsets[0] != 0 or offsets[-1] != ds.shape[0] or (sizes < 0).any():
            raise CorruptDataError(f"{self.path}: the row offsets of {c.name!r} are damaged")
        shapes = None
        if c.kind == "ragged":
            shapes = self._whole(f, f"{SHAPES}/{c.name}", (self._len, len(c.shape)), np.int64)
            if (shapes < 0).any() or (np.prod(shapes, axis=1, dtype=np.int64) != sizes).any():
                raise CorruptDataError(f"{self.path}: the row shapes of {c.name!r} do not match its rows")
        return c, ds, shapes, crcs, offsets

    def _whole(self, f: Any, name: str, shape: tuple, dtype: Any) -> np.ndarray:
        ds = self._opened(f, name)
        if ds.shape != shape or ds.dtype != dtype:  # checked before reading it whole
            raise CorruptDataError(f"{self.path}: dataset {name!r} is {ds.dtype} of shape {ds.shape}, not "
                                   f"{np.dtype(dtype)} of shape {shape}")
        check_stored(ds.ds if isinstance(ds, CheckedChunks) else ds, name, self.path)
        return ds[...]

    def _opened(self, f: Any, name: str) -> Any:
        """The dataset ``name`` (see :meth:`_dataset`), or ``None``; a compressed one opened with a chunk cache
        that holds one row of its chunks and, unless ``verify=False``, its chunks checked before libhdf5
        decodes them (:mod:`bridgeflow.serialize._hdf5_chunks`)."""
        ds = self._dataset(f, name)
        if ds is None or not compressed(ds):
            return ds
        where, nbytes = ds.name, cache_bytes(ds)
        del ds  # the only handle: libhdf5 gives a later open of a dataset still open the first one's cache
        ds = open_with_cache(f, where, nbytes)
        return CheckedChunks(ds, name, self.path) if self.verify else ds

    def _decode_bytes(self) -> int:
        """The largest compressed chunk the columns read (what decoding one costs), 0 when none is."""
        return max((d.chunk_bytes for col in self._ds for d in col[1:3] if isinstance(d, CheckedChunks)), default=0)

    def _crcs(self, f: Any, c: Column) -> np.ndarray | None:
        """Version 1: the CRC-32 of each variable-length row, if the file has them."""
        if c.kind not in _VLEN or self._dataset(f, f"{CRC}/{c.name}") is None:
            return None
        return self._whole(f, f"{CRC}/{c.name}", (self._len,), np.uint32)

    def _on_reset(self) -> None:
        super()._on_reset()
        self._datasets()

    def _mismatch(self, i: int, c: Column) -> CorruptDataError:
        return CorruptDataError(f"{self.path}: datapoint {i}, component {c.name!r}: checksum mismatch "
                                "(the file is damaged)")

    def _cell(self, c: Column, v: Any, shape: Any, crcs: np.ndarray | None, i: int) -> Any:
        """Version 1: a stored cell back to its saved type; variable-length cells are checked against
        their CRC."""
        if c.kind == "array":
            return v if c.shape else np.array(v)
        if c.kind == "scalar":
            return v.item() if c.pytype else v
        if c.kind == "ragged":
            v = v.reshape(shape)
        elif c.kind == "bytes":
            v = v.tobytes()
        if crcs is not None and row_crc(v, 0) != crcs[i]:
            raise self._mismatch(i, c)
        return v.decode("utf-8") if c.kind == "str" else v

    def _restore(self, c: Column, v: Any, shape: Any) -> Any:
        """Format version 2: a checked row back to its saved type."""
        if c.kind == "array":
            return v if c.shape else np.array(v)
        if c.kind == "scalar":
            return v.item() if c.pytype else v
        if c.kind == "ragged":
            return v.reshape(shape)
        return v.tobytes().decode("utf-8") if c.kind == "str" else v.tobytes()

    def _read_row(self, c: Column, ds: Any, shapes: Any, crcs: Any, offsets: Any, i: int) -> Any:
        if offsets is None:
            if self.version != FORMAT_VERSION:
                return self._cell(c, ds[i], shapes[i] if shapes is not None else None, crcs, i)
            v = ds.row(i) if isinstance(ds, DirectRows) else ds[i]
        else:
            v = ds[offsets[i]:offsets[i + 1]]
        if row_crc(v) != crcs[i]:
            raise self._mismatch(i, c)
        return self._restore(c, v, shapes[i] if shapes is not None else None)

    def _row(self, i: int) -> list:
        try:
            return [self._read_row(*column, i) for column in self._datasets()]
        except BridgeflowError:
            raise
        except OSError as exc:  # libhdf5 says "filter returned failure" for a failed allocation too
            raise read_failure(exc, self.path, f"datapoint {i}", self._decode_bytes()) from exc
        except (KeyError, ValueError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
            raise CorruptDataError(f"{self.path}: reading datapoint {i} failed ({exc})") from exc

    def _read_block(self, c: Column, ds: Any, shapes: Any, crcs: Any, offsets: Any, start: int,
                    stop: int) -> list:
        if self.version != FORMAT_VERSION:
            block = ds[start:stop]
            if c.kind == "array":
                return list(block) if c.shape else [np.array(v) for v in block]
            if c.kind == "scalar":  # Python types back via tolist(), numpy scalars stay numpy
                return block.tolist() if c.pytype else list(block)
            shape_rows = shapes[start:stop] if shapes is not None else [None] * len(block)
            return [self._cell(c, v, sh, crcs, start + j) for j, (v, sh) in enumerate(zip(block, shape_rows))]
        if offsets is None:
            block = ds.rows(start, stop) if isinstance(ds, DirectRows) else ds[start:stop]
            bad = np.flatnonzero(rows_crc(block) != crcs[start:stop])
            if len(bad):
                raise self._mismatch(start + int(bad[0]), c)
            if c.kind == "array":
                return list(block) if c.shape else [np.array(v) for v in block]
            return block.tolist() if c.pytype else list(block)
        base = int(offsets[start])
        raw = ds[base:int(offsets[stop])]
        out = []
        for i in range(start, stop):
            v = raw[offsets[i] - base:offsets[i + 1] - base]
            if row_crc(v) != crcs[i]:
                raise self._mismatch(i, c)
            out.append(self._restore(c, v, shapes[i] if shapes is not None else None))
        return out

    def _block(self, start: int, stop: int) -> list[list]:
        """Columns of rows ``start:stop``, each a list of restored, checked cells."""
        try:
            return [self._read_block(*column, start, stop) for column in self._datasets()]
        except BridgeflowError:
            raise
        except OSError as exc:  # libhdf5 says "filter returned failure" for a failed allocation too
            raise read_failure(exc, self.path, f"rows {start}:{stop}", self._decode_bytes()) from exc
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptDataError(f"{self.path}: reading rows {start}:{stop} failed ({exc})") from exc

    def __getitem__(self, index: int) -> Any:
        i = self._order.shard_index(normalize_index(index, len(self), "HDF5Data"))
        return assemble(self.structure, self.names, self._row(i))

    def _block_rows(self) -> int:
        """Rows per sequential read: about one chunk of the widest array column (cache-friendly)."""
        row = 0
        for c in self.columns:
            row += int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize if c.kind == "array" else 64
        return max(1, _BLOCK_BYTES // max(row, 1))

    def _read(self, runs: list, pos: int) -> Iterator[Any]:
        structure, names = self.structure, self.names
        step = self._block_rows()
        for it, run, skip in self._order.iters(runs, pos):
            if self.shuffle:
                for i in it:
                    yield assemble(structure, names, self._row(i))
                continue
            assert isinstance(run, range)  # not shuffled: a run is a range of rows
            for start in range(run.start + skip, run.stop, step):
                columns = self._block(start, min(run.stop, start + step))
                rows = zip(zip(*columns), it)  # ``it`` counts the rows off (the position), after each row
                if structure == "dict":
                    for row, _ in rows:
                        yield dict(zip(names, row))
                elif structure == "tuple":
                    for row, _ in rows:
                        yield row
                else:
                    for row, _ in rows:
                        yield list(row)

    def close(self) -> None:
        self._held.release()
        self._ds = []
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_finalizer", None)
        state["_ds"] = []
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._finalizer = weakref.finalize(self, self._held.release)

    def __repr__(self) -> str:
        return f"HDF5Data({self.path!r}, shuffle={self.shuffle}, n={self._len})"
