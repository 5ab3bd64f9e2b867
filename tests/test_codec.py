"""The datapoint codec: exact round trips, zero-copy views, and only CorruptDataError on bad bytes."""

from __future__ import annotations

import collections
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bridgeflow._codec import (
    FORMAT_VERSION,
    decode,
    decode_frames,
    encode,
    encode_frames,
    peek_codec,
)
from bridgeflow._errors import BridgeflowError
from bridgeflow.serialize import (
    CorruptDataError,
    EncodeError,
    PickleNotAllowedError,
    UnsupportedFormatError,
)

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", ">i4", ">f8", "M8[ns]", "m8[s]",
          "S3", "U2"]


def same(a, b):
    """Exact equality including container types, dtypes, shapes and Python scalar types."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.dtype.str == b.dtype.str and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def roundtrips(obj):
    same(obj, decode(encode(obj)))
    same(obj, decode_frames(encode_frames(obj)))
    same(obj, decode(encode(obj, codec="pickle"), allow_pickle=True))


arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
           | st.text(max_size=20) | st.binary(max_size=1500))
leaves = scalars | arrays
trees = st.recursive(leaves, lambda kids: st.lists(kids, max_size=4) | st.tuples(kids, kids)
                     | st.dictionaries(st.text(max_size=5) | st.integers(), kids, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_roundtrip_property(obj):
    roundtrips(obj)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_zero_d_empty_and_noncontiguous(dtype):
    base = np.arange(24).reshape(2, 3, 4).astype(dtype)
    for arr in (base, base[:, ::2], base.T, np.asfortranarray(base), base[0, 0, 0].copy().reshape(()),
                np.zeros((0, 3), dtype), np.zeros((4, 0, 2), dtype)):
        out = decode(encode([arr]))[0]
        same(np.ascontiguousarray(arr) if not arr.flags.f_contiguous else arr, out)
        np.testing.assert_array_equal(arr, out)


def test_fortran_order_is_kept_and_numpy_scalars_keep_their_type():
    f = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    out = decode(encode(f))
    assert out.flags.f_contiguous and not out.flags.c_contiguous
    for s in (np.float64(1.5), np.int8(-3), np.bool_(True), np.uint64(2**64 - 1), np.str_("ab")):
        got = decode(encode(s))
        assert type(got) is type(s) and got == s


def test_python_scalars_and_containers_exactly():
    obj = {"i": [0, -1, 2**63 - 1, -(2**63), 2**200, -(2**90)], "f": (0.0, -0.0, float("inf"), 1e-300),
           "b": [True, False, None], "s": ["", "héllo \U0001f600", "\ud800"], "y": [b"", b"\x00" * 5000],
           3: {"nested": [[[]]]}, (1, "k"): ()}
    roundtrips(obj)
    out = decode(encode(obj))
    assert type(out["i"][2]) is int and type(out["b"][0]) is bool and str(out["f"][1]) == "-0.0"


def test_subclasses_stored_as_base_types():
    Point = collections.namedtuple("Point", "x y")
    out = decode(encode([Point(1, 2), collections.OrderedDict(a=1)]))
    assert out == [(1, 2), {"a": 1}] and type(out[0]) is tuple and type(out[1]) is dict


def test_arrays_are_views_writable_iff_buffer_is():
    arr = np.arange(1000, dtype=np.int32)
    buf = bytearray(encode([arr, 1]))
    out = decode(buf)[0]
    assert out.flags.writeable and np.shares_memory(out, np.frombuffer(buf, np.uint8))
    out[0] = 7
    assert decode(buf)[0][0] == 7  # a view, not a copy
    ro = decode(bytes(buf))[0]
    assert not ro.flags.writeable
    assert out.ctypes.data % 16 == np.frombuffer(buf, np.uint8).ctypes.data % 16  # aligned in the buffer


def test_frames_keep_arrays_separate_and_uncopied():
    arr = np.arange(10000, dtype=np.float64)
    frames = encode_frames({"x": arr, "y": "label"})
    assert len(frames) == 2 and len(frames[0]) < 200
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), arr)
    out = decode_frames([bytes(f) for f in frames])
    same({"x": arr, "y": "label"}, out)


def test_unsupported_objects_name_the_component():
    with pytest.raises(EncodeError, match=r"\[1\]\['k'\]"):
        encode([1, {"k": object()}])
    with pytest.raises(EncodeError, match="object"):
        encode([np.array([object()])])
    with pytest.raises(TypeError):  # EncodeError is a TypeError too
        encode({1.5j})
    with pytest.raises(ValueError, match="unknown codec"):
        encode(1, codec="json")


def test_pickle_needs_both_sides():
    buf = encode({"s": {1, 2}}, codec="pickle")
    assert peek_codec(buf) == ("pickle", FORMAT_VERSION)
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        decode(buf)
    assert decode(buf, allow_pickle=True) == {"s": {1, 2}}
    with pytest.raises(PickleNotAllowedError):
        decode_frames(encode_frames([1], codec="pickle"))


def test_unknown_version_and_codec_are_clear():
    buf = bytearray(encode([1]))
    buf[4] = FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError, match="version"):
        decode(buf)
    buf[4], buf[5] = FORMAT_VERSION, 9
    with pytest.raises(UnsupportedFormatError, match="codec"):
        decode(buf)


def test_truncation_and_trailing_bytes():
    buf = encode([np.arange(100, dtype=np.int16), "abc", 5])
    for cut in range(0, len(buf), 7):
        with pytest.raises(CorruptDataError):
            decode(buf[:cut])
    with pytest.raises(CorruptDataError):
        decode(buf + b"\x00")
    frames = encode_frames([np.arange(4)])
    with pytest.raises(CorruptDataError):
        decode_frames(frames[:1])
    with pytest.raises(CorruptDataError):
        decode_frames([frames[0], b"\x00" * 3])
    with pytest.raises(CorruptDataError):
        decode_frames([])


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_corrupt_data(data):
    with pytest.raises(CorruptDataError):
        decode(data)
    with pytest.raises(CorruptDataError):
        decode_frames([data])


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([0, 1]))
def test_random_bytes_behind_a_valid_magic_raise_only_library_errors(tail, cid):
    """Random strings that pass the magic/version check reach the header, skeleton, table and heap parsers
    (never unpickled: random bytes are not fed to pickle)."""
    buf = b"\x93BFC" + bytes([FORMAT_VERSION, cid]) + tail
    for call in (lambda: decode(buf), lambda: decode_frames([buf, tail[:9]])):
        try:
            call()
        except (CorruptDataError, PickleNotAllowedError):
            pass


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees, st.binary(max_size=400), st.integers(0, 400))
def test_real_skeletons_over_random_values_raise_only_corrupt_data(obj, body, heap_len):
    """A valid header and skeleton (so the plan compiles) followed by random values, buffer lengths, heap
    and buffers, the header's lengths made consistent: every array shape, heap range and buffer length is
    checked against what is there; nothing else escapes."""
    valid = encode(obj)
    skel_len = struct.unpack_from("<I", valid, 12)[0]
    head = bytearray(valid[:32])
    struct.pack_into("<IQ", head, 20, heap_len, 32 + skel_len + len(body))
    try:
        decode(bytes(head) + valid[32:32 + skel_len] + body)
    except CorruptDataError:
        pass


VALID = encode([np.arange(6, dtype=np.float32).reshape(2, 3), 7, "name", {"k": (b"v", None, 2.5)},
                np.int16(3), 2**70])


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, len(VALID)))
def test_mutated_encodings_raise_only_library_errors(flips, cut):
    buf = bytearray(VALID)
    for pos, value in flips:
        buf[pos] = value
    for candidate in (bytes(buf), bytes(buf[:cut])):
        try:
            decode(candidate)
        except BridgeflowError as exc:
            assert isinstance(exc, ValueError)
        # a flip inside array bytes or a value decodes to other values; that is fine


def test_header_fields_mutated_one_by_one():
    buf = encode([np.arange(3), "x"])
    for i in range(32):
        for v in (0, 1, 0x7F, 0xFF):
            b = bytearray(buf)
            b[i] = v
            try:
                decode(bytes(b))
            except (CorruptDataError, UnsupportedFormatError, PickleNotAllowedError):
                pass


def test_deep_nesting_refused_on_both_sides():
    deep: list = []
    node = deep
    for _ in range(70):
        node.append([])
        node = node[0]
    with pytest.raises(EncodeError, match="deeper"):
        encode(deep)
    skel = b"l\x01\x00\x00\x00" * 100 + b"N"
    head = struct.pack("<4sBBHIIIIQ", b"\x93BFC", FORMAT_VERSION, 0, 0, 0, len(skel), 0, 0, 32 + len(skel))
    with pytest.raises(CorruptDataError, match="deeper"):
        decode(head + skel)
