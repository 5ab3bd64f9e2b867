"""Compile a codec skeleton into a decoding plan: a tree of small closures, built once per skeleton.

The skeleton comes from untrusted bytes, so compiling it validates everything that does not vary between
datapoints (tags, container sizes, dtypes, ranks, nesting depth); the closures check what does (array
sizes against their buffers, heap ranges). No code is generated from the data: closures only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from ._serialize_errors import CorruptDataError

__all__ = ["ARRAY_KINDS", "BASE", "HEADER", "Plan", "T", "compile_plan"]

ARRAY_KINDS = frozenset("biufcmMSU")

# build(values, buffers, heap): buffers are (base, offset, length) triples, so arrays are made with
# np.frombuffer(base, dtype, count, offset) without slicing memoryviews (the hot path).
Build = Callable[[tuple, list, bytes], Any]


class T:
    """Skeleton tags (one byte each)."""

    NONE, TRUE, FALSE, INT, BIGINT, FLOAT = b"N", b"T", b"F", b"i", b"I", b"f"
    STR, BYTES, BIGBYTES, LIST, TUPLE, DICT = b"s", b"b", b"B", b"l", b"t", b"d"
    ARRAY, SCALAR = b"a", b"g"


HEADER = "<4sBBHIIIIQ"  # the codec header (32 bytes)
BASE = 10  # index of the first value in ``Plan.full.unpack_from(encoding)``: 9 header fields + skeleton


class Plan:
    """How to decode one skeleton.

    ``full`` unpacks a whole encoding prefix at once: the 9 header fields, the skeleton bytes (index 9),
    the values (from index ``BASE``) and the buffer lengths (the last ``nbufs`` items); ``hstart`` is
    where the heap starts. Builders index that tuple directly.
    """

    __slots__ = ("build", "expect", "full", "heap", "hstart", "key", "nbufs", "nvals", "simple")

    def __init__(self, key: bytes, nvals: int, nbufs: int, fmt: str, heap: bool, build: Build) -> None:
        self.key, self.nvals, self.nbufs, self.heap, self.build = key, nvals, nbufs, heap, build
        self.full = struct.Struct(f"{HEADER}{len(key)}s{fmt}{'Q' * nbufs}")
        self.hstart = self.full.size
        self.simple = nbufs == 1 and not heap  # one array, no heap: the codec's fastest path
        self.expect: tuple = ()  # the first 7 header fields of a native encoding (set by the codec)


_U32 = struct.Struct("<I")
_dtypes: dict[bytes, np.dtype] = {}


def _dtype(code: bytes) -> np.dtype:
    dt = _dtypes.get(code)
    if dt is None:
        try:
            dt = np.dtype(code.decode("ascii"))
        except Exception as exc:
            raise CorruptDataError(f"bad dtype code {code[:40]!r}") from exc
        if (dt.kind not in ARRAY_KINDS or dt.fields is not None or dt.subdtype is not None
                or dt.itemsize == 0 or dt.str.encode("ascii") != code):
            raise CorruptDataError(f"dtype {code[:40]!r} is not one the bridgeflow codec writes")
        if len(_dtypes) < 512:
            _dtypes[code] = dt
    return dt


def _heap_slice(h: bytes, off: int, n: int) -> bytes:
    raw = h[off:off + n]
    if len(raw) != n:
        raise CorruptDataError(f"heap range {off}+{n} runs past the end of the structure ({len(h)} bytes)")
    return raw


def _const(value: Any) -> Build:
    return lambda v, b, h: value


def _value(i: int) -> Build:
    return lambda v, b, h: v[i]


def _blob(tag: int, i: int) -> Build:
    if tag == 0x73:  # str
        return lambda v, b, h: _heap_slice(h, v[i], v[i + 1]).decode("utf-8", "surrogatepass")
    if tag == 0x62:  # small bytes
        return lambda v, b, h: bytes(_heap_slice(h, v[i], v[i + 1]))
    return lambda v, b, h: int.from_bytes(_heap_slice(h, v[i], v[i + 1]), "little", signed=True)


def _scalar(dt: np.dtype, i: int) -> Build:
    n = dt.itemsize
    return lambda v, b, h: np.frombuffer(_heap_slice(h, v[i], n), dt, 1)[0]


def _array(dt: np.dtype, fortran: bool, ndim: int, i: int, k: int) -> Build:
    item = dt.itemsize
    frombuffer = np.frombuffer

    def bad(n: int, shape: tuple) -> CorruptDataError:
        return CorruptDataError(f"array of shape {shape} and dtype {dt} does not match its {n}-byte buffer")

    if ndim == 1:
        def build1(v: tuple, b: list, h: bytes) -> np.ndarray:
            base, off, size = b[k]
            n = v[i]
            if n * item != size:
                raise bad(size, (n,))
            return frombuffer(base, dt, n, off)
        build1.vector = (dt, i, k, bad)  # type: ignore[attr-defined]  # a function attribute: lets [vector, label] lists fuse
        return build1

    def build(v: tuple, b: list, h: bytes) -> np.ndarray:
        base, off, size = b[k]
        shape = v[i:i + ndim]
        count = 1
        for d in shape:
            count *= d
        if count * item != size:
            raise bad(size, shape)
        arr = frombuffer(base, dt, count, off)
        return arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)
    return build


def _sequence(children: list[Build], as_tuple: bool, value_at: list[int | None]) -> Build:
    if len(children) == 2 and not as_tuple:
        c0, c1 = children
        i0, i1 = value_at
        spec = getattr(c0, "vector", None)
        if i1 is not None and spec is not None:  # [1-d array, number]: fused, one call per datapoint
            dt, i, k, bad = spec
            item, frombuffer = dt.itemsize, np.frombuffer

            def vector_and_value(v: tuple, b: list, h: bytes) -> list:
                base, off, size = b[k]
                n = v[i]
                if n * item != size:
                    raise bad(size, (n,))
                return [frombuffer(base, dt, n, off), v[i1]]
            vector_and_value.pair = (dt, i, i1)  # type: ignore[attr-defined]  # a function attribute: lets a batch of
            # them be decoded with numpy (codec.decode_many)
            return vector_and_value
        if i1 is not None and i0 is None:  # [array, label]: the most common datapoint
            return lambda v, b, h: [c0(v, b, h), v[i1]]
        return lambda v, b, h: [c0(v, b, h), c1(v, b, h)]
    if as_tuple:
        return lambda v, b, h: tuple([c(v, b, h) for c in children])
    return lambda v, b, h: [c(v, b, h) for c in children]


def _dict(pairs: list[tuple[Build, Build]]) -> Build:
    return lambda v, b, h: {k(v, b, h): x(v, b, h) for k, x in pairs}


class _Compiler:
    def __init__(self, skel: bytes, max_depth: int) -> None:
        self.s = skel
        self.pos = 0
        self.fmt: list[str] = []
        self.nbufs = 0
        self.nvals = 0
        self.heap = False
        self.max_depth = max_depth

    def _take_value(self, code: str, heap: bool = False) -> int:
        self.heap = self.heap or heap
        i = BASE + self.nvals
        self.fmt.append(code)
        self.nvals += len(code)
        return i

    def _code(self) -> np.dtype:
        n = self.s[self.pos]
        code = self.s[self.pos + 1:self.pos + 1 + n]
        if len(code) != n:
            raise CorruptDataError("dtype code runs past the end of the skeleton")
        self.pos += 1 + n
        return _dtype(code)

    def node(self, depth: int) -> Build:
        s = self.s
        if depth > self.max_depth:
            raise CorruptDataError(f"structure nested deeper than {self.max_depth} levels")
        tag = s[self.pos]
        self.pos += 1
        if tag == 0x61:  # array
            dt = self._code()
            fortran, ndim = s[self.pos], s[self.pos + 1]
            self.pos += 2
            if fortran > 1 or ndim > 64:
                raise CorruptDataError(f"bad array order {fortran} or rank {ndim}")
            k, self.nbufs = self.nbufs, self.nbufs + 1
            return _array(dt, bool(fortran), ndim, self._take_value("Q" * ndim), k)
        if tag in (0x69, 0x66):  # int, float
            return _value(self._take_value("q" if tag == 0x69 else "d"))
        if tag in (0x6C, 0x74, 0x64):  # list, tuple, dict
            n = _U32.unpack_from(s, self.pos)[0]
            self.pos += 4
            per = 2 if tag == 0x64 else 1
            if n * per > len(s) - self.pos:
                raise CorruptDataError(f"container of {n} items longer than its skeleton")
            if tag == 0x64:
                return _dict([(self.node(depth + 1), self.node(depth + 1)) for _ in range(n)])
            kids, value_at = [], []
            for _ in range(n):
                first = BASE + self.nvals
                kind = s[self.pos] if self.pos < len(s) else -1
                kids.append(self.node(depth + 1))
                value_at.append(first if kind in (0x69, 0x66) else None)
            return _sequence(kids, tag == 0x74, value_at)
        if tag in (0x73, 0x62, 0x49):  # str, bytes, big int
            return _blob(tag, self._take_value("QQ", heap=True))
        if tag == 0x42:  # big bytes in a buffer
            k, self.nbufs = self.nbufs, self.nbufs + 1
            def big_bytes(v: tuple, b: list, h: bytes) -> bytes:
                base, off, size = b[k]
                return bytes(base[off:off + size])
            return big_bytes
        if tag == 0x67:  # numpy scalar
            return _scalar(self._code(), self._take_value("Q", heap=True))
        if tag == 0x4E:
            return _const(None)
        if tag == 0x54:
            return _const(True)
        if tag == 0x46:
            return _const(False)
        raise CorruptDataError(f"unknown tag {tag:#04x} at byte {self.pos - 1} of the skeleton")


def compile_plan(skeleton: bytes, max_depth: int) -> Plan:
    """Validate ``skeleton`` and build its plan; raises :class:`CorruptDataError` (or IndexError/struct.error
    on truncation, which the codec wraps)."""
    c = _Compiler(skeleton, max_depth)
    build = c.node(0)
    if c.pos != len(skeleton):
        raise CorruptDataError(f"{len(skeleton) - c.pos} stray bytes after the skeleton")
    return Plan(bytes(skeleton), c.nvals, c.nbufs, "".join(c.fmt), c.heap, build)
