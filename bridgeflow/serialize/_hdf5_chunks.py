"""Compressed HDF5 chunks: their size bounded when a file is opened, their streams checked before libhdf5
decodes them.

libhdf5 decodes a whole chunk to read any part of it, and its filters trust the stream: the deflate
filter doubles its buffer until the stream ends (a chunk that declares 1 MiB can inflate to 1,032 times
its stored bytes), h5py's LZF filter allocates what the filter's parameters say and grows on, and the
szip filter allocates the size the chunk's first four bytes claim. A 264 KB file holding one 256 MiB
gzip chunk made every row read allocate and inflate 256 MiB again (8 rows: 10 s, 260 MB), and a memory
limit turned the failed allocation into "filter returned failure", read as damage.

So, for every dataset a reader reads whose chunks are compressed (gzip, lzf or szip; shuffle and
fletcher32 may come with them):

- :func:`check_chunks`, when the file is opened (metadata only), refuses a chunk over
  :data:`MAX_CHUNK_BYTES` (16 MiB) with the figures, and any other compression (two compressors in one
  pipeline, scale-offset, n-bit, plugin filters such as blosc or zstd), whose output it cannot bound;
  ``verify=False`` (a file you trust) skips it.
- :class:`CheckedChunks` wraps the dataset: before libhdf5 reads rows, the chunks that hold them are
  checked once per reader and process, from their stored bytes (``read_direct_chunk``): no larger than
  a compressed chunk can be, and decoding to exactly the bytes the chunk holds, never more (gzip inflated
  in 1 MiB pieces and dropped; LZF decoded by h5py's own ``lzf_decompress`` into a buffer of the chunk's
  size; szip's claimed size compared). A stream that goes past it is :class:`CorruptDataError` naming
  the file, the dataset and the chunk. The dataset is opened with a chunk cache that holds one row of
  chunks (at most 64 MiB), so rows read in order decode each chunk once.
- :func:`read_failure` tells a failed read's cause: libhdf5 says "filter returned failure" for a
  failed allocation too, so a checked chunk that fails while memory for its decoding cannot be had is
  a :class:`MemoryError` naming the file, not damage.

Reading a compressed dataset then costs at most about twice its chunk size (libhdf5's decoding) plus
the cache, however its streams are crafted.

Example:
    >>> import h5py
    >>> with h5py.File("z.h5", "w", libver="latest") as f:
    ...     _ = f.create_dataset("x", data=np.zeros((8, 4), np.int32), chunks=(4, 4), compression="gzip")
    >>> with h5py.File("z.h5", "r") as f:
    ...     check_chunks(f["x"], "x", "z.h5")
    ...     CheckedChunks(f["x"], "x", "z.h5")[2:6].shape
    (4, 4)
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import math
import zlib
from typing import Any

import numpy as np

from .._serialize_errors import CorruptDataError, UnsupportedFormatError

__all__ = ["MAX_CHUNK_BYTES", "CheckedChunks", "cache_bytes", "check_chunks", "compressed", "open_with_cache",
           "read_failure"]

MAX_CHUNK_BYTES = 16 << 20
_CACHE_BYTES = 64 << 20
_PIECE = 1 << 20
_DEFLATE, _SHUFFLE, _FLETCHER32, _SZIP, _LZF = 1, 2, 3, 4, 32000
_COMPRESSORS = {_DEFLATE: "gzip", _SZIP: "szip", _LZF: "lzf"}
_SIZE_KEEPING = (_SHUFFLE, _FLETCHER32)


def _filters(ds: Any) -> list[tuple[int, tuple, str]]:
    """The dataset's filters in the order they were applied when writing: ``(id, parameters, name)``."""
    plist = ds.id.get_create_plist()
    out = []
    for i in range(plist.get_nfilters()):
        fid, _flags, values, name = plist.get_filter(i)
        out.append((int(fid), tuple(values), name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)))
    return out


def compressed(ds: Any) -> bool:
    """Whether ``ds`` (an h5py dataset) has a filter that changes the size of its chunks."""
    try:
        return ds.chunks is not None and any(fid not in _SIZE_KEEPING for fid, _, _ in _filters(ds))
    except (AttributeError, TypeError):
        return False


def _chunk_bytes(ds: Any) -> int:
    return math.prod(ds.chunks) * ds.dtype.itemsize


def check_chunks(ds: Any, name: str, path: str) -> None:
    """Refuse (metadata only) a dataset whose compressed chunks a reader cannot bound; see the module doc."""
    if not compressed(ds):
        return
    filters = _filters(ds)
    squeezing = [(fid, label) for fid, _, label in filters if fid not in _SIZE_KEEPING]
    names = " + ".join(label or str(fid) for fid, _, label in filters)
    if len(squeezing) > 1 or squeezing[0][0] not in _COMPRESSORS:
        raise UnsupportedFormatError(
            f"{path}: dataset {name!r} is stored through the filters {names}; bridgeflow checks chunks compressed "
            "with one of gzip, lzf or szip (with shuffle or fletcher32) before libhdf5 decodes them, and no other "
            "compression's output can be bounded before it is decoded. Re-save it with one of those, or, for a "
            "file you trust, pass verify=False")
    u = _chunk_bytes(ds)
    if u > MAX_CHUNK_BYTES:
        raise UnsupportedFormatError(
            f"{path}: dataset {name!r} is stored in {_COMPRESSORS[squeezing[0][0]]} chunks of {u:,} bytes "
            f"({ds.chunks} of {ds.dtype}); bridgeflow decodes compressed chunks of at most {MAX_CHUNK_BYTES:,} "
            "bytes, since every read decodes a whole chunk. Re-chunk it (h5repack -l "
            f"{name}:CHUNK=...) or, for a file you trust, pass verify=False")
    for fid, values, _ in filters:
        if fid == _LZF and len(values) >= 3 and values[2] not in (0, u):
            raise CorruptDataError(f"{path}: dataset {name!r}: its lzf filter declares chunks of {values[2]:,} bytes, "
                                   f"its chunks hold {u:,}: damaged or crafted, not read")


def cache_bytes(ds: Any) -> int:
    """The chunk cache for a compressed dataset: one row of its chunks (64 MiB at most), and more than one
    chunk (libhdf5 leaves a chunk of the cache's size exactly out of it). libhdf5's default, 1 MiB,
    decodes a larger chunk again for every row read."""
    chunk = _chunk_bytes(ds)
    row_of_chunks = chunk * math.prod(-(-n // c) for n, c in zip(ds.shape[1:], ds.chunks[1:]))
    return max(min(row_of_chunks, _CACHE_BYTES), chunk) + 4096


def open_with_cache(f: Any, name: str, nbytes: int) -> Any:
    """The dataset at ``name`` of the open ``h5py.File`` ``f``, opened with a chunk cache of ``nbytes``. No
    other handle on it may be open: libhdf5 gives a later open of an open dataset the first one's cache."""
    import h5py

    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(10007, nbytes, 1.0)
    return h5py.Dataset(h5py.h5d.open(f.id, name.encode("utf-8"), dapl))


@functools.cache
def _lzf_decompress() -> Any:
    """h5py's own ``lzf_decompress`` (liblzf, linked into its ``h5z`` module), or ``None``."""
    try:
        import h5py.h5z

        fn = ctypes.CDLL(h5py.h5z.__file__, use_errno=True).lzf_decompress
    except (OSError, AttributeError, ImportError):
        return None
    fn.restype = ctypes.c_uint
    fn.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
    return fn


class CheckedChunks:
    """A compressed h5py dataset whose chunks are checked before libhdf5 decodes them (see the module doc):
    ``cc[i]``, ``cc[a:b]`` and ``cc[...]`` read like the dataset's."""

    def __init__(self, ds: Any, name: str, path: str) -> None:
        self.ds, self.name, self.path = ds, name, path
        self.shape, self.dtype, self.chunks = ds.shape, ds.dtype, ds.chunks
        self.filters = _filters(ds)
        self.chunk_bytes = _chunk_bytes(ds)
        self.rows_per_chunk = ds.chunks[0] if ds.shape else 1
        self.checked = np.zeros(-(-ds.shape[0] // self.rows_per_chunk) if ds.shape else 1, bool)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, sel: Any) -> Any:
        n = self.shape[0] if self.shape else 1
        if isinstance(sel, slice):
            start, stop, _ = sel.indices(n)
        elif sel is Ellipsis:
            start, stop = 0, n
        else:
            start = int(sel) + (n if int(sel) < 0 else 0)
            stop = start + 1
        if stop > start:
            k = self.rows_per_chunk
            for j in np.flatnonzero(~self.checked[start // k:(stop - 1) // k + 1]) + start // k:
                self._check_row_of_chunks(int(j))
        return self.ds[sel]

    def _check_row_of_chunks(self, j: int) -> None:
        shape, chunks = self.shape, self.chunks
        rest = [range(0, n, c) for n, c in zip(shape[1:], chunks[1:])]
        for offset in itertools.product([j * self.rows_per_chunk], *rest):
            self._check(offset)
        self.checked[j] = True

    def _fail(self, offset: tuple, what: str) -> CorruptDataError:
        return CorruptDataError(f"{self.path}: dataset {self.name!r}, the chunk at {offset}: {what}; damaged, or "
                                "crafted to exhaust memory: not read")

    def _check(self, offset: tuple) -> None:
        dsid, u = self.ds.id, self.chunk_bytes
        info = dsid.get_chunk_info_by_coord(offset)
        if info.byte_offset is None:
            return  # not stored: libhdf5 gives the fill value
        if info.size > u + u // 8 + 4096:  # more than compressing the chunk can give
            raise self._fail(offset, f"it stores {info.size:,} bytes for {u:,}")
        mask, raw = dsid.read_direct_chunk(offset)
        want = u + 4 * sum(fid == _FLETCHER32 for fid, _, _ in self.filters)  # what the last filter gives back
        for i in range(len(self.filters) - 1, -1, -1):
            fid = self.filters[i][0]
            if mask & (1 << i):
                continue  # this filter was skipped for this chunk
            if fid == _FLETCHER32:
                want -= 4
                raw = raw[:-4] if len(raw) >= 4 else b""
            elif fid != _SHUFFLE:
                self._decodes_to(offset, fid, raw, want)
                return
        if len(raw) != want:
            raise self._fail(offset, f"stored uncompressed, it holds {len(raw):,} bytes for {want:,}")

    def _decodes_to(self, offset: tuple, fid: int, raw: bytes, want: int) -> None:
        """The compressed stream ``raw`` decodes to exactly ``want`` bytes, checked without going past."""
        if fid == _SZIP:
            claimed = int.from_bytes(raw[:4], "little") if len(raw) >= 4 else -1
            if claimed != want:
                raise self._fail(offset, f"its szip stream claims {claimed:,} bytes for {want:,}")
            return
        if fid == _LZF:
            decode = _lzf_decompress()
            if decode is None:
                raise UnsupportedFormatError(f"{self.path}: dataset {self.name!r} is lzf-compressed and this h5py "
                                             "offers no lzf decoder to check its chunks with; pass verify=False "
                                             "for a file you trust")
            out = ctypes.create_string_buffer(max(want, 1))
            ctypes.set_errno(0)
            got = decode(raw, len(raw), out, want)
            if got != want:
                why = "decodes past" if got == 0 and ctypes.get_errno() == errno.E2BIG else "does not decode to"
                raise self._fail(offset, f"its lzf stream {why} the {want:,} bytes the chunk holds")
            return
        d, got, data = zlib.decompressobj(), 0, raw
        try:
            while data and not d.eof:
                got += len(d.decompress(data, _PIECE))
                data = d.unconsumed_tail
                if got > want:
                    raise self._fail(offset, f"its gzip stream inflates past the {want:,} bytes the chunk holds")
        except zlib.error as exc:
            raise self._fail(offset, f"its gzip stream is damaged ({exc})") from None
        if got != want or not d.eof:
            raise self._fail(offset, f"its gzip stream gives {got:,} of the {want:,} bytes the chunk holds")


def read_failure(exc: BaseException, path: str, what: str, chunk_bytes: int = 0) -> BaseException:
    """The error for a libhdf5 read that failed with ``exc``: :class:`MemoryError` naming the file when memory
    was the cause (libhdf5 said so, or the memory to decode a ``chunk_bytes`` chunk twice cannot be had
    now: its filters report a failed allocation as "filter returned failure"), else
    :class:`CorruptDataError`."""
    text = str(exc)
    short = "alloc" in text.lower()
    if not short and chunk_bytes:
        try:
            np.empty(2 * chunk_bytes + (16 << 20), np.uint8)  # not touched: only whether it can be had
        except MemoryError:
            short = True
    if short:
        return MemoryError(f"{path}: not enough memory for libhdf5 to read {what} ({text})")
    return CorruptDataError(f"{path}: reading {what} failed ({text})")
