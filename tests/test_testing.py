"""bridgeflow.testing: the contract checks must catch broken flows, not only pass good ones."""

from __future__ import annotations

import numpy as np
import pytest

from bridgeflow import DataFlow, DataFromList, FakeData
from bridgeflow.testing import assert_same_datapoints, check_dataflow, datapoint_structure


class Flow(DataFlow):
    def __init__(self, epochs, length=None):
        self.epochs = [list(e) for e in epochs]
        self.length = length
        self.n = 0
        self.closed = 0

    def __iter__(self):
        epoch = self.epochs[min(self.n, len(self.epochs) - 1)]
        self.n += 1
        yield from epoch

    def __len__(self):
        if self.length is None:
            return super().__len__()
        return self.length

    def close(self):
        self.closed += 1


def test_good_flow_passes_and_returns_first_epoch():
    df = Flow([[[1], [2]]], length=2)
    assert check_dataflow(df) == [[1], [2]]
    assert df.n == 3  # two epochs and the concurrency probe
    assert df.closed == 2


def test_wrong_len():
    with pytest.raises(AssertionError, match="len\\(\\) is 3 but 2 datapoints came"):
        check_dataflow(Flow([[[1], [2]]], length=3))


def test_len_raising_a_plain_type_error():
    class Bad(Flow):
        def __len__(self):
            raise TypeError("nope")

    with pytest.raises(AssertionError, match="not LengthUnknownError"):
        check_dataflow(Bad([[[1]]]))


def test_not_a_datapoint():
    with pytest.raises(AssertionError, match="datapoint is a int"):
        check_dataflow(Flow([[1, 2]]))


def test_structure_change():
    with pytest.raises(AssertionError, match="datapoint 1: structure"):
        check_dataflow(Flow([[[np.zeros(2, np.float32)], [np.zeros(2, np.float64)]]]))
    with pytest.raises(AssertionError, match="structure"):
        check_dataflow(Flow([[[1], (1,)]]))


def test_epochs_that_differ():
    with pytest.raises(AssertionError, match="different multisets"):
        check_dataflow(Flow([[[1], [2]], [[1], [3]]], length=2))
    with pytest.raises(AssertionError, match="datapoint 0 differs"):
        check_dataflow(Flow([[[1], [2]], [[2], [1]]], length=2), deterministic=True)
    check_dataflow(Flow([[[1], [2]], [[2], [1]]], length=2))  # same multiset: fine by default
    check_dataflow(Flow([[[1], [2]], [[1], [3]]], length=2), deterministic=False)


def test_endless_flow():
    with pytest.raises(AssertionError, match="endless"):
        check_dataflow(FakeData([[1]], size=None), max_datapoints=50)


def test_flow_that_allows_two_consumers():
    class Unguarded:  # not a DataFlow: nothing refuses a second iterator
        def reset_state(self):
            pass

        def __iter__(self):
            return iter([[1], [2]])

        def __len__(self):
            return 2

        def close(self):
            pass

    with pytest.raises(AssertionError, match="not refused"):
        check_dataflow(Unguarded())


def test_assert_same_datapoints():
    a = [[np.arange(3)], {"k": 1}]
    assert_same_datapoints(a, [[np.arange(3)], {"k": 1}])
    with pytest.raises(AssertionError, match="datapoint 0 differs"):
        assert_same_datapoints(a, [[np.arange(3).astype(np.int32)], {"k": 1}])  # dtype matters
    with pytest.raises(AssertionError, match="2 datapoints != 1"):
        assert_same_datapoints(a, a[:1])
    assert_same_datapoints(a, a[::-1], ordered=False)
    with pytest.raises(AssertionError):
        assert_same_datapoints(a, a[::-1])


def test_datapoint_structure():
    s = datapoint_structure([np.zeros((2, 3), np.uint8), 1, ["a", "b"]])
    assert s == ("list", (("ndarray", "|u1", 2), ("int",), ("list",)))
    assert datapoint_structure({"x": 1.0}) == ("dict", (("x", ("float",)),))
    # a list inside a component may vary in length (a batch's strings, a variable number of boxes)
    assert datapoint_structure([["a"]]) == datapoint_structure([["a", "b", "c"]])
    assert datapoint_structure((1,)) != datapoint_structure([1])


def test_check_dataflow_on_a_builtin_flow():
    assert check_dataflow(DataFromList([[1], [2]], shuffle=False), deterministic=True) == [[1], [2]]
