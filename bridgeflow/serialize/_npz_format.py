"""``.npz`` datasets for small data: every column in memory, one numpy array per column, no pickle.

Columns follow :mod:`bridgeflow.serialize._columns`: fixed-shape arrays are stacked (``c<k>``), ragged
arrays are stored flat with ``c<k>.shapes``, ``str`` (UTF-8) and ``bytes`` as one flat ``uint8`` array with
``c<k>.offsets``. ``__bf_meta__`` holds the JSON description (format, version, count, structure,
columns). Each member is read after checking its header's shape against the member's size (a damaged
shape must not make numpy allocate terabytes), decompressed in pieces into the array and never past the
size the member declares, to its end, so the zip CRC is checked (:mod:`bridgeflow.serialize._zip_member`);
object arrays are refused, nothing is unpickled, and a name two members share is refused as ambiguous.
Loading costs the arrays plus about 1 MiB, whatever the compression.

Example:
    >>> from bridgeflow import DataFromList
    >>> df = DataFromList([[np.arange(2), "a"], [np.arange(3), "b"]], shuffle=False)
    >>> NumpySerializer.save(df, "small.npz", progress=False)
    2
    >>> ds = NumpySerializer.load("small.npz", shuffle=False)
    >>> ds[1]
    [array([0, 1, 2]), 'b']
"""

from __future__ import annotations

import io
import json
import lzma
import math
import os
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._base import DataFlow
from .._errors import DatapointError
from .._order import IndexedSource
from .._serialize_errors import CorruptDataError, UnsupportedFormatError
from ._atomic import atomic_path, check_target, write_error
from ._columns import Column, assemble, classify, split_datapoint
from ._common import classes_json, existing_path, iterate_source, normalize_index, parse_classes, wrong_format
from ._pinned import PinnedFile
from ._zip_member import MemberFile, ZipMember

__all__ = ["NumpyData", "NumpySerializer"]

FORMAT_NAME = "bridgeflow-npz"
FORMAT_VERSION = 1
META = "__bf_meta__"


def _flat_bytes(chunks: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum([len(c) for c in chunks], out=offsets[1:])
    return np.frombuffer(b"".join(chunks), np.uint8), offsets


def _column_arrays(k: int, col: Column, values: list) -> dict[str, np.ndarray]:
    key = f"c{k}"
    # the column's dtype, restored after np.stack / np.concatenate, which turn '>i4' into native '<i4'
    dtype = np.dtype(col.dtype) if col.kind in ("array", "ragged") else None
    if col.kind == "array":
        return {key: np.stack(values).astype(dtype, copy=False) if values else np.zeros((0, *col.shape), dtype)}
    if col.kind == "scalar":
        return {key: np.array(values, dtype=np.dtype(col.dtype))}
    if col.kind == "ragged":
        rows = [np.ascontiguousarray(v).reshape(-1) for v in values]
        shapes = np.array([v.shape for v in values], np.int64).reshape(len(values), len(col.shape))
        return {key: np.concatenate(rows).astype(dtype, copy=False) if rows else np.zeros(0, dtype),
                f"{key}.shapes": shapes}
    raw = [v.encode("utf-8", "surrogatepass") for v in values] if col.kind == "str" else values
    flat, offsets = _flat_bytes(raw)
    return {key: flat, f"{key}.offsets": offsets}


def _read_member(pin: PinnedFile, info: zipfile.ZipInfo) -> np.ndarray:
    """One ``.npy`` member, its header checked against the member's size *before* the array is
    allocated (``np.load`` allocates whatever shape a damaged header declares), decompressed in pieces
    straight into the array and never past the size the member declares, its CRC checked
    (:mod:`bridgeflow.serialize._zip_member`). Object dtypes are refused: nothing is unpickled."""
    fmt = np.lib.format
    name = info.filename
    member = ZipMember(pin, info)
    fh = MemberFile(member)
    try:  # numpy parses the header with Python's tokenizer: damage raises what it raises (TokenError...)
        version = fmt.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fh)
        elif version in ((2, 0), (3, 0)):
            shape, fortran, dtype = fmt.read_array_header_2_0(fh)
        else:
            raise ValueError(f"unknown npy version {version}")
    except (MemoryError, RecursionError):
        raise
    except Exception as exc:
        raise ValueError(f"member {name!r}: damaged npy header ({type(exc).__name__}: {exc})") from exc
    if dtype.hasobject or dtype.itemsize == 0:
        raise ValueError(f"member {name!r} holds dtype {dtype}, which bridgeflow never writes")
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes != member.left:
        raise ValueError(f"member {name!r}: its header declares shape {shape} of {dtype} ({nbytes} bytes) "
                         f"but it holds {member.left} bytes")
    try:
        flat = np.empty(count, dtype)
    except MemoryError:
        raise MemoryError(f"{pin.path}: not enough memory for member {name!r} ({nbytes:,} bytes of {dtype} of "
                          f"shape {shape}, as the file declares)") from None
    got = member.readall_into(flat.view(np.uint8).data)
    if got != nbytes:
        raise EOFError(f"member {name!r} ends after {got} of {nbytes} bytes")
    member.finish()
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def _read_npz(pin: PinnedFile) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, by name (without ``.npy``); see :func:`_read_member`. Everything,
    its size included, comes from the one open file ``pin``: a file renamed over the path meanwhile is
    never mixed in. A name given to two members is refused: which one is meant is ambiguous."""
    with zipfile.ZipFile(io.BufferedReader(pin.fileobj())) as z:
        out = {}
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                raise ValueError(f"member {info.filename!r} is not an .npy array")
            key = info.filename[:-4]
            if key in out:
                raise ValueError(f"member {info.filename!r} appears twice: which one to read is ambiguous")
            out[key] = _read_member(pin, info)
    return out


class NumpySerializer:
    """Save a (small) flow to one ``.npz`` file and load it back; everything is held in memory."""

    @staticmethod
    def save(df: DataFlow, path: str | os.PathLike, data_paths: Sequence[str] | None = None, *,
             overwrite: bool = False, progress: bool = True, classes: Sequence[str] | None = None) -> int:
        """Collect every datapoint of ``df`` into columns and write them to ``path``; returns the count.
        ``classes`` (the names of the labels) is stored in the file and comes back as ``.classes``."""
        names_given = None if data_paths is None else [str(p) for p in data_paths]
        columns: list[Column] = []
        values: list[list] = []
        structure, names = "list", []
        desc = f"npz {os.path.basename(os.fspath(path))}"
        target = check_target(path, overwrite)  # refuse before reading the whole source
        count = 0
        for i, dp in enumerate(iterate_source(df, progress=progress, desc=desc)):
            s, n, vals = split_datapoint(dp, names_given, i)
            if not columns:
                structure, names = s, n
                columns = [classify(name, v, i) for name, v in zip(n, vals)]
                values = [[] for _ in columns]
            elif (s, n) != (structure, names):
                raise DatapointError(f"datapoint {i} is a {s} with components {n}; the first was a "
                                     f"{structure} with {names}")
            for k, v in enumerate(vals):
                upgraded = columns[k].check(v, i)
                if upgraded is not None:
                    columns[k] = upgraded
                values[k].append(v)
            count += 1
        arrays: dict[str, np.ndarray] = {}
        for k, (col, vals) in enumerate(zip(columns, values)):
            arrays.update(_column_arrays(k, col, vals))
        meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "count": count, "structure": structure,
                "columns": [c.to_json() for c in columns]}
        if classes is not None:
            meta["classes"] = json.loads(classes_json(classes))
        arrays[META] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        with atomic_path(target, overwrite=overwrite, sidecars=()) as tmp:
            try:
                with open(tmp, "wb") as fh:
                    np.savez(fh, **arrays)  # type: ignore[arg-type]  # numpy's stub types **arrays as allow_pickle's bool
            except OSError as exc:
                raise write_error(target, exc, tmp, needed=sum(a.nbytes for a in arrays.values())) from exc
        return count

    @staticmethod
    def load(path: str | os.PathLike, shuffle: bool = True, *, seed: int | None = None,
             shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> NumpyData:
        """The flow of datapoints stored at ``path`` (see :class:`NumpyData`); ``shard=(rank, world)`` or
        ``"auto"`` reads this rank's part only."""
        return NumpyData(path, shuffle=shuffle, seed=seed, shard=shard, drop_last=drop_last)


class NumpyData(IndexedSource):
    """Datapoints of an ``.npz`` dataset, loaded into memory: ``len()``, ``ds[i]``, optional shuffling.

    Arrays returned are views of the loaded column arrays (writable; changing one changes the dataset).
    ``shard=(rank, world)`` or ``"auto"`` reads this rank's part of every epoch (see
    :mod:`bridgeflow._shard`); ``state_dict()`` is the epoch and position (see :mod:`bridgeflow._order`).
    """

    def __init__(self, path: str | os.PathLike, shuffle: bool = True, seed: int | None = None, *,
                 shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> None:
        self.path = existing_path(path, "NumpyData")
        self.shuffle = shuffle
        self.seed = seed
        pin = PinnedFile(self.path, "NumpyData")  # one open of the path, refused unless a regular file
        try:
            other = wrong_format(self.path, pin, "npz")
            if other is not None:
                raise other
            try:
                arrays = _read_npz(pin)
            except (OSError, ValueError, zipfile.BadZipFile, EOFError, KeyError, NotImplementedError, zlib.error,
                    lzma.LZMAError) as exc:
                raise CorruptDataError(f"{self.path}: cannot read as npz ({type(exc).__name__}: {exc})") from exc
            self._bytes = pin.size()
        finally:
            pin.close()
        try:
            meta = json.loads(arrays.pop(META).tobytes())
        except (KeyError, ValueError) as exc:
            raise CorruptDataError(f"{self.path}: an npz file not written by NumpySerializer "
                                   f"(no valid {META})") from exc
        try:
            if meta.get("format") != FORMAT_NAME:
                raise CorruptDataError(f"{self.path}: {META} names format {meta.get('format')!r}")
            if meta.get("version") != FORMAT_VERSION:
                raise UnsupportedFormatError(f"{self.path}: npz format version {meta.get('version')}; this "
                                             f"bridgeflow reads version {FORMAT_VERSION}")
            self.structure = str(meta["structure"])
            self.columns = [Column.from_json(c) for c in meta["columns"]]
            self._len = int(meta["count"])
            self.classes: list[str] | None = parse_classes(None if meta.get("classes") is None
                                                           else json.dumps(meta["classes"]), self.path)
            self._cells = [self._unpack(k, c, arrays) for k, c in enumerate(self.columns)]
        except (CorruptDataError, UnsupportedFormatError):
            raise
        except (KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
            raise CorruptDataError(f"{self.path}: damaged npz dataset ({type(exc).__name__}: {exc})") from exc
        self.names = [c.name for c in self.columns]
        self._init_order(self._len, shuffle, shard, drop_last)

    def _identity(self) -> dict:
        return {"count": self._len, "bytes": self._bytes}

    def _unpack(self, k: int, col: Column, arrays: dict[str, np.ndarray]) -> list:
        a, n = arrays[f"c{k}"], self._len
        if col.kind in ("array", "scalar"):
            if a.shape[:1] != (n,):
                raise ValueError(f"column {col.name!r} holds {a.shape[:1]} rows, the count is {n}")
            if col.kind == "scalar":
                return a.tolist() if col.pytype else list(a)
            return list(a) if col.shape else [np.array(v) for v in a]
        if col.kind == "ragged":
            shapes = arrays[f"c{k}.shapes"]
            sizes = np.prod(shapes, axis=1, dtype=np.int64) if len(shapes) else np.zeros(0, np.int64)
            if len(shapes) != n or int(sizes.sum()) != a.size:
                raise ValueError(f"ragged column {col.name!r} does not match its shapes")
            ends = np.cumsum(sizes)
            return [a[e - s:e].reshape(shape) for s, e, shape in zip(sizes, ends, shapes.tolist())]
        offsets = arrays[f"c{k}.offsets"]
        if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != a.size or np.any(np.diff(offsets) < 0):
            raise ValueError(f"column {col.name!r} has bad offsets")
        raw = a.tobytes()
        cells = [raw[s:e] for s, e in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        return [c.decode("utf-8", "surrogatepass") for c in cells] if col.kind == "str" else cells

    def __getitem__(self, index: int) -> Any:
        i = self._order.shard_index(normalize_index(index, len(self), "NumpyData"))
        return assemble(self.structure, self.names, [cells[i] for cells in self._cells])

    def _read(self, runs: list, pos: int) -> Iterator[Any]:
        structure, names, all_cells = self.structure, self.names, self._cells
        for it, _, _ in self._order.iters(runs, pos):
            for i in it:
                yield assemble(structure, names, [cells[i] for cells in all_cells])

    def __repr__(self) -> str:
        return f"NumpyData({self.path!r}, shuffle={self.shuffle}, n={self._len})"
