"""HDF5 datasets: one chunked HDF5 dataset per component, random access and block-wise sequential reads.

Components (see :mod:`bridgeflow.serialize._columns`): fixed-shape arrays are stacked into ``(N, *shape)``
datasets chunked to about 256 KiB (small enough for random reads); arrays whose shape varies are stored
flat in a variable-length dataset with their shapes in ``__bf_shapes__/<name>``; numbers as ``(N,)``;
``str`` and ``bytes`` as variable-length. The file attributes ``bridgeflow_format``, ``bridgeflow_version``, ``count``,
``structure`` and ``columns`` (JSON) describe it. Files are written with ``libver="latest"``, whose
metadata carries checksums, and fixed-size datasets use the fletcher32 filter, so damage is reported
instead of read. HDF5 checksums neither variable-length rows nor strings, so each variable-length column
has a CRC-32 per row in ``__bf_crc__/<name>`` (itself fletcher32-checked), verified on every read; files
written without it are read unchecked.

``load`` also reads HDF5 files written by other tools when ``data_paths`` names their datasets (all
of the same length; the first axis indexes datapoints).

Example:
    >>> HDF5Serializer.save(df, "train.h5", data_paths=["image", "label"])  # doctest: +SKIP
    >>> ds = HDF5Serializer.load("train.h5", shuffle=False)                  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._deps import require
from ..base import DataFlow
from ..errors import BridgeflowError, DatapointError
from ..order import IndexedSource
from ._columns import Column, assemble, classify, split_datapoint
from ._common import existing_path, iterate_source, normalize_index, source_length
from .atomic import atomic_path
from .errors import ComponentNotFoundError, CorruptDataError, UnsupportedFormatError

__all__ = ["HDF5Data", "HDF5Serializer"]

log = logging.getLogger(__name__)

FORMAT_NAME = "bridgeflow-hdf5"
FORMAT_VERSION = 1
SHAPES = "__bf_shapes__"
CRC = "__bf_crc__"  # CRC-32 of every variable-length row: HDF5 checksums neither its vlen heap nor strings
_VLEN = ("str", "bytes", "ragged")
_CHUNK_BYTES = 256 << 10
_FLUSH_BYTES = 16 << 20
_BLOCK_BYTES = 1 << 20


def _h5py(feature: str = "HDF5Serializer") -> Any:
    return require("h5py", feature)


def _storage_dtype(h5py: Any, col: Column) -> Any:
    if col.kind == "str":
        return h5py.string_dtype("utf-8")
    if col.kind == "bytes":
        return h5py.vlen_dtype(np.uint8)
    if col.kind == "ragged":
        return h5py.vlen_dtype(np.dtype(col.dtype))
    return np.dtype(col.dtype)


class _Writer:
    """Appends datapoints to column datasets, buffering ~16 MiB between writes."""

    def __init__(self, f: Any, data_paths: list[str] | None, size_hint: int | None = None) -> None:
        self.h5py = _h5py()
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

    def _create_datasets(self, col: Column) -> None:
        if col.kind == "array":
            row = max(1, int(np.prod(col.shape)) * np.dtype(col.dtype).itemsize)
            rows = max(1, min(_CHUNK_BYTES // row, self.size_hint or _CHUNK_BYTES))
            # HDF5 chunks must be positive: a zero-length axis gets chunk 1 and an unlimited max
            self.f.create_dataset(col.name, shape=(0, *col.shape),
                                  maxshape=(None, *(d or None for d in col.shape)), fletcher32=True,
                                  chunks=(rows, *(d or 1 for d in col.shape)), dtype=np.dtype(col.dtype))
        else:
            self.f.create_dataset(col.name, shape=(0,), maxshape=(None,), chunks=(1024,),
                                  dtype=_storage_dtype(self.h5py, col), fletcher32=col.kind == "scalar")
            if col.kind == "ragged":
                self.f.create_dataset(f"{SHAPES}/{col.name}", shape=(0, len(col.shape)),
                                      maxshape=(None, len(col.shape)), chunks=(1024, max(1, len(col.shape))),
                                      dtype=np.int64, fletcher32=True)
            if col.kind in _VLEN:
                self.f.create_dataset(f"{CRC}/{col.name}", shape=(0,), maxshape=(None,), chunks=(4096,),
                                      dtype=np.uint32, fletcher32=True)

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
        for col, v in zip(self.columns, values):
            if col.kind == "str":
                _check_text(v, col.name, index)
        for k, v in enumerate(values):
            self.pending[k].append(v)
            # bytes and str count by their size: encoded images must not pile up in memory
            self.pending_bytes += v.nbytes if isinstance(v, np.ndarray) else len(v) if isinstance(v, (bytes, str)) \
                else 8
        if self.pending_bytes >= _FLUSH_BYTES:
            self.flush()

    def _make_ragged(self, k: int, col: Column) -> None:
        """A component changed shape: rewrite what was stacked so far as variable-length rows."""
        self.flush()
        old = self.f[col.name][...]
        del self.f[col.name]
        log.info("component %r has varying shapes: storing it as variable-length rows", col.name)
        self.columns[k] = col
        self._create(col)
        self._write(col, list(old), 0)

    def _write(self, col: Column, values: list, at: int) -> None:
        ds = self.f[col.name]
        n = len(values)
        ds.resize(at + n, axis=0)
        if col.kind == "array":
            ds[at:at + n] = np.stack(values)
        elif col.kind == "scalar":
            ds[at:at + n] = np.array(values, dtype=np.dtype(col.dtype))
        elif col.kind == "str":
            ds[at:at + n] = np.array(values, dtype=object)
            self._write_crc(col, [v.encode("utf-8") for v in values], at)
        elif col.kind == "bytes":
            for j, v in enumerate(values):
                ds[at + j] = np.frombuffer(v, np.uint8)
            self._write_crc(col, values, at)
        else:  # ragged
            shapes = self.f[f"{SHAPES}/{col.name}"]
            shapes.resize(at + n, axis=0)
            shapes[at:at + n] = np.array([v.shape for v in values], dtype=np.int64).reshape(n, -1)
            for j, v in enumerate(values):
                ds[at + j] = np.ascontiguousarray(v).reshape(-1)
            self._write_crc(col, values, at)

    def _write_crc(self, col: Column, values: list, at: int) -> None:
        crc = self.f[f"{CRC}/{col.name}"]
        crc.resize(at + len(values), axis=0)
        crc[at:at + len(values)] = np.array([row_crc(v) for v in values], dtype=np.uint32)

    def flush(self) -> None:
        if not self.columns or not self.pending[0]:
            return
        n = len(self.pending[0])
        for col, values in zip(self.columns, self.pending):
            self._write(col, values, self.count)
        self.count += n
        self.pending = [[] for _ in self.columns]
        self.pending_bytes = 0

    def finish(self) -> None:
        self.flush()
        self.f.attrs.update({"bridgeflow_format": FORMAT_NAME, "bridgeflow_version": FORMAT_VERSION,
                             "count": self.count, "structure": self.structure or "list",
                             "columns": json.dumps([c.to_json() for c in self.columns])})


def _check_text(v: str, name: str, index: int) -> None:
    """HDF5 stores text as NUL-terminated UTF-8: refuse what it would mangle, naming the component."""
    where = f"component {name!r} of datapoint {index}"
    if "\x00" in v:
        raise DatapointError(f"{where}: HDF5 strings cannot hold NUL characters; store it as bytes, or use "
                             "LMDBSerializer")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DatapointError(f"{where}: {v[:40]!r} is not valid UTF-8 text ({exc.reason}); store it as bytes, "
                             "or use LMDBSerializer") from None


def row_crc(value: bytes | np.ndarray) -> int:
    """CRC-32 of a variable-length row: the bytes, the UTF-8 text, or the array's little-endian bytes."""
    if isinstance(value, np.ndarray):
        value = np.ascontiguousarray(value, value.dtype.newbyteorder("<"))
    return zlib.crc32(value)


class HDF5Serializer:
    """Save a flow to an HDF5 file, one dataset per component, and load it back."""

    @staticmethod
    def save(df: DataFlow, path: str | os.PathLike, data_paths: Sequence[str] | None = None, *,
             overwrite: bool = False, progress: bool = True) -> int:
        """Write every datapoint of ``df`` to ``path``; returns the count.

        ``data_paths`` names the datasets of list/tuple components (default ``"0"``, ``"1"``, ...) or
        picks and orders the keys of dict datapoints. Written to a temporary file and renamed at the end.
        """
        h5py = _h5py()
        names = None if data_paths is None else [str(p) for p in data_paths]
        with atomic_path(path, overwrite=overwrite, sidecars=()) as tmp:
            with h5py.File(tmp, "w", libver="latest") as f:
                writer = _Writer(f, names, source_length(df))
                desc = f"HDF5 {os.path.basename(os.fspath(path))}"
                for i, dp in enumerate(iterate_source(df, progress=progress, desc=desc)):
                    writer.add(dp, i)
                writer.finish()
        return writer.count

    @staticmethod
    def load(path: str | os.PathLike, data_paths: Sequence[str] | None = None, shuffle: bool = True, *,
             seed: int | None = None, shard: tuple[int, int] | str | None = None,
             drop_last: bool = False) -> HDF5Data:
        """The flow of datapoints stored at ``path`` (see :class:`HDF5Data`); ``shard=(rank, world)`` or
        ``"auto"`` reads this rank's part only."""
        return HDF5Data(path, data_paths=data_paths, shuffle=shuffle, seed=seed, shard=shard, drop_last=drop_last)


def _open(path: str) -> Any:
    h5py = _h5py("HDF5Data")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise CorruptDataError(f"{path}: cannot open as HDF5 ({exc})") from exc


def _describe(f: Any, path: str, data_paths: list[str] | None) -> tuple[str, list[Column], int]:
    """(structure, columns, count) from our attributes, or from ``data_paths`` for foreign files."""
    attrs = f.attrs
    if attrs.get("bridgeflow_format") == FORMAT_NAME:
        version = int(attrs.get("bridgeflow_version", -1))
        if version != FORMAT_VERSION:
            raise UnsupportedFormatError(f"{path}: HDF5 format version {version}; this bridgeflow reads "
                                         f"version {FORMAT_VERSION}")
        try:
            columns = [Column.from_json(c) for c in json.loads(attrs["columns"])]
            structure, count = str(attrs["structure"]), int(attrs["count"])
        except (KeyError, ValueError, TypeError) as exc:
            raise CorruptDataError(f"{path}: damaged bridgeflow attributes ({exc})") from exc
        if data_paths is not None:
            by_name = {c.name: c for c in columns}
            missing = [p for p in data_paths if p not in by_name]
            if missing:
                raise ComponentNotFoundError(f"{path} has no component {missing[0]!r}; it has {list(by_name)}")
            columns = [by_name[p] for p in data_paths]
        return structure, columns, count
    if data_paths is None:
        raise CorruptDataError(f"{path}: an HDF5 file not written by HDF5Serializer; pass data_paths= to "
                               "name the datasets to read")
    columns, lengths = [], set()
    for p in data_paths:
        if p not in f or not hasattr(f[p], "shape") or len(f[p].shape) == 0:
            raise ComponentNotFoundError(f"{path} has no dataset {p!r} with a first axis to index")
        ds = f[p]
        lengths.add(ds.shape[0])
        columns.append(Column(p, "array", ds.dtype.str, tuple(ds.shape[1:])))
    if len(lengths) != 1:
        raise CorruptDataError(f"{path}: datasets {data_paths} have different lengths {sorted(lengths)}")
    return "list", columns, lengths.pop()


class HDF5Data(IndexedSource):
    """Datapoints of an HDF5 dataset: ``len()``, ``ds[i]``, sequential (block reads) or shuffled order.

    The file opens lazily (in ``reset_state()`` or on first access) and again in a process that finds a
    handle inherited through ``fork``. Sequential epochs read ~1 MiB blocks of rows (about one chunk);
    arrays of one block share its memory (writable). Shuffled epochs and ``ds[i]`` read row by row.
    ``data_paths`` picks and orders the components to read. ``shard=(rank, world)`` or ``"auto"`` reads
    this rank's contiguous part of every epoch (see :mod:`bridgeflow.shard`); ``state_dict()`` is the
    epoch, the position and the shuffle's entropy (see :mod:`bridgeflow.order`).
    """

    def __init__(self, path: str | os.PathLike, data_paths: Sequence[str] | None = None, shuffle: bool = True,
                 seed: int | None = None, *, shard: tuple[int, int] | str | None = None,
                 drop_last: bool = False) -> None:
        self.path = existing_path(path, "HDF5Data")
        self.shuffle = shuffle
        self.seed = seed
        paths = None if data_paths is None else [str(p) for p in data_paths]
        f = _open(self.path)
        try:
            self.structure, self.columns, self._len = _describe(f, self.path, paths)
            self._check_lengths(f)
        except BridgeflowError:
            raise
        except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:  # damaged HDF5 metadata
            raise CorruptDataError(f"{self.path}: damaged HDF5 file ({type(exc).__name__}: {exc})") from exc
        finally:
            f.close()
        self.names = [c.name for c in self.columns]
        self._f: Any = None
        self._ds: list = []
        self._pid: int | None = None
        self._init_order(self._len, shuffle, shard, drop_last)

    def _check_lengths(self, f: Any) -> None:
        for c in self.columns:
            if c.name not in f or f[c.name].shape[:1] != (self._len,):
                raise CorruptDataError(f"{self.path}: dataset {c.name!r} is missing or does not hold "
                                       f"{self._len} rows")

    def __len__(self) -> int:
        return self._order.length()

    def _identity(self) -> dict:
        return {"count": self._len, "bytes": os.path.getsize(self.path)}

    def _datasets(self) -> list[tuple[Column, Any, Any, Any]]:
        """(column, dataset, shapes dataset or None, CRC-32 per row or None) per column, opened once per
        process. The row checksums of variable-length columns are read whole (4 bytes a row); files
        written before they existed have none and are read unchecked."""
        if self._f is None or self._pid != os.getpid():
            f = _open(self.path)
            try:
                self._ds = [(c, f[c.name], f[f"{SHAPES}/{c.name}"] if c.kind == "ragged" else None,
                             self._crcs(f, c)) for c in self.columns]
            except (OSError, KeyError, ValueError, TypeError) as exc:
                f.close()
                raise CorruptDataError(f"{self.path}: damaged HDF5 file ({exc})") from exc
            self._f, self._pid = f, os.getpid()
        return self._ds

    def _crcs(self, f: Any, c: Column) -> np.ndarray | None:
        if c.kind not in _VLEN or f"{CRC}/{c.name}" not in f:
            return None
        crcs = f[f"{CRC}/{c.name}"]
        if crcs.shape != (self._len,) or crcs.dtype != np.uint32:  # checked before reading it whole
            raise CorruptDataError(f"{self.path}: the checksums of {c.name!r} do not cover {self._len} rows")
        return crcs[...]

    def reset_state(self) -> None:
        super().reset_state()
        self._datasets()

    def _cell(self, c: Column, v: Any, shape: Any, crcs: np.ndarray | None, i: int) -> Any:
        """A stored cell back to its saved type; variable-length cells are checked against their CRC."""
        if c.kind == "array":
            return v if c.shape else np.array(v)
        if c.kind == "scalar":
            return v.item() if c.pytype else v
        if c.kind == "ragged":
            v = v.reshape(shape)
        elif c.kind == "bytes":
            v = v.tobytes()
        if crcs is not None and row_crc(v) != crcs[i]:
            raise CorruptDataError(f"{self.path}: datapoint {i}, component {c.name!r}: checksum mismatch "
                                   "(the file is damaged)")
        return v.decode("utf-8") if c.kind == "str" else v

    def _row(self, i: int) -> list:
        try:
            return [self._cell(c, ds[i], shapes[i] if shapes is not None else None, crcs, i)
                    for c, ds, shapes, crcs in self._datasets()]
        except BridgeflowError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
            raise CorruptDataError(f"{self.path}: reading datapoint {i} failed ({exc})") from exc

    def _block(self, start: int, stop: int) -> list[list]:
        """Columns of rows ``start:stop``, each a list of restored cells."""
        out = []
        try:
            for c, ds, shapes, crcs in self._datasets():
                block = ds[start:stop]
                if c.kind == "array":
                    out.append(list(block) if c.shape else [np.array(v) for v in block])
                elif c.kind == "scalar":  # Python types back via tolist(), numpy scalars stay numpy
                    out.append(block.tolist() if c.pytype else list(block))
                else:
                    shape_rows = shapes[start:stop] if shapes is not None else [None] * len(block)
                    out.append([self._cell(c, v, sh, crcs, start + j)
                                for j, (v, sh) in enumerate(zip(block, shape_rows))])
        except BridgeflowError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as exc:
            raise CorruptDataError(f"{self.path}: reading rows {start}:{stop} failed ({exc})") from exc
        return out

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
        f, self._f = self._f, None
        if f is not None and self._pid == os.getpid():
            f.close()
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_f"] = state["_ds"] = state["_pid"] = None
        return state

    def __repr__(self) -> str:
        return f"HDF5Data({self.path!r}, shuffle={self.shuffle}, n={self._len})"
