"""Flows that combine: ConcatData, JoinData, RandomChooseData, RandomMixData (LocallyShuffleData: its own file)."""

from __future__ import annotations

import numpy as np
import pytest

from bridgeflow import (
    ConcatData,
    DataFromList,
    DatapointError,
    JoinData,
    LengthUnknownError,
    RandomChooseData,
    RandomMixData,
)
from bridgeflow.testing import check_dataflow

KINDS = ["list", "tuple", "dict"]


def make(kind: str, i: int, tag: str = "a"):
    parts = (np.full((2,), i, dtype=np.int32), i)
    if kind == "dict":
        return {f"{tag}_x": parts[0], f"{tag}_y": parts[1]}
    return tuple(parts) if kind == "tuple" else list(parts)


def source(kind: str, n: int, start: int = 0, tag: str = "a") -> DataFromList:
    return DataFromList([make(kind, i, tag) for i in range(start, start + n)], shuffle=False)


def ys(dps, kind, tag="a"):
    return [dp[f"{tag}_y"] if kind == "dict" else dp[1] for dp in dps]


@pytest.mark.parametrize("kind", KINDS)
def test_concat(kind):
    df = ConcatData([source(kind, 3), source(kind, 2, start=10)])
    got = check_dataflow(df, deterministic=True)
    assert ys(got, kind) == [0, 1, 2, 10, 11]
    assert len(df) == 5 and all(type(dp) is type(make(kind, 0)) for dp in got)
    with pytest.raises(ValueError, match="at least one"):
        ConcatData([])
    with pytest.raises(TypeError, match="item 1 is a int"):
        ConcatData([source(kind, 1), 5])


@pytest.mark.parametrize("kind", KINDS)
def test_join(kind):
    df = JoinData([source(kind, 4, tag="a"), source(kind, 3, start=5, tag="b")])
    got = check_dataflow(df, deterministic=True)
    assert len(df) == 3 and len(got) == 3  # the shortest flow
    assert type(got[0]) is type(make(kind, 0))
    if kind == "dict":
        assert sorted(got[1]) == ["a_x", "a_y", "b_x", "b_y"]
        assert (got[1]["a_y"], got[1]["b_y"]) == (1, 6)
    else:
        assert len(got[1]) == 4 and (got[1][1], got[1][3]) == (1, 6)


def test_join_mixed_list_and_tuple_gives_a_list():
    got = list(JoinData([source("list", 2), source("tuple", 2)]))
    assert type(got[0]) is list and len(got[0]) == 4


def test_join_bad_input():
    with pytest.raises(DatapointError, match="key 'a_x' comes from two"):
        list(JoinData([source("dict", 2), source("dict", 2)]))
    with pytest.raises(DatapointError, match=r"cannot join dict and list.*\['dict', 'list'\]"):
        list(JoinData([source("dict", 2), source("list", 2)]))


@pytest.mark.parametrize("kind", KINDS)
def test_random_choose(kind):
    df = RandomChooseData([source(kind, 50), (source(kind, 50, start=100), 3.0)], seed=0)
    got = check_dataflow(df, deterministic=False)
    with pytest.raises(LengthUnknownError, match="RandomChooseData"):
        len(df)
    y = ys(got, kind)
    high = sum(v >= 100 for v in y)
    assert max(v for v in y if v >= 100) == 149  # it stops when the likelier flow runs out
    assert 50 <= len(y) < 100 and high > 2 * (len(y) - high)  # about 3:1
    assert [v for v in y if v < 100] == sorted(v for v in y if v < 100)  # each flow keeps its order
    again = RandomChooseData([source(kind, 50), (source(kind, 50, start=100), 3.0)], seed=0)
    assert ys(again, kind) == y


def test_random_choose_bad_probabilities():
    with pytest.raises(ValueError, match="probabilities"):
        RandomChooseData([(source("list", 2), -1.0), (source("list", 2), 1.0)])
    with pytest.raises(ValueError, match="probabilities"):
        RandomChooseData([(source("list", 2), 0.0)])


@pytest.mark.parametrize("kind", KINDS)
def test_random_mix(kind):
    df = RandomMixData([source(kind, 20), source(kind, 20, start=100)], seed=1)
    got = check_dataflow(df)
    y = ys(got, kind)
    assert sorted(y) == list(range(20)) + list(range(100, 120))
    assert y != sorted(y)
    assert [v for v in y if v < 100] == list(range(20))
    assert len(df) == 40


def test_random_mix_short_flow():
    class Liar(DataFromList):
        def __len__(self):
            return 5

    with pytest.raises(DatapointError, match="flow 1 .*Liar.* fewer datapoints than its len\\(\\) of 5"):
        list(RandomMixData([source("list", 3), Liar([[1]] * 2, shuffle=False)], seed=0))
