"""Batching: stacking rules, padding, dict datapoints, bad input, BatchDataByShape, UnbatchData."""

from __future__ import annotations

import numpy as np
import pytest

from bridgeflow import (
    BatchData,
    BatchDataByShape,
    BatchError,
    DataFromList,
    DatapointError,
    LengthUnknownError,
    UnbatchData,
    batch_datapoints,
)
from bridgeflow.testing import check_dataflow

KINDS = ["list", "tuple", "dict"]
KEYS = ("img", "label", "name")


def make(kind: str, i: int):
    parts = (np.full((2, 3), i, dtype=np.uint8), i, f"n{i}")
    if kind == "dict":
        return dict(zip(KEYS, parts))
    return tuple(parts) if kind == "tuple" else list(parts)


def source(kind: str, n: int = 10) -> DataFromList:
    return DataFromList([make(kind, i) for i in range(n)], shuffle=False)


def col(batch, kind, j):
    return batch[KEYS[j]] if kind == "dict" else batch[j]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("remainder", [False, True])
def test_batch_data(kind, remainder):
    df = BatchData(source(kind), 4, remainder=remainder)
    got = check_dataflow(df, deterministic=True)
    assert len(df) == len(got) == (3 if remainder else 2)
    b = got[1]
    assert type(b) is type(make(kind, 0))
    img, label, name = (col(b, kind, j) for j in range(3))
    assert img.shape == (4, 2, 3) and img.dtype == np.uint8 and img[2, 0, 0] == 6
    assert label.dtype == np.int64 and label.tolist() == [4, 5, 6, 7]
    assert name == ["n4", "n5", "n6", "n7"]
    if remainder:
        assert col(got[2], kind, 1).tolist() == [8, 9]


@pytest.mark.parametrize("size", [0, -3, True, 2.0, "4", None])
def test_bad_batch_size(size):
    for cls in (BatchData, lambda ds, bs: BatchDataByShape(ds, bs, 0)):
        with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got " + repr(size)[:2]):
            cls(source("list"), size)


def test_numpy_integer_batch_size_is_fine():
    assert len(list(BatchData(source("list"), np.int64(5)))) == 2


@pytest.mark.parametrize("values, dtype", [
    ([1, 2, 3], np.int64),
    ([1.5, 2.0, 3.0], np.float64),
    ([True, False, True], np.bool_),
    ([np.float32(1), np.float32(2), np.float32(3)], np.float32),
    ([np.uint8(1), np.uint8(2), np.uint8(255)], np.uint8),
    ([np.int16(-1), np.int16(2), np.int16(3)], np.int16),
    ([np.bool_(True), np.bool_(False), np.bool_(True)], np.bool_),
    ([1, 2.5, 3], np.float64),
    ([1 + 2j, 3, 4], np.complex128),
])
def test_number_dtypes(values, dtype):
    (out,) = batch_datapoints([[v] for v in values])
    assert isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == (3,)
    assert out.tolist() == [dtype(v).item() if dtype is not np.bool_ else bool(v) for v in values]


@pytest.mark.parametrize("values", [
    ["a", "bc", ""],
    [b"x", b"yz", b""],
    [None, {"k": 1}, object()],
    [[1, 2], [3], []],
])
def test_non_numbers_stay_lists(values):
    (out,) = batch_datapoints([[v] for v in values])
    assert type(out) is list and len(out) == 3 and all(a is b for a, b in zip(out, values))


def test_zero_dim_arrays_stack():
    (out,) = batch_datapoints([[np.array(i, np.float16)] for i in range(3)])
    assert out.shape == (3,) and out.dtype == np.float16


@pytest.mark.parametrize("values", [[1, "a"], ["a", 1], [2.0, b"x"], [b"x", 3], [np.int8(1), "a"]])
def test_mixing_numbers_and_strings(values):
    with pytest.raises(BatchError, match="component 1: .*mixed"):
        batch_datapoints([[0, v] for v in values])
    assert batch_datapoints([[0, v] for v in values], use_list=True)[1] == values


def test_arrays_mixed_with_other_things():
    with pytest.raises(BatchError, match=r"component 0: mixes arrays with \['int', 'ndarray'\]"):
        batch_datapoints([[np.zeros(2)], [5]])


def test_ragged_arrays_name_the_component_and_shapes():
    dps = [{"img": np.zeros((2, 3)), "y": 1}, {"img": np.zeros((2, 3)), "y": 2}, {"img": np.zeros((4, 3)), "y": 3}]
    with pytest.raises(BatchError, match=r"component 'img': .*shapes seen: \(2, 3\) x2, \(4, 3\) x1.*pad_value"):
        batch_datapoints(dps)
    with pytest.raises(BatchError, match=r"component 'img'"):
        list(BatchData(DataFromList(dps, shuffle=False), 3))


@pytest.mark.parametrize("dtype, pad", [(np.uint8, 7), (np.float32, -1.5), (np.int64, -1), (np.bool_, True)])
def test_pad_value(dtype, pad):
    arrays = [np.ones((1, 2), dtype), np.ones((3, 1), dtype), np.ones((2, 2), dtype)]
    (out,) = batch_datapoints([[a] for a in arrays], pad_value=pad)
    assert out.shape == (3, 3, 2) and out.dtype == dtype
    expect = np.full((3, 3, 2), pad, dtype)
    for i, a in enumerate(arrays):
        expect[i, : a.shape[0], : a.shape[1]] = a
    np.testing.assert_array_equal(out, expect)


def test_pad_more_than_64_arrays():
    arrays = [np.arange(i % 5 + 1, dtype=np.int32) for i in range(130)]
    out = batch_datapoints([{"v": a} for a in arrays], pad_value=-1)["v"]
    assert out.shape == (130, 5) and out.dtype == np.int32
    assert out[0].tolist() == [0, -1, -1, -1, -1] and out[4].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("dtype, pad", [(np.uint8, -1), (np.uint8, 0.5), (np.int32, float("nan")), (np.uint8, 300)])
def test_pad_value_that_does_not_fit(dtype, pad):
    arrays = [np.ones(1, dtype), np.ones(2, dtype)]
    with pytest.raises(BatchError, match=f"component 0: pad_value {pad!r} does not fit .* {np.dtype(dtype)}"):
        batch_datapoints([[a] for a in arrays], pad_value=pad)


def test_pad_different_ranks():
    with pytest.raises(BatchError, match=r"different ranks \(\[1, 2\]\)"):
        batch_datapoints([[np.ones(2)], [np.ones((2, 2))]], pad_value=0)


def test_pad_through_batch_data():
    dps = [[np.arange(n, dtype=np.float32)] for n in (1, 3, 2, 2)]
    (b1,), (b2,) = BatchData(DataFromList(dps, shuffle=False), 2, pad_value=0.0)
    assert b1.tolist() == [[0, 0, 0], [0, 1, 2]] and b2.shape == (2, 2)


def test_dict_missing_key_names_key_and_position():
    dps = [{"a": 1, "b": 2}, {"a": 1, "b": 2}, {"a": 1, "c": 2}]
    with pytest.raises(DatapointError,
                       match=r"datapoint 2: component 'b' is missing; the datapoint has keys \['a', 'c'\]"):
        batch_datapoints(dps)
    with pytest.raises(DatapointError, match=r"datapoint 1 of the batch differs in keys.*missing \['b'\], extra \[\]"):
        batch_datapoints([{"a": 1, "b": 2}, {"a": 3}])
    with pytest.raises(DatapointError, match=r"missing \[\], extra \['z'\]"):
        batch_datapoints([{"a": 1}, {"a": 3, "z": 0}])
    with pytest.raises(DatapointError, match="datapoint 1 is a list in a batch of dicts"):
        batch_datapoints([{"a": 1}, [3]])


def test_list_length_mismatch_and_non_datapoints():
    with pytest.raises(DatapointError, match="datapoint 1 of the batch has 1 components, the first has 2"):
        batch_datapoints([[1, 2], [3]])
    with pytest.raises(DatapointError, match="BatchData input produced a int"):
        batch_datapoints([5, 6])
    with pytest.raises(DatapointError, match="datapoint 2 is a int in a batch of lists"):
        batch_datapoints([[1], [2], 3])
    with pytest.raises(DatapointError, match="datapoint 1 is a str in a batch of tuples"):
        batch_datapoints([("ab",), "ab"])  # a string has a len() too: it must not be batched as characters
    with pytest.raises(DatapointError, match="datapoint 1 is a dict in a batch of lists"):
        list(BatchData(DataFromList([[1], {"a": 1}], shuffle=False), 2))
    with pytest.raises(BatchError, match="empty"):
        batch_datapoints([])


def test_use_list():
    dps = [make("dict", i) for i in range(3)]
    out = batch_datapoints(dps, use_list=True)
    assert all(type(v) is list for v in out.values())
    out = batch_datapoints(dps, use_list=["img"])
    assert type(out["img"]) is list and out["label"].dtype == np.int64
    out = batch_datapoints([make("tuple", i) for i in range(3)], use_list={0})
    assert type(out) is tuple and type(out[0]) is list and isinstance(out[1], np.ndarray)


@pytest.mark.parametrize("kind", KINDS)
def test_batch_data_by_shape(kind):
    dps = []
    for i in range(11):
        d = make(kind, i)
        side = 2 + i % 2
        img = np.full((side, side), i, np.uint8)
        d = {**d, "img": img} if kind == "dict" else type(d)([img, *list(d)[1:]])
        dps.append(d)
    idx = "img" if kind == "dict" else 0
    df = BatchDataByShape(DataFromList(dps, shuffle=False), 3, idx)
    got = check_dataflow(df, deterministic=True)
    assert [col(b, kind, 0).shape for b in got] == [(3, 2, 2), (3, 3, 3), (3, 2, 2)]
    assert col(got[1], kind, 1).tolist() == [1, 3, 5]
    with pytest.raises(LengthUnknownError, match="BatchDataByShape"):
        len(df)
    rest = list(BatchDataByShape(DataFromList(dps, shuffle=False), 3, idx, remainder=True))
    assert sorted(len(col(b, kind, 1)) for b in rest) == [2, 3, 3, 3]
    assert sum(len(col(b, kind, 1)) for b in rest) == 11


@pytest.mark.parametrize("kind", KINDS)
def test_unbatch_inverts_batch(kind):
    src = [make(kind, i) for i in range(10)]
    batched = BatchData(DataFromList(src, shuffle=False), 4, remainder=True)
    got = check_dataflow(UnbatchData(batched), deterministic=True)
    assert len(got) == 10
    for a, b in zip(got, src):
        assert type(a) is type(b)
        for j in range(3):
            x, y = col(a, kind, j), col(b, kind, j)
            if isinstance(y, np.ndarray):
                np.testing.assert_array_equal(x, y)
                assert x.dtype == y.dtype
            else:
                assert x == y
    with pytest.raises(LengthUnknownError, match="UnbatchData"):
        len(UnbatchData(batched))


def test_unbatch_bad_batches():
    with pytest.raises(BatchError, match="differ in length"):
        list(UnbatchData(DataFromList([[np.zeros(3), [1, 2]]], shuffle=False)))
    with pytest.raises(DatapointError, match="UnbatchData input produced a int"):
        list(UnbatchData(DataFromList([3], shuffle=False)))


@pytest.mark.parametrize("batch, named", [
    ([np.zeros(3), 5], r"component 1 is a int \(5\), not a batch"),
    ({"img": np.zeros(3), "name": "xyz"}, r"component 'name' is a str \('xyz'\), not a batch"),
    ({"img": np.zeros(3), "w": np.float32(1)}, r"component 'w' is a float32"),
    ((np.zeros(3), np.array(2.0)), r"component 1 is a ndarray \(array\(2\.\)\), not a batch"),
])
def test_unbatch_refuses_components_that_are_not_batches(batch, named):
    """A string must not be split into characters, nor a scalar fail with a bare TypeError."""
    with pytest.raises(BatchError, match=named):
        list(UnbatchData(DataFromList([batch], shuffle=False)))
