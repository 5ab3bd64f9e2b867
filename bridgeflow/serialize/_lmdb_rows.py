"""Small LMDB values checked and decoded a batch at a time, as *rows*: values of one size laid end to end.

At a few hundred bytes a value, what a read costs is the Python around it: a call to check each CRC, one
to decode each value, one ``pread`` to watch for a writer. A batch of ``k`` values of ``s`` bytes each
(the encoding and its 4-byte CRC-32, as :mod:`bridgeflow.serialize._lmdb_format` stores them), gathered into
one buffer, is instead checked by one CRC-32 call over the whole buffer and decoded by
:func:`~bridgeflow._codec.decode_many`. Sequential epochs gather a batch from a run of leaf pages
read at once; shuffled ones (:class:`SmallValueReads`) from the *region*, the bytes holding every value
the epoch reads, read with one ``preadv`` when it is at most :data:`REGION_BYTES` (64 MiB) and at least
half values (a small dataset), else with one ``preadv`` a value, which at 300 bytes costs more than the
rest of the read. Either way a file cut short or committed to while it is read is an error before any
datapoint of the batch is handed out, as for values read one by one.

Large values take another way when a batch of them is read to be collated (torch's DataLoader, see
:mod:`bridgeflow._stacked`): each value's arrays are read by its ``preadv`` straight into their rows of the
batch, the rest of it (head, padding, CRC) into small buffers, and its CRC continued over the parts.

Why one CRC over the rows checks every row: a value followed by its own CRC-32 (little-endian) has the same
CRC-32, whatever the value (the CRC's residue), and the CRC-32 of two buffers end to end depends only on
the CRC-32 of each and the second's length (zlib's ``crc32_combine``). So ``k`` sound rows of ``s`` bytes
always have one CRC-32, that of ``k`` copies of any sound row (:func:`rows_crc`). Damage to one row changes
that row's CRC, and ``crc32_combine`` carries any change of one part's CRC into a change of the whole's:
whatever a per-value check catches in one value, the batch check catches; damage to several values that
cancels out exactly is a 2**-32 chance, as for one CRC over the whole. When the check fails, each row is
checked alone, which names the damaged datapoint.

Example:
    >>> from bridgeflow.serialize._checksum import crc32
    >>> body = b"some encoded value"
    >>> row = body + crc32()(body).to_bytes(4, "little")
    >>> crc32()(row * 3) == rows_crc(3, len(row))
    True
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._codec import DECODE_ERRORS, buffer_spans, decode, decode_frames, decode_many
from .._serialize_errors import CorruptDataError
from .._stacked import collating_now, new_block
from ._checksum import crc32
from ._common import normalize_index
from ._lmdb_file import new_bytearray

__all__ = ["ROWS", "SMALL_VALUE", "SmallValueReads", "gather_rows", "read_rows", "rows_crc"]

ROWS = 256  # values a batch: 256 values of 300 bytes is 77 KB, held while the batch is handed out
SMALL_VALUE = 16 << 10  # values smaller than this are read in batches
REGION_BYTES = 64 << 20  # a shuffled epoch of small values lying within this many bytes reads them at once
_TAIL = 4  # the CRC-32 after each value
_PAGE = 4096

_crcs: dict[tuple[int, int], int] = {}
_crcs_lock = threading.Lock()


def rows_crc(k: int, s: int) -> int:
    """The CRC-32 of ``k`` sound rows of ``s`` bytes each, end to end (see the module doc); ``s >= 4``."""
    key = (k, s)
    found = _crcs.get(key)
    if found is not None:
        return found
    crc = crc32()
    body = bytes(s - 4)
    row = body + crc(body).to_bytes(4, "little")
    value = crc(row * k)
    with _crcs_lock:
        if len(_crcs) >= 256:
            _crcs.clear()
        _crcs[key] = value
    return value


def read_rows(fd: int, offsets: list[int], s: int) -> tuple[bytearray, int]:
    """The ``s``-byte values at ``offsets`` of the file ``fd``, read one ``preadv`` each into one buffer;
    and how many were read whole (``len(offsets)`` unless the file was cut under the reader)."""
    buf = new_bytearray(len(offsets) * s)
    mv = memoryview(buf)
    preadv = os.preadv
    at = 0
    for a, off in enumerate(offsets):
        if preadv(fd, [mv[at:at + s]], off) != s:
            return buf, a
        at += s
    return buf, len(offsets)


def gather_rows(block: Any, starts: np.ndarray, s: int) -> memoryview:
    """The ``s``-byte values lying at ``starts`` in ``block`` (a run of leaf pages read at once), end to end,
    in new writable memory: one indexing of the block's ``s``-byte windows (a copy in C, row by row)."""
    raw = np.frombuffer(block, np.uint8)
    if len(starts) and (int(starts.min()) < 0 or int(starts.max()) + s > len(raw)):
        raise IndexError(f"rows of {s} bytes at {starts.min()}..{starts.max()} lie outside a block of {len(raw)}")
    windows = np.lib.stride_tricks.as_strided(raw, (max(0, len(raw) - s + 1), s), (1, 1), writeable=False)
    return memoryview(windows[starts].reshape(-1))


def _arrays(dp: Any) -> Iterator[np.ndarray]:
    """The numpy arrays in a datapoint (in lists, tuples and dicts, at any depth)."""
    if type(dp) is np.ndarray:
        yield dp
    elif isinstance(dp, (list, tuple)):
        for v in dp:
            yield from _arrays(v)
    elif isinstance(dp, dict):
        for v in dp.values():
            yield from _arrays(v)


class SmallValueReads:
    """The shuffled-epoch reads of :class:`~bridgeflow.serialize._lmdb_format.LMDBDataset` for small values
    of bridgeflow's format: a batch of :data:`ROWS` at a time, gathered from the epoch's :meth:`_region` (or
    read one ``preadv`` each), checked by one CRC call (files with checksums) and decoded together. The
    reader provides ``_index`` (``offsets``, ``sizes``), ``_crc`` (whether values carry a CRC), ``_pin``,
    ``_watch_at``/``_watch``, and ``_get``, ``_finish``, ``_cut``, ``_written``.
    """

    _index: Any
    _crc: bool
    _order: Any
    _unpickle: bool
    format: str
    _fd: Callable[[], int]
    _pin: Any
    _watch_at: int
    _watch: bytes
    _get: Callable[[int, int], Any]
    _finish: Callable[[int, Any, Any], Any]
    _cut: Callable[[int, int, str], CorruptDataError]
    _damaged: Callable[..., CorruptDataError]
    _written: Callable[[], Exception]
    _offsets: Any
    _sizes: Any

    def __getitems__(self, indices: Sequence[int]) -> list:
        """``[self[i] for i in indices]``, read as a batch (torch's ``DataLoader`` asks for each batch's
        samples so): small values of bridgeflow's format :data:`ROWS` at a time, from the file's values read
        once and held while the reader is open (where they lie within :data:`REGION_BYTES`, as a shuffled
        epoch's), else one ``preadv`` each; checked by one CRC call and decoded together. The watch and the
        file's size are checked for each batch, before any of it is returned, as for one ``self[i]``: a file
        committed to or cut since it was opened is an error. Other files are read one value at a time."""
        idx = self._file_indices(indices)
        fd = self._fd()
        codec = self.format == "bridgeflow" and not self._unpickle  # values in bridgeflow's codec
        if codec and self._index.small:
            region = self._held_region(fd)
            out: list = []
            for j in range(0, len(idx), ROWS):
                batch, failed = self._rows(fd, idx[j:j + ROWS], region)
                if failed is not None:
                    raise failed
                out += batch
            return out
        if codec and len(idx) > 1 and collating_now():
            into = self._read_into_rows(fd, idx)
            if into is not None:
                return into
        return [self._get(fd, i) for i in idx]

    def _read_into_rows(self, fd: int, idx: list[int]) -> list | None:
        """``[self[i] for i in idx]`` read for a batch being collated (see :mod:`bridgeflow._stacked`): each
        value's arrays read by its ``preadv`` straight into their rows of one block per array, the rest of the
        value (head, padding, CRC) into small buffers; each value's CRC checked over its parts, and the watch
        once for the batch, before any of it is returned. None where the values are not alike (not one size,
        or the first's raw buffers are not all arrays): read each into memory of its own then. A value whose
        parts lie elsewhere than the first's is decoded whole, its arrays its own (the collation copies them)."""
        sizes = self._index.sizes[idx]
        size = int(sizes[0])
        if (sizes != size).any():
            return None
        tail = _TAIL if self._crc else 0
        first = new_bytearray(size)
        if os.preadv(fd, [first], self._offsets[idx[0]]) != size:
            raise self._cut(self._offsets[idx[0]], size, f"datapoint {idx[0]}")
        body = memoryview(first)[:size - tail]
        if tail and crc32()(body) != int.from_bytes(first[size - tail:], "little"):
            raise self._damaged(idx[0])
        try:
            head, spans = buffer_spans(body)
            dp = decode_frames([body[:head], *(body[o:o + n] for o, n in spans)])
        except DECODE_ERRORS:
            return None  # the usual read names what is wrong with it
        arrays = {a.__array_interface__["data"][0]: a for a in _arrays(dp)}
        start = np.frombuffer(first, np.uint8).__array_interface__["data"][0]
        found = [arrays.get(start + o) for o, n in spans]
        if not spans or any(a is None or a.nbytes != n for a, (o, n) in zip(found, spans)):
            return None
        blocks = [new_block(len(idx), a.shape, a.dtype) for a in found]  # type: ignore[union-attr]
        if any(b is None for b in blocks):
            return None
        rows = [b.reshape(len(idx), -1).view(np.uint8) for b in blocks]  # type: ignore[union-attr]
        parts: list = []  # what a value's preadv fills: the bytes before, between and after its arrays (head,
        at = 0  # padding, CRC: reused from value to value) and, between them, the arrays' rows
        for o, n in spans:
            parts += [bytearray(o - at), None]
            at = o + n
        parts.append(bytearray(size - at))
        out = []
        for k, i in enumerate(idx):
            parts[1::2] = [row[k] for row in rows]
            out.append(self._value_in_rows(fd, i, parts, head, spans, first if k == 0 else None))
        if os.pread(fd, 8, self._watch_at) != self._watch:
            raise self._written()
        return out

    def _value_in_rows(self, fd: int, i: int, parts: list, head: int, spans: list, whole: bytearray | None) -> Any:
        """Datapoint ``i`` read into ``parts`` (see :meth:`_read_into_rows`), its arrays views of their rows;
        ``whole``: its value, already read and checked (the first of the batch), copied into the parts."""
        if whole is not None:
            at = 0
            for part in parts:
                part[:] = whole[at:at + len(part)]
                at += len(part)
        else:
            off, size = self._offsets[i], self._sizes[i]
            if os.preadv(fd, parts, off) != size:
                raise self._cut(off, size, f"datapoint {i}")
            if self._crc:
                crc, of, last = 0, crc32(), parts[-1]
                for part in parts[:-1]:
                    crc = of(part, crc)
                if of(memoryview(last)[:len(last) - _TAIL], crc) != int.from_bytes(last[len(last) - _TAIL:], "little"):
                    raise self._damaged(i)
        try:
            if buffer_spans(parts[0]) != (head, spans):  # its parts lie elsewhere: decoded whole
                value = bytearray().join(parts)
                del value[len(value) - (_TAIL if self._crc else 0):]
                return decode(value)
            return decode_frames([memoryview(parts[0])[:head], *parts[1::2]])
        except DECODE_ERRORS as exc:
            raise self._damaged(i, exc) from exc

    def _file_indices(self, indices: Sequence[int]) -> list[int]:
        """The file's datapoint numbers of ``indices`` (this rank's, negative ones from the end), in one
        numpy pass; any that is not an integer in range is named by the error of ``self[i]``."""
        n, who, order = len(self), type(self).__name__, self._order  # type: ignore[arg-type]
        a = np.asarray(indices)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            return [order.shard_index(normalize_index(k, n, who)) for k in indices]
        a = np.where(a < 0, a + n, a)
        if len(a) and (int(a.min()) < 0 or int(a.max()) >= n):
            return [order.shard_index(normalize_index(k, n, who)) for k in indices]
        return ((a + order.shard_index(0)) % order.n).tolist() if order.shard is not None else a.tolist()

    def _held_region(self, fd: int) -> tuple[int, memoryview] | None:
        """The bytes holding every value of the file, read at the first :meth:`__getitems__` and held (see
        :meth:`_region`); ``None`` when they do not fit. A forked copy shares them; a pickled one reads
        them again."""
        held = self.__dict__.get("_values_region", False)
        if held is False:
            held = self.__dict__["_values_region"] = self._region(fd, range(len(self._index.sizes)), 0)
        return held

    def _read_batches(self, fd: int, it: Iterator[int], run: Any, skip: int) -> Iterator[Any]:
        """Small values in any order (a shuffled epoch), :data:`ROWS` at a time: gathered into one buffer
        (from the epoch's :meth:`_region`, else one ``preadv`` each), the writer's watch read once, checked
        and decoded together (:meth:`_rows`). ``it`` yields
        ``run[skip:]``; a batch is read ahead of it, and ``it`` advances with each datapoint handed out, so
        the reader's position is that of those."""
        region = self._region(fd, run, skip)
        j = skip
        for _ in it:
            end = min(len(run), j + ROWS)
            batch, failed = self._rows(fd, list(run[j:end]), region)
            if batch:
                yield batch[0]
                for dp, _ in zip(itertools.islice(batch, 1, None), it):
                    yield dp
            if failed is not None:  # a damaged value: the ones before it were handed out
                raise failed
            j = end

    def _region(self, fd: int, run: Any, skip: int) -> tuple[int, memoryview] | None:
        """``(lo, bytes)``: the file from byte ``lo`` on, holding every value ``run[skip:]`` reads, read at
        once, where they lie within :data:`REGION_BYTES` and fill at least half of it (a small dataset,
        or a shard of one that lies together); ``None`` else. A shuffled epoch then gathers its values
        from memory instead of one ``pread`` each; it holds the region until it ends."""
        at = np.asarray(run[skip:], np.int64)
        if not len(at):
            return None
        offsets, sizes = self._index.offsets[at], self._index.sizes[at]
        lo, hi = int(offsets.min()), int((offsets + sizes).max())
        if hi - lo > REGION_BYTES or hi - lo > 2 * int(sizes.sum(dtype=np.int64)) + _PAGE:
            return None
        buf = new_bytearray(hi - lo)
        if os.preadv(fd, [buf], lo) != hi - lo:
            raise self._cut(lo, hi - lo, "the values of this epoch")
        return lo, memoryview(buf)

    def _rows(self, fd: int, idx: list[int], region: tuple[int, memoryview] | None) -> tuple[list, Exception | None]:
        """The datapoints ``idx`` (small values of bridgeflow's format) read (from ``region``
        where given), checked and decoded as one batch where their values have one size, else each alone;
        with the error of the first damaged one, the list then stopping before it. The watch (and, for a
        region read earlier, the file's size) is checked before any is handed out, so a file a writer
        commits to or someone cuts while it is read is an error, as it is for values read one by one."""
        at = np.array(idx, np.int64)
        sizes = self._index.sizes[at]
        s = int(sizes[0])
        if s >= SMALL_VALUE or (sizes != s).any():
            return self._each(fd, idx)
        offsets = self._index.offsets[at]
        buf: bytearray | memoryview
        if region is not None:
            lo, mv = region
            if self._pin.size() < lo + len(mv):
                raise self._cut(lo, len(mv), "the values of this epoch")
            buf = gather_rows(mv, offsets - lo, s)
        else:
            buf, got = read_rows(fd, offsets.tolist(), s)
            if got != len(idx):
                raise self._cut(int(offsets[got]), s, f"datapoint {idx[got]}")
        if os.pread(fd, 8, self._watch_at) != self._watch:
            raise self._written()
        return self._decode_rows(idx, buf, s)

    def _each(self, fd: int, idx: list[int]) -> tuple[list, Exception | None]:
        out = []
        for i in idx:
            try:
                out.append(self._get(fd, i))
            except CorruptDataError as exc:
                return out, exc
        return out, None

    def _decode_rows(self, idx: list[int], buf: bytearray | memoryview, s: int) -> tuple[list, Exception | None]:
        """Datapoints ``idx`` from their values end to end in ``buf`` (``s`` bytes each, CRC included where
        the file has checksums): their CRCs checked by one call (see the module doc), decoded together;
        where that check fails or they do not decode together, each alone (which names a damaged one)."""
        k, tail = len(idx), _TAIL if self._crc else 0
        sound = not tail or crc32()(buf) == rows_crc(k, s)
        if sound and k > 1:
            try:
                got = decode_many(buf, np.arange(0, k * s, s, dtype=np.int64), s - tail)
            except DECODE_ERRORS:
                got = None
            if got is not None:
                return got, None
        mv, n, out = memoryview(buf), s - tail, []
        for a, i in enumerate(idx):
            at = a * s
            try:
                out.append(self._finish(i, bytearray(mv[at:at + n]), None if sound else mv[at + n:at + s]))
            except CorruptDataError as exc:
                return out, exc
        return out, None
