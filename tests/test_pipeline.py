"""A pipeline as a whole: its paths, every stage's counters, and the verdict on the slow side."""

from __future__ import annotations

import pytest

import bridgeflow as bf
from bridgeflow.pipeline import bottleneck, format_stats, iter_flows, pipeline_stats


class Counters(bf.DataFlow):
    def __init__(self, **values):
        self.values = values

    def _iter_epoch(self):
        yield [1]

    def _own_stats(self):
        return dict(self.values)


def stage(wait, busy=None, fill=0.5):
    out = {"datapoints": 100, "workers": 2, "buffer_fill": fill, "consumer_wait_s": 1.0, "consumer_wait_frac": wait}
    if busy is not None:
        out["workers_busy"] = busy
    return out


def test_every_stage_under_a_flow_by_path():
    inner = Counters(a=1.0)
    df = bf.BatchData(bf.MapData(bf.JoinData([inner, Counters(b=2.0)]), lambda dp: dp), 1)
    assert pipeline_stats(df) == df.stats() == {"BatchData/MapData/JoinData/Counters[0]": {"a": 1.0},
                                                "BatchData/MapData/JoinData/Counters[1]": {"b": 2.0}}
    # a flow seen twice is walked once; its path is the first
    twice = bf.ConcatData([inner, inner])
    assert [p for p, _ in iter_flows(twice)] == ["ConcatData", "ConcatData/Counters[0]"]
    assert format_stats({"X/Y": {"n": 3, "f": 0.25}}) == "  X/Y: n=3 f=0.25"
    assert bf.MapData([[1]], lambda dp: dp).stats() == {}


def test_a_duck_typed_flow_is_walked_without_children():
    class TensorpackStyle:
        def reset_state(self):
            pass

        def __iter__(self):
            yield [1]

    df = bf.MapData(TensorpackStyle(), lambda dp: dp)
    assert [p for p, _ in iter_flows(df)] == ["MapData", "MapData/TensorpackStyle"]
    assert df.stats() == {}


@pytest.mark.parametrize("stats, verdict", [
    ({"S": stage(0.02, 0.4, fill=0.95)}, "the consumer: S had its results ready (95% of its buffer full"),
    # the two sides of a fill near 0 (the docs: the workers are the slow side), the consumer seldom waiting
    ({"S": stage(0.02, 0.4, fill=0.012)}, "the workers of S, by a narrow margin: its buffer was 1.2% full"),
    ({"S": stage(0.02, 0.4, fill=0.1)}, "the consumer: S had its results ready (10% of its buffer full"),
    ({"S": stage(0.9, 0.97)}, "the workers of S: busy 97% of the time while the consumer waited 90%"),
    ({"S": stage(0.9)}, "the workers of S: while the consumer waited 90%"),  # threads of a Ray stage, say
    ({"S": stage(0.9, 0.3)}, "what feeds the workers of S: they were busy only 30%"),
    # where the source is read: in the consumer's process for a map stage, in the workers for a runner
    ({"B/MultiProcessMapData": stage(0.9, 0.3)}, "what feeds the workers of B/MultiProcessMapData: they were busy "
     "only 30% of the time while the consumer waited 90% of it, so reading the source (in the consumer's process)"),
    ({"B/MultiProcessRunnerZMQ": stage(0.9, 0.3)}, "what feeds the workers of B/MultiProcessRunnerZMQ: they were "
     "busy only 30% of the time while the consumer waited 90% of it, so moving the data from the workers (they "
     "read their own source"),
    # the outer stage waits on idle workers; the stage below keeps up: still what feeds the outer one
    ({"S": stage(0.9, 0.3), "S/M/T": stage(0.01, 0.5)}, "what feeds the workers of S:"),
    # ... or is itself held up by its busy workers
    ({"S": stage(0.9, 0.3), "S/M/T": stage(0.8, 0.99)}, "the workers of S/M/T: busy 99%"),
    ({"S/M/T": stage(0.5, 0.9), "S": stage(0.05)}, "the consumer: S had"),  # the nearest stage decides
])
def test_bottleneck_verdicts(stats, verdict):
    assert bottleneck(stats).startswith(verdict)


def test_no_verdict_without_a_stage_that_measures_waits():
    assert bottleneck({}) is None
    assert bottleneck({"AugmentImageComponent": {"augment_errors": 1.0}}) is None
