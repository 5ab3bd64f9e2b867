"""The datapoint codec: a small versioned binary format that never runs code on load.

Layout of one encoded datapoint (integers little-endian)::

    header    32 bytes: magic b"\x93BFC", version u8, codec u8, flags u16,
              nbuf u32, skel_len u32, nvals u32, heap_len u32, total u64 (the length of this encoding,
              checked before a reader copies a stored value)
    skeleton  the shape of the object tree: one tag per node, container sizes, array dtypes and
              ranks (no values); datapoints of one kind share one skeleton
    values    nvals x 8 bytes (ints, floats, array dims, heap offsets/lengths), then nbuf x u64: the
              byte length of each raw buffer
    heap      the bytes of strings, small bytes objects, big ints and numpy scalars
    buffers   raw bytes of arrays (and of bytes objects >= 1 KiB) in tree order, each starting at a
              multiple of 16 bytes from the start of the encoding, so ``np.frombuffer`` views are aligned

Decoding compiles each new skeleton once into a small tree of closures (cached), so reading a stream of
same-shaped datapoints costs one ``struct.unpack_from`` for values and table plus one ``np.frombuffer``
per array. With ``codec="pickle"`` the heap holds a protocol-5 pickle and the buffers its out-of-band
buffers.

:func:`encode` / :func:`decode` work on one contiguous buffer (an LMDB value). :func:`encode_frames` /
:func:`decode_frames` keep the buffers as separate frames (header + table + structure first), so a
transport sends arrays without copying them into a header.

The codec sits beside the state, below the flows: a state keeps the datapoints a flow holds with it
(:func:`bridgeflow._state.pack_held`). Users reach it through :mod:`bridgeflow.serialize`, which exports
its public names.

Arrays decoded are **views of the buffer given** (zero-copy): writable exactly when that buffer is
writable (``bytearray``, a writable ``memoryview``), read-only for ``bytes``. The dataset readers of
:mod:`bridgeflow.serialize` copy each stored value once into a fresh ``bytearray``, so the arrays they return
are writable and stay valid after the file is closed.

Supported: numpy arrays of bool, integer, float, complex, datetime/timedelta and fixed-width string dtypes
(any shape, 0-d and empty too; non-contiguous arrays are stored contiguously, Fortran-ordered ones keep
their order), numpy scalars, Python ``None``/``bool``/``int``/``float``/``str``/``bytes``, lists, tuples
and dicts, nested up to 64 levels. Subclasses (``namedtuple``, ``OrderedDict``, ``IntEnum``) are stored as
their base type. ``codec="pickle"`` stores anything picklable and is read only with ``allow_pickle=True``.

Example:
    >>> import numpy as np
    >>> arr, label = decode(encode([np.arange(3, dtype=np.int16), 7]))
    >>> arr.tolist(), label
    ([0, 1, 2], 7)
"""

from __future__ import annotations

import functools
import pickle
import re
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._codec_plan import ARRAY_KINDS, Plan, T, compile_plan
from ._serialize_errors import CorruptDataError, EncodeError, PickleNotAllowedError, UnsupportedFormatError

__all__ = [
    "CODECS",
    "DECODE_ERRORS",
    "DEFAULT_CODEC",
    "FORMAT_VERSION",
    "buffer_spans",
    "decode",
    "decode_frames",
    "decode_many",
    "encode",
    "encode_frames",
    "peek_codec",
]

MAGIC = b"\x93BFC"
FORMAT_VERSION = 1
DEFAULT_CODEC = "bridgeflow"
CODECS = ("bridgeflow", "pickle")  # index = the codec byte in the header
ALIGN = 16
MAX_DEPTH = 64
INLINE_BYTES = 1024  # bytes objects shorter than this live in the heap, longer ones in a buffer

_HEAD = struct.Struct("<4sBBHIIIIQ")
HEAD_SIZE = _HEAD.size  # 32
TOTAL = struct.Struct("<Q")  # TOTAL.unpack_from(buf, 24)[0] is the encoding's declared length
_U8, _U32 = struct.Struct("<B"), struct.Struct("<I")
_INT64 = (-(1 << 63), 1 << 63)


# --- encoding -------------------------------------------------------------------------------------

def _where(path: tuple) -> str:
    return "datapoint" + "".join(f"[{p!r}]" for p in path)


def _dtype_code(dt: np.dtype, path: tuple) -> bytes:
    if dt.kind not in ARRAY_KINDS or dt.fields is not None or dt.subdtype is not None or dt.itemsize == 0:
        raise EncodeError(f"{_where(path)}: cannot store dtype {dt} with the bridgeflow codec "
                          "(numeric, bool, datetime and fixed-width string dtypes only; "
                          'use codec="pickle" for object arrays)')
    code = dt.str.encode("ascii")
    return _U8.pack(len(code)) + code


class _Encoder:
    """Walks the object tree once, filling the skeleton, the values (with their struct codes), the heap
    and the list of raw buffers."""

    __slots__ = ("skel", "fmt", "vals", "heap", "bufs")

    def __init__(self) -> None:
        self.skel = bytearray()
        self.fmt: list[str] = []
        self.vals: list[Any] = []
        self.heap = bytearray()
        self.bufs: list[Any] = []

    def _blob(self, tag: bytes, raw: bytes) -> None:
        self.skel += tag
        self.fmt.append("QQ")
        self.vals += (len(self.heap), len(raw))
        self.heap += raw

    def add(self, x: Any, path: tuple) -> None:
        skel = self.skel
        if len(path) > MAX_DEPTH:
            raise EncodeError(f"{_where(path[:4])}...: nested deeper than {MAX_DEPTH} levels")
        if isinstance(x, np.ndarray):
            self._array(x, path)
        elif isinstance(x, np.generic):  # before int/float/str/bytes: np.float64 is a float subclass
            skel += T.SCALAR + _dtype_code(x.dtype, path)
            self.fmt.append("Q")
            self.vals.append(len(self.heap))
            self.heap += np.asarray(x).tobytes()
        elif x is None:
            skel += T.NONE
        elif x is True or x is False:
            skel += T.TRUE if x else T.FALSE
        elif isinstance(x, int):
            if _INT64[0] <= x < _INT64[1]:
                skel += T.INT
                self.fmt.append("q")
                self.vals.append(x)
            else:
                self._blob(T.BIGINT, int(x).to_bytes((x.bit_length() + 8) // 8, "little", signed=True))
        elif isinstance(x, float):
            skel += T.FLOAT
            self.fmt.append("d")
            self.vals.append(x)
        elif isinstance(x, str):
            self._blob(T.STR, x.encode("utf-8", "surrogatepass"))
        elif isinstance(x, bytes):
            if len(x) < INLINE_BYTES:
                self._blob(T.BYTES, x)
            else:
                skel += T.BIGBYTES
                self.bufs.append(x)
        elif isinstance(x, (list, tuple)):
            skel += (T.TUPLE if isinstance(x, tuple) else T.LIST) + _U32.pack(len(x))
            for i, v in enumerate(x):
                self.add(v, path + (i,))
        elif isinstance(x, dict):
            skel += T.DICT + _U32.pack(len(x))
            for k, v in x.items():
                self.add(k, path + ("<key>",))
                self.add(v, path + (k,))
        else:
            raise EncodeError(f"{_where(path)}: cannot store a {type(x).__module__}.{type(x).__qualname__} "
                              "with the bridgeflow codec (arrays, numbers, str, bytes, None, lists, tuples, "
                              'dicts); convert it, or save with codec="pickle"')

    def _array(self, a: np.ndarray, path: tuple) -> None:
        code = _dtype_code(a.dtype, path)
        fortran = a.ndim > 1 and not a.flags.c_contiguous and a.flags.f_contiguous
        flat = a.T.reshape(-1) if fortran else np.ascontiguousarray(a).reshape(-1)
        self.skel += T.ARRAY + code + bytes((1 if fortran else 0, a.ndim))
        self.fmt.append("Q" * a.ndim)
        self.vals += a.shape
        self.bufs.append(flat.view(np.uint8) if flat.size else b"")


def _codec_id(codec: str) -> int:
    try:
        return CODECS.index(codec)
    except ValueError:
        raise ValueError(f"unknown codec {codec!r}; choose one of {list(CODECS)}") from None


def _prepare(obj: Any, codec: str) -> tuple[bytes, list[Any]]:
    """Header + skeleton + values + table + heap, and the raw buffers."""
    cid = _codec_id(codec)
    if cid == 0:
        enc = _Encoder()
        enc.add(obj, ())
        skel, fmt, vals, heap, bufs = bytes(enc.skel), "".join(enc.fmt), enc.vals, bytes(enc.heap), enc.bufs
    else:
        pbufs: list[pickle.PickleBuffer] = []
        heap = pickle.dumps(obj, protocol=5, buffer_callback=pbufs.append)
        skel, fmt, vals, bufs = b"", "", [], [pb.raw() for pb in pbufs]
    lengths = [memoryview(b).nbytes for b in bufs]
    nvals = len(fmt)
    table = struct.pack(f"<{fmt}{len(bufs)}Q", *vals, *lengths)
    total = HEAD_SIZE + len(skel) + len(table) + len(heap)
    for n in lengths:
        total += -total % ALIGN + n
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, cid, 0, len(bufs), len(skel), nvals, len(heap), total)
    return b"".join((head, skel, table, heap)), bufs


def encode(obj: Any, *, codec: str = DEFAULT_CODEC) -> bytes:
    """Encode a datapoint (or any supported object) into one contiguous ``bytes``.

    Raises :class:`EncodeError` naming the component it cannot store.
    """
    head, bufs = _prepare(obj, codec)
    parts: list[Any] = [head]
    size = len(head)
    zeros = bytes(ALIGN)
    for b in bufs:
        pad = -size % ALIGN
        if pad:
            parts.append(zeros[:pad])
        parts.append(b)
        size += pad + memoryview(b).nbytes
    return b"".join(parts)


def encode_frames(obj: Any, *, codec: str = DEFAULT_CODEC) -> list[bytes | memoryview]:
    """Encode into frames ``[header+structure, buffer0, buffer1, ...]``; contiguous arrays are not copied.

    The buffers are memoryviews of the arrays given (or of contiguous copies): send them before
    modifying the arrays.
    """
    head, bufs = _prepare(obj, codec)
    return [head] + [b if isinstance(b, bytes) else memoryview(b) for b in bufs]


# --- decoding -------------------------------------------------------------------------------------

_plans: dict[bytes, Plan] = {}
_MAX_PLANS = 1024
_last: list[Plan] = [compile_plan(b"N", MAX_DEPTH)]  # the plan used last: same-shaped streams hit it
DECODE_ERRORS = (CorruptDataError, UnsupportedFormatError, PickleNotAllowedError)
"""What decoding raises on purpose: anything else is turned into a ``CorruptDataError``."""


def _plan(skeleton: bytes) -> Plan:
    plan = _plans.get(skeleton)
    if plan is None:
        plan = compile_plan(skeleton, MAX_DEPTH)
        plan.expect = (MAGIC, FORMAT_VERSION, 0, 0, plan.nbufs, len(skeleton), plan.nvals)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[skeleton] = plan
    return plan


def _check_head(magic: bytes, version: int, cid: int) -> None:
    if magic != MAGIC:
        raise CorruptDataError(f"not a bridgeflow encoding (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise UnsupportedFormatError(f"encoded with format version {version}; this bridgeflow reads "
                                     f"version {FORMAT_VERSION} (upgrade bridgeflow to read it)")
    if cid >= len(CODECS):
        raise UnsupportedFormatError(f"encoded with unknown codec id {cid}; known: {list(CODECS)}")


def _as_bytes_like(buf: Any) -> Any:
    """``bytes``/``bytearray`` as they are (fastest to slice and unpack), anything else as a byte view."""
    if type(buf) is bytes or type(buf) is bytearray:
        return buf
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _decode_parts(b: Any, frames: Sequence[Any] | None, allow_pickle: bool) -> Any:
    """Decode from ``b`` (a whole encoding, or the first frame when ``frames`` is given).

    The hot path of dataset reads: the plan used last is tried first, with one ``unpack_from`` of header,
    skeleton, values and buffer lengths together; anything unexpected takes the checked slow path.
    """
    plan = _last[0]
    try:
        t = plan.full.unpack_from(b)
    except struct.error:
        t = None
    if (t is None or t[9] != plan.key or t[0] != MAGIC or t[1] != FORMAT_VERSION or t[2] or t[5] != len(plan.key)
            or t[4] != plan.nbufs or t[6] != plan.nvals):
        magic, version, cid, _flags, nbuf, skel_len, nvals, heap_len, _total = _HEAD.unpack_from(b)
        if magic != MAGIC or version != FORMAT_VERSION or cid:
            _check_head(magic, version, cid)
            return _decode_pickle(b, frames, allow_pickle, nbuf, skel_len, nvals, heap_len)
        key = bytes(b[32:32 + skel_len])
        plan = _plans.get(key) or _plan(key)
        if plan.nbufs != nbuf or plan.nvals != nvals:
            raise CorruptDataError(f"skeleton needs {plan.nvals} values and {plan.nbufs} buffers; the "
                                   f"header says {nvals} and {nbuf}")
        t = plan.full.unpack_from(b)
        _last[0] = plan
    if frames is None and t[8] != len(b):
        raise CorruptDataError(f"encoding is {len(b)} bytes but its header says {t[8]}")
    hstart = plan.hstart
    end = hstart + t[7]
    nbuf = plan.nbufs
    if frames is not None:
        bufs = _frame_buffers(frames, t[len(t) - nbuf:])
    elif nbuf == 1:
        off = end + (-end % ALIGN)
        end = off + t[-1]
        bufs = [(b, off, t[-1])]
    else:
        bufs = []
        for n in t[len(t) - nbuf:]:
            off = end + (-end % ALIGN)
            end = off + n
            bufs.append((b, off, n))
    if end != len(b):
        raise CorruptDataError(f"encoding is {len(b)} bytes but its header says {end}")
    return plan.build(t, bufs, bytes(b[hstart:end]) if plan.heap else b"")


def _frame_buffers(frames: Sequence[Any], lengths: Sequence[int]) -> list:
    if len(frames) != 1 + len(lengths):
        raise CorruptDataError(f"got {len(frames)} frames; the header announces {1 + len(lengths)}")
    bufs = [(_as_bytes_like(f), 0, n) for f, n in zip(frames[1:], lengths)]
    for f, _, n in bufs:
        if len(f) != n:
            raise CorruptDataError(f"a frame of {len(f)} bytes where the header says {n}")
    return bufs


def _decode_pickle(b: Any, frames: Sequence[Any] | None, allow_pickle: bool, nbuf: int, skel_len: int,
                   nvals: int, heap_len: int) -> Any:
    if not allow_pickle:
        raise PickleNotAllowedError('data written with codec="pickle": pass allow_pickle=True to read it, '
                                    "and only for data you trust (unpickling can run code)")
    if skel_len or nvals:
        raise CorruptDataError("a pickle encoding with a skeleton")
    hstart = 32 + 8 * nbuf
    end = hstart + heap_len
    lengths = struct.unpack_from(f"<{nbuf}Q", b, 32)
    if frames is not None:
        bufs = _frame_buffers(frames, lengths)
    else:
        bufs = []
        for n in lengths:
            off = end + (-end % ALIGN)
            end = off + n
            bufs.append((b, off, n))
    if end != len(b):
        raise CorruptDataError(f"encoding is {len(b)} bytes but its header says {end}")
    return pickle.loads(b[hstart:hstart + heap_len], buffers=[memoryview(f)[o:o + n] for f, o, n in bufs])


def decode(buf: Any, *, allow_pickle: bool = False) -> Any:
    """Decode one buffer made by :func:`encode`; arrays are zero-copy views of ``buf``.

    Anything that is not a valid encoding raises :class:`CorruptDataError` (never another error type);
    an unknown format version or codec raises :class:`UnsupportedFormatError`.
    """
    try:
        if type(buf) is bytearray or type(buf) is bytes:
            plan = _last[0]
            if plan.simple and len(buf) >= plan.hstart:  # the common case, inline: [array, scalars...]
                t = plan.full.unpack_from(buf)
                if t[9] == plan.key and t[:7] == plan.expect:
                    end = plan.hstart + t[7]
                    off = end + (-end % ALIGN)
                    if off + t[-1] == t[8] == len(buf):
                        return plan.build(t, [(buf, off, t[-1])], b"")
            b = buf
        else:
            b = _as_bytes_like(buf)
        if len(b) < 32:
            raise CorruptDataError(f"encoded datapoint too short ({len(b)} bytes) for its header")
        return _decode_parts(b, None, allow_pickle)
    except DECODE_ERRORS:
        raise
    except Exception as exc:  # struct.error, IndexError, UnicodeDecodeError, unhashable keys, ...
        raise CorruptDataError(f"cannot decode datapoint: {type(exc).__name__}: {exc}") from exc


def decode_many(buf: Any, starts: np.ndarray, length: int) -> list | None:
    """Decode the encodings of ``length`` bytes each that lie in ``buf`` (a writable buffer: a block of
    small values read at once) at the offsets ``starts``, as one batch: their headers, skeletons and buffer
    lengths are compared with the first's all at once (it is decoded as :func:`decode` does), then each is
    built from one tuple of its values, its array a view of ``buf`` (or, where ``buf`` would leave arrays
    misaligned for their dtype, of one copy of all their bytes). ``None`` when the batch is not of that
    kind (another skeleton among them, more than one array, strings or other heap data): decode them one by
    one then, which also says what is wrong with a damaged one.
    """
    n = len(starts)
    raw = np.frombuffer(buf, np.uint8)
    if n == 0 or length < 32 or int(starts.max()) + length > len(raw):
        return None
    s0 = int(starts[0])
    first = decode(bytearray(buf[s0:s0 + length]))  # checks it through, and makes its plan the last one
    plan = _last[0]
    if not plan.simple or plan.hstart > length:
        return None
    t0 = plan.full.unpack_from(buf, s0)
    if t0[9] != plan.key or t0[:7] != plan.expect or t0[8] != length:
        return None
    end = plan.hstart + t0[7]
    off = end + (-end % ALIGN)
    size = t0[-1]
    if off + size != length:
        return None
    prefix = _prefixes(raw, starts, plan.hstart)  # header, skeleton, values, buffer length of each
    fixed = np.r_[0:32 + len(plan.key), plan.hstart - 8:plan.hstart]  # all but the values (dims and numbers)
    if not (prefix[:, fixed] == prefix[0, fixed]).all():
        return None
    at = starts + off
    pair = getattr(plan.build, "pair", None)
    if pair is not None:  # [1-d array, number], the usual small datapoint: whole columns at once
        return _vectors_and_values(raw, prefix, at, size, plan, pair)
    base: Any = buf
    align = _alignment(first) or 1
    if align > 1 and ((raw.ctypes.data + at) % align).any():
        base = np.concatenate([raw[a:a + size] for a in at.tolist()])
        at = np.arange(n, dtype=np.int64) * size
    build = plan.build
    return [build(t, [(base, a, size)], b"") for t, a in zip(plan.full.iter_unpack(prefix.tobytes()), at.tolist())]


@functools.lru_cache(maxsize=256)
def _fields(fmt: str) -> list[tuple[int, str]]:
    """``(byte offset, code)`` of each field a ``struct`` format (little-endian, no padding) unpacks."""
    out, at = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z])", fmt.lstrip("<")):
        if code == "s":
            out.append((at, code))
            at += int(count or 1)
            continue
        for _ in range(int(count or 1)):
            out.append((at, code))
            at += struct.calcsize("<" + code)
    return out


def _vectors_and_values(raw: np.ndarray, prefix: np.ndarray, at: np.ndarray, size: int, plan: Plan,
                        pair: tuple) -> list | None:
    """``[vector, number]`` datapoints of a batch (see :func:`decode_many`): the vectors' lengths checked
    and their numbers read as columns of the prefixes, the vectors rows of one array (a view of ``raw``
    where :func:`_rows_of` can give one, else a copy)."""
    dt, dims, value = pair
    fields = _fields(plan.full.format)
    count, rest = divmod(size, dt.itemsize)
    o = fields[dims][0]
    if rest or not (prefix[:, o:o + 8].copy().view("<u8") == count).all():
        return None
    o, code = fields[value]
    numbers = prefix[:, o:o + 8].copy().view("<i8" if code == "q" else "<f8").ravel().tolist()
    vectors = _rows_of(raw, at, size, dt, count)
    return [[v, x] for v, x in zip(list(vectors), numbers)]  # list(): the row views made in C, faster


def _prefixes(raw: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` bytes at each of ``starts`` in ``raw``, one row each: a strided view where the
    starts are evenly spaced at least ``length`` apart (rows laid end to end), else a copy."""
    n = len(starts)
    step = int(starts[1] - starts[0]) if n > 1 else length
    if step >= length and (n < 3 or (np.diff(starts) == step).all()):
        return np.lib.stride_tricks.as_strided(raw[int(starts[0]):], (n, length), (step, 1), writeable=False)
    return raw[starts[:, None] + np.arange(length)]


def _rows_of(raw: np.ndarray, at: np.ndarray, size: int, dt: np.dtype, count: int) -> np.ndarray:
    """The ``count`` items of ``dt`` at each of ``at`` in ``raw``, one row each: a view of ``raw`` where the
    rows lie evenly spaced and aligned for ``dt`` in writable memory (rows gathered end to end, as a batch
    of LMDB values is), else a copy (:func:`_gather`)."""
    n = len(at)
    step = int(at[1] - at[0]) if n > 1 else size
    if raw.flags.writeable and step >= size and step % dt.alignment == 0 and \
            (raw.ctypes.data + int(at[0])) % dt.alignment == 0 and (n < 3 or (np.diff(at) == step).all()):
        rows = np.lib.stride_tricks.as_strided(raw[int(at[0]):], (n, size), (step, 1))
        return rows.view(dt)
    return _gather(raw, at, size).view(dt).reshape(n, count)


def _gather(raw: np.ndarray, at: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` bytes at each of ``at`` in ``raw``, copied end to end (one strided copy when they lie
    evenly spaced, as rows do)."""
    n = len(at)
    step = int(at[1] - at[0]) if n > 1 else size
    if n > 1 and step >= size and (np.diff(at) == step).all():
        first = int(at[0])
        return np.lib.stride_tricks.as_strided(raw[first:], (n, size), (step, 1)).reshape(n * size)
    return np.concatenate([raw[a:a + size] for a in at.tolist()])


def _alignment(dp: Any) -> int:
    """The alignment the first array in ``dp`` needs (1 without one)."""
    if isinstance(dp, np.ndarray):
        return dp.dtype.alignment
    values = dp.values() if isinstance(dp, dict) else dp if isinstance(dp, (list, tuple)) else ()
    for v in values:
        found = _alignment(v)
        if found:
            return found
    return 0


def decode_frames(frames: Sequence[Any], *, allow_pickle: bool = False) -> Any:
    """Decode frames made by :func:`encode_frames`; arrays are zero-copy views of the frames."""
    try:
        if not frames:
            raise CorruptDataError("no frames to decode")
        head = _as_bytes_like(frames[0])
        if len(head) < 32:
            raise CorruptDataError(f"first frame too short ({len(head)} bytes) for a header")
        return _decode_parts(head, frames, allow_pickle)
    except DECODE_ERRORS:
        raise
    except Exception as exc:
        raise CorruptDataError(f"cannot decode frames: {type(exc).__name__}: {exc}") from exc


def buffer_spans(buf: Any) -> tuple[int, list[tuple[int, int]]]:
    """Where the parts of an encoding lie: ``(head, spans)``, the length of its head (header, skeleton, values,
    table and heap: the first frame :func:`decode_frames` takes) and the ``(offset, length)`` of each raw buffer
    in it. Reads the header and the table only: ``buf`` may be the encoding's first bytes, up to its first
    buffer. A header that is not bridgeflow's, or parts that do not add up to its length, raise
    :class:`CorruptDataError`."""
    b = _as_bytes_like(buf)
    try:
        magic, version, cid, _flags, nbuf, skel_len, nvals, heap_len, total = _HEAD.unpack_from(b)
        _check_head(magic, version, cid)
        table = HEAD_SIZE + skel_len + 8 * nvals
        if table + 8 * nbuf > len(b):
            raise CorruptDataError(f"the table of {nbuf} buffers runs past the {len(b)} bytes given")
        lengths = struct.unpack_from(f"<{nbuf}Q", b, table)
    except struct.error as exc:
        raise CorruptDataError(f"cannot read the header: {exc}") from exc
    end = head = table + 8 * nbuf + heap_len
    spans = []
    for n in lengths:
        off = end + (-end % ALIGN)
        spans.append((off, n))
        end = off + n
    if end != total:
        raise CorruptDataError(f"encoding's header says {total} bytes, its parts {end}")
    return head, spans


def peek_codec(buf: Any) -> tuple[str, int]:
    """``(codec name, format version)`` of an encoded buffer, without decoding it."""
    try:
        magic, version, cid, *_ = _HEAD.unpack_from(_as_bytes_like(buf))
    except Exception as exc:
        raise CorruptDataError(f"cannot read the header: {type(exc).__name__}: {exc}") from exc
    _check_head(magic, version, cid)
    return CODECS[cid], version
