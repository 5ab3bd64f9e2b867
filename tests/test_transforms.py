"""Per-datapoint transforms, each with list, tuple and dict datapoints."""

from __future__ import annotations

import itertools
import logging
import pickle

import numpy as np
import pytest

from bridgeflow import (
    CacheData,
    DataFlow,
    DataFromList,
    DatapointError,
    FilterData,
    FixedSizeData,
    LengthUnknownError,
    MapData,
    MapDataComponent,
    PrintData,
    RepeatedData,
    SelectComponent,
)
from bridgeflow._transforms import describe_datapoint
from bridgeflow.testing import check_dataflow

KINDS = ["list", "tuple", "dict"]
KEY = {"list": (0, 1, 2), "tuple": (0, 1, 2), "dict": ("img", "label", "name")}


def make(kind: str, i: int):
    parts = (np.full((2, 3), i, dtype=np.uint8), i, f"n{i}")
    if kind == "dict":
        return dict(zip(KEY["dict"], parts))
    return tuple(parts) if kind == "tuple" else list(parts)


def source(kind: str, n: int = 10) -> DataFromList:
    return DataFromList([make(kind, i) for i in range(n)], shuffle=False)


def label(dp, kind):
    return dp[KEY[kind][1]]


class CountingSource(DataFlow):
    def __init__(self, kind, n=5):
        self.kind, self.n, self.epochs = kind, n, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        self.epochs += 1
        for i in range(self.n):
            yield make(self.kind, i)


@pytest.mark.parametrize("kind", KINDS)
def test_map_data(kind):
    def plus_one(dp):
        k = KEY[kind][1]
        if isinstance(dp, dict):
            return {**dp, k: dp[k] + 1}
        out = list(dp)
        out[k] += 1
        return type(dp)(out)

    got = check_dataflow(MapData(source(kind), plus_one), deterministic=True)
    assert [label(dp, kind) for dp in got] == list(range(1, 11))
    assert all(type(dp) is type(make(kind, 0)) for dp in got)


@pytest.mark.parametrize("kind", KINDS)
def test_map_data_none_drops(kind):
    df = MapData(source(kind), lambda dp: dp if label(dp, kind) % 2 else None)
    got = list(df)
    assert [label(dp, kind) for dp in got] == [1, 3, 5, 7, 9]
    assert len(df) == 10  # like tensorpack: the source's length


def test_map_data_wrong_structure_names_the_function():
    def to_int(dp):
        return dp[1]

    with pytest.raises(DatapointError, match=r"MapData function .*to_int produced a int \(0\)"):
        list(MapData(source("list"), to_int))
    with pytest.raises(DatapointError, match="ndarray"):
        list(MapData(source("list"), lambda dp: dp[0]))
    with pytest.raises(TypeError, match="callable"):
        MapData(source("list"), 3)


@pytest.mark.parametrize("kind", KINDS)
def test_map_data_component(kind):
    k = KEY[kind][0]
    got = check_dataflow(MapDataComponent(source(kind), lambda a: a.astype(np.float32) * 2, k),
                         deterministic=True)
    assert all(dp[k].dtype == np.float32 for dp in got)
    assert got[3][k][0, 0] == 6
    assert all(type(dp) is type(make(kind, 0)) for dp in got)
    src = source(kind)
    list(MapDataComponent(src, lambda a: a * 0, k))
    assert src.lst[3][k][0, 0] == 3  # the input datapoints are not modified


@pytest.mark.parametrize("kind", KINDS)
def test_map_data_component_none_drops(kind):
    k = KEY[kind][1]
    got = list(MapDataComponent(source(kind), lambda v: None if v < 8 else v, k))
    assert [label(dp, kind) for dp in got] == [8, 9]


def test_map_data_component_missing():
    with pytest.raises(DatapointError, match=r"component 'lbl' is missing; the datapoint has keys \["):
        list(MapDataComponent(source("dict"), lambda v: v, "lbl"))
    with pytest.raises(DatapointError, match="component 5 is missing; the datapoint has 3 components"):
        list(MapDataComponent(source("tuple"), lambda v: v, 5))


@pytest.mark.parametrize("kind", KINDS)
def test_filter_data(kind):
    df = FilterData(source(kind), lambda dp: label(dp, kind) >= 7)
    got = check_dataflow(df)
    assert [label(dp, kind) for dp in got] == [7, 8, 9]
    with pytest.raises(LengthUnknownError, match="FilterData"):
        len(df)


@pytest.mark.parametrize("kind", KINDS)
def test_select_component(kind):
    keys = KEY[kind]
    got = check_dataflow(SelectComponent(source(kind), [keys[2], keys[1]]), deterministic=True)
    assert type(got[0]) is type(make(kind, 0))
    first = list(got[4].values()) if kind == "dict" else list(got[4])
    assert first == ["n4", 4]
    with pytest.raises(DatapointError, match="component"):
        list(SelectComponent(source(kind), [keys[0], 7 if kind != "dict" else "nope"]))
    with pytest.raises(TypeError, match="sequence"):
        SelectComponent(source(kind), "ab")


@pytest.mark.parametrize("kind", KINDS)
def test_repeated_data(kind):
    df = RepeatedData(source(kind, 3), 3)
    got = check_dataflow(df, deterministic=True)
    assert [label(dp, kind) for dp in got] == [0, 1, 2] * 3
    assert len(df) == 9
    forever = RepeatedData(source(kind, 3), -1)
    with pytest.raises(LengthUnknownError, match="forever"):
        len(forever)
    assert [label(dp, kind) for dp in itertools.islice(forever, 7)] == [0, 1, 2, 0, 1, 2, 0]


def test_repeated_data_bad_input():
    for num in (-2, 1.5, "3", True):
        with pytest.raises(ValueError, match="RepeatedData num"):
            RepeatedData(source("list"), num)
    assert list(RepeatedData(source("list"), 0)) == []
    with pytest.raises(DatapointError, match="yielded nothing"):
        next(iter(RepeatedData(DataFromList([], shuffle=False), -1)))


@pytest.mark.parametrize("kind", KINDS)
def test_fixed_size_data(kind):
    df = FixedSizeData(source(kind, 4), 3)  # keeps its place between epochs
    got = check_dataflow(df, deterministic=False)
    assert len(got) == 3
    df2 = FixedSizeData(source(kind, 4), 3)
    labels = [label(dp, kind) for _ in range(3) for dp in df2]
    assert labels == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    df3 = FixedSizeData(source(kind, 4), 6, keep_state=False)
    assert [label(dp, kind) for dp in df3] == [0, 1, 2, 3, 0, 1]
    assert [label(dp, kind) for dp in df3] == [0, 1, 2, 3, 0, 1]


def test_fixed_size_data_bad_input_and_pickle():
    with pytest.raises(ValueError, match="size"):
        FixedSizeData(source("list"), 0)
    with pytest.raises(DatapointError, match="yielded nothing"):
        list(FixedSizeData(DataFromList([], shuffle=False), 2))
    df = FixedSizeData(source("list", 4), 3)
    list(df)
    copy = pickle.loads(pickle.dumps(df))  # holds a live iterator; the copy starts over
    assert [dp[1] for dp in copy] == [0, 1, 2]
    assert [dp[1] for dp in df] == [3, 0, 1]


@pytest.mark.parametrize("kind", KINDS)
def test_cache_data(kind):
    src = CountingSource(kind)
    df = CacheData(src)
    got = check_dataflow(df, deterministic=True)
    assert [label(dp, kind) for dp in got] == [0, 1, 2, 3, 4]
    assert src.epochs == 1  # later epochs come from memory
    shuffled = CacheData(CountingSource(kind, 30), shuffle=True, seed=0)
    first = [label(dp, kind) for dp in shuffled]
    second = [label(dp, kind) for dp in shuffled]
    assert first == list(range(30)) and sorted(second) == first and second != first


def test_cache_data_interrupted_epoch_is_not_cached():
    src = CountingSource("list")
    df = CacheData(src)
    for dp in df:
        if dp[1] == 2:
            break
    assert [dp[1] for dp in df] == [0, 1, 2, 3, 4]
    assert src.epochs == 2
    assert len(df) == 5


@pytest.mark.parametrize("kind", KINDS)
def test_print_data(kind, caplog):
    df = PrintData(source(kind), num=2, name="mine")
    with caplog.at_level(logging.INFO, logger="bridgeflow"):
        got = check_dataflow(df, deterministic=True)
    assert len(got) == 10
    text = caplog.text
    assert "PrintData mine, datapoint 1" in text and "datapoint 2" not in text
    assert "ndarray shape=(2, 3) dtype=uint8" in text
    assert "str 'n1'" in text


def test_describe_datapoint():
    text = describe_datapoint({"a": np.arange(4, dtype=np.int16), "b": [1, 2, 3, 4, 5]})
    assert "dict of 2" in text and "range [0, 3]" in text and "int16" in text
    assert "... 2 more" in text
