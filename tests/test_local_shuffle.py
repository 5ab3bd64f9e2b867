"""LocallyShuffleData: tensorpack's buffer (FIFO, num_reuse, shuffle_interval, an endless source), its
one-pass variant, and exact resumption without the buffer in the state."""

from __future__ import annotations

import collections
import json
import warnings
from collections import Counter

import numpy as np
import pytest

import bridgeflow as bf
from bridgeflow import DataFlow, DataFromList, DatapointError, LengthUnknownError, LocallyShuffleData
from bridgeflow._state import StateMismatchError
from bridgeflow.testing import check_dataflow, check_resumable

KINDS = ["list", "tuple", "dict"]


def make(kind: str, i: int):
    parts = (np.full((2,), i, dtype=np.int32), i)
    if kind == "dict":
        return {"x": parts[0], "y": parts[1]}
    return tuple(parts) if kind == "tuple" else list(parts)


def source(kind: str, n: int) -> DataFromList:
    return DataFromList([make(kind, i) for i in range(n)], shuffle=False)


def ys(dps, kind="list"):
    return [dp["y"] if kind == "dict" else dp[1] for dp in dps]


class Passes(DataFlow):
    """0..n-1, then n..2n-1, ...: every read of the endless stream has its own id (pass * n + i)."""

    def __init__(self, n: int) -> None:
        self.n, self.passes = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        base = self.passes * self.n
        self.passes += 1
        for i in range(self.n):
            yield [base + i]


def reference(n: int, buffer_size: int, num_reuse: int, interval: int, seed: int, count: int) -> list[int]:
    """The buffer as the issue describes tensorpack's, written out: a deque shuffled in place."""
    rng = np.random.RandomState(seed)
    q: collections.deque = collections.deque(maxlen=buffer_size)
    out, cnt, i = [], 0, 0
    while len(out) < count:
        dp = i % n
        i += 1
        cnt = (cnt + 1) % interval
        if cnt == 0:
            rng.shuffle(q)
        for _ in range(num_reuse):
            if len(q) == q.maxlen:
                out.append(q.popleft())
            q.append(dp)
    return out[:count]


def stream(df: LocallyShuffleData, epochs: int) -> list[int]:
    return [int(dp[0]) for _ in range(epochs) for dp in df]


# --- tensorpack's semantics ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_epochs_are_len_datapoints_of_an_endless_stream(kind):
    df = LocallyShuffleData(source(kind, 100), buffer_size=10, seed=0)
    got = check_dataflow(df, deterministic=False)  # two epochs of len() datapoints each, types kept
    assert len(df) == 100 and all(type(dp) is type(make(kind, 0)) for dp in got)
    y = ys(got, kind)
    assert y != sorted(y)
    df.reset_state()
    epochs = [ys(df, kind) for _ in range(5)]
    assert all(len(e) == 100 for e in epochs)
    counts = Counter(v for e in epochs for v in e)
    assert set(counts) == set(range(100)) and sum(counts.values()) == 500
    assert all(4 <= c <= 6 for c in counts.values())  # five passes, mixed at their boundaries
    assert any(Counter(e) != Counter(range(100)) for e in epochs)  # an epoch is not one pass


def test_passes_mix_and_no_datapoint_is_lost_or_repeated():
    df = LocallyShuffleData(Passes(50), 16, seed=1)
    out = stream(df, 6)
    assert len(out) == 300 and len(set(out)) == 300  # each read comes out once
    assert set(out) <= set(range(300 + 16)) and max(out[:50]) >= 50  # the first epoch already holds pass 1
    assert all(v <= i + 16 for i, v in enumerate(out))  # local: nothing comes out before it was read
    df = LocallyShuffleData(Passes(50), 16, seed=1)
    df.reset_state()
    first = [dp[0] for dp in df]
    it = iter(df)
    part = [next(it)[0] for _ in range(20)]
    it.close()  # an interrupted epoch loses nothing: the next one continues the stream
    assert first + part + [dp[0] for dp in df] == out[:120]


@pytest.mark.parametrize("n, buffer_size, num_reuse, interval", [
    (10, 4, 1, None), (10, 4, 2, None), (7, 20, 1, 5), (50, 9, 3, 2), (30, 6, 1, 10**9), (5, 2, 1, None),
])
def test_buffer_matches_the_reference_model(n, buffer_size, num_reuse, interval):
    df = LocallyShuffleData(DataFromList([[i] for i in range(n)], shuffle=False), buffer_size, num_reuse, interval)
    df.reset_state()
    df.rng = np.random.RandomState(123)  # the reference's generator
    expected = reference(n, buffer_size, num_reuse, interval or max(1, buffer_size // 3), 123, 4 * n * num_reuse)
    assert stream(df, 4) == expected


def test_without_shuffles_the_buffer_is_a_fifo():
    df = LocallyShuffleData(DataFromList([[i] for i in range(6)], shuffle=False), 4, num_reuse=2,
                            shuffle_interval=10**9, seed=0)
    assert stream(df, 2) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5] * 2
    assert LocallyShuffleData(source("list", 3), 9).shuffle_interval == 3  # buffer_size // 3
    assert LocallyShuffleData(source("list", 3), 2).shuffle_interval == 1  # (tensorpack: 0, then a crash)


def test_reuse_counts_and_a_buffer_larger_than_the_source():
    df = LocallyShuffleData(source("list", 10), buffer_size=4, num_reuse=3, seed=0)
    assert len(df) == 30
    counts = Counter(v for _ in range(4) for v in ys(df))
    assert sum(counts.values()) == 120 and all(10 <= c <= 14 for c in counts.values())
    big = LocallyShuffleData(Passes(3), buffer_size=50, seed=0)  # 50 reads buffered before the first output
    out = [[dp[0] for dp in big] for _ in range(4)]
    assert [len(e) for e in out] == [3] * 4 and len({v for e in out for v in e}) == 12
    assert all(v <= i + 50 for i, v in enumerate(sum(out, [])))
    assert big.ds.passes == 21  # 50 + 12 reads, 3 per pass of the source


def test_a_source_without_length_is_read_forever():
    df = LocallyShuffleData(bf.DataFromGenerator(lambda: ([i] for i in range(7))), 5, seed=0)
    with pytest.raises(LengthUnknownError):
        len(df)
    df.reset_state()
    it = iter(df)
    out = [next(it)[0] for _ in range(70)]
    assert Counter(out).keys() == set(range(7)) and 9 <= min(Counter(out).values())
    it.close()


def test_an_empty_source_is_an_error_not_a_spin():
    assert list(LocallyShuffleData(source("list", 0), 4)) == []  # len() 0: epochs of nothing
    assert list(LocallyShuffleData(source("list", 0), 4, one_pass=True)) == []
    with pytest.raises(DatapointError, match="source yielded nothing; reading it endlessly would never end"):
        list(LocallyShuffleData(bf.DataFromGenerator(lambda: iter([])), 4))


def test_reset_state_starts_a_new_stream():
    df = LocallyShuffleData(Passes(20), 8, seed=3)
    df.reset_state()
    first = [dp[0] for dp in df]
    df.reset_state()  # the buffer and its stream are dropped; the source goes on with its next pass
    again = [dp[0] for dp in df]
    assert min(again) >= 2 * 20  # pass 0 and 1 were read by the first stream
    assert len(first) == len(again) == 20


# --- one pass per epoch --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_one_pass_gives_each_datapoint_num_reuse_times_per_epoch(kind):
    df = LocallyShuffleData(source(kind, 100), buffer_size=10, num_reuse=2, seed=0, one_pass=True)
    got = check_dataflow(df)  # epochs compared as multisets
    assert sorted(ys(got, kind)) == sorted(list(range(100)) * 2) and ys(got, kind) != sorted(ys(got, kind))
    df.reset_state()
    assert ys(df, kind) != ys(df, kind)  # a new order each epoch
    y = ys(LocallyShuffleData(source(kind, 100), 10, seed=0, one_pass=True), kind)
    assert all(v <= i + 10 for i, v in enumerate(y))  # local


def test_set_epoch_reaches_the_source_only_in_one_pass_mode():
    seen = []

    class Epochs(DataFlow):
        def __iter__(self):
            yield from ([i] for i in range(5))

        def __len__(self):
            return 5

        def set_epoch(self, epoch):
            seen.append(epoch)

    LocallyShuffleData(Epochs(), 2).set_epoch(3)
    LocallyShuffleData(Epochs(), 2, one_pass=True).set_epoch(4)
    assert seen == [4]


# --- arguments -----------------------------------------------------------------------------------


def test_bad_arguments_name_themselves():
    for kwargs, what in [(dict(buffer_size=0), "buffer_size"), (dict(buffer_size=2, num_reuse=0), "num_reuse"),
                         (dict(buffer_size=2, shuffle_interval=0), "shuffle_interval"),
                         (dict(buffer_size=2.5), "buffer_size"), (dict(buffer_size=True), "buffer_size")]:
        with pytest.raises(ValueError, match=f"LocallyShuffleData {what} must be an integer >= 1"):
            LocallyShuffleData(source("list", 3), **kwargs)


def test_nr_reuse_is_the_deprecated_name_of_num_reuse():
    with pytest.deprecated_call(match=r"LocallyShuffleData\(nr_reuse=\.\.\.\) is tensorpack's older name of the "
                                      r"argument: use num_reuse="):
        df = LocallyShuffleData(source("list", 4), 3, nr_reuse=2)
    assert df.num_reuse == 2 and len(df) == 8
    with pytest.raises(TypeError, match="got both nr_reuse= and num_reuse="):
        LocallyShuffleData(source("list", 4), 3, num_reuse=2, nr_reuse=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LocallyShuffleData(source("list", 4), 3, 2, 1)  # tensorpack's positional order: no warning


# --- state ---------------------------------------------------------------------------------------


def shuffled(n=40, seed=3):
    return DataFromList([[i, np.full(2, i, np.int16)] for i in range(n)], shuffle=True, seed=seed)


STATEFUL = {
    "endless": lambda: LocallyShuffleData(shuffled(13), 5, seed=1),
    "endless reuse": lambda: LocallyShuffleData(shuffled(11), 4, num_reuse=3, shuffle_interval=2, seed=2),
    "buffer larger than source": lambda: LocallyShuffleData(shuffled(6), 20, seed=3),
    "no shuffle": lambda: LocallyShuffleData(shuffled(9), 4, shuffle_interval=10**6, seed=4),
    "one pass": lambda: LocallyShuffleData(shuffled(13), 5, num_reuse=2, seed=5, one_pass=True),
    "source without length": lambda: bf.FixedSizeData(
        LocallyShuffleData(bf.DataFromGenerator(lambda: ([i] for i in range(9))), 4, seed=6), 11),
    "batched": lambda: bf.BatchData(LocallyShuffleData(bf.MapData(shuffled(17), lambda dp: [dp[0] * 2]), 6,
                                                       seed=7), 4, remainder=True),
    "nested": lambda: LocallyShuffleData(LocallyShuffleData(shuffled(10), 3, seed=8), 4, num_reuse=2, seed=9),
}


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_resumes_exactly_after_every_datapoint(name):
    n = len(check_resumable(STATEFUL[name], positions=[0], epochs=3))
    check_resumable(STATEFUL[name], positions=range(n + 1), epochs=3)


def test_resumes_deep_into_the_stream_and_again():
    """A state saved in epoch 3 of a long run, then one saved in epoch 8 by the flow that resumed from it."""
    make = lambda: LocallyShuffleData(shuffled(30), 12, num_reuse=2, seed=11)  # 60 datapoints per epoch
    with make() as u:
        whole = stream(u, 12)
    with make() as f:
        seen = stream(f, 3)
        it = iter(f)
        seen += [int(next(it)[0]) for _ in range(17)]
        state = json.loads(json.dumps(f.state_dict()))
        it.close()
    assert seen == whole[:197]
    with make() as g:
        g.load_state_dict(state)
        seen += stream(g, 5)  # the rest of epoch 3, then epochs 4 to 7
        it = iter(g)
        seen += [int(next(it)[0]) for _ in range(5)]
        state = json.loads(json.dumps(g.state_dict()))
        it.close()
    assert seen == whole[:485]
    with make() as h:
        h.load_state_dict(state)
        seen += stream(h, 4)
    assert seen == whole


def test_a_state_is_small_whatever_the_buffer_and_the_replay_is_measured():
    df = LocallyShuffleData(DataFromList(list(range(200_000)), shuffle=False), 5000, seed=0)
    df.reset_state()
    it = iter(df)
    for _ in range(60_000):
        next(it)
    state = df.state_dict()
    text = json.dumps(state)
    assert len(text) < 8000  # about 5 KB of it is the random generator's state
    replay = state["replay"]
    assert 0 < replay < 60_000  # a few buffers back, not the whole stream
    it.close()
    again = LocallyShuffleData(DataFromList(list(range(200_000)), shuffle=False), 5000, seed=0)
    again.load_state_dict(json.loads(text))
    a, b = iter(df), iter(again)
    assert [next(a) for _ in range(1000)] == [next(b) for _ in range(1000)]
    a.close()
    b.close()


@pytest.mark.parametrize("size", [1, 3])
def test_states_taken_often_on_a_small_buffer_load(size):
    """A state goes back to the snapshot before the oldest read the buffer needed when that was last computed,
    up to 256 reads ago: with a state taken 255 datapoints after another, one of buffer_size=1 replayed 510
    datapoints and a fresh flow refused it (the bound allowed 322); the defaults fuzz, seed 40, pipeline 37."""
    def make_flow():
        return LocallyShuffleData(DataFromList([[i] for i in range(1000)], shuffle=False), size, seed=1)

    df = make_flow()
    df.reset_state()
    ref, states = [], {}
    for dp in df:
        ref.append(dp[0])
        if len(ref) in (255, 510, 765):
            states[len(ref)] = json.loads(json.dumps(df.state_dict()))
    assert max(s["replay"] for s in states.values()) > 64 * size + 256 + 2  # past the bound that refused it
    for k, state in states.items():
        again = make_flow()
        again.load_state_dict(state)
        assert [dp[0] for dp in again] == ref[k:], k


def test_states_of_another_configuration_are_refused():
    df = LocallyShuffleData(shuffled(10), 4, seed=0)
    df.reset_state()
    it = iter(df)
    next(it)
    state = df.state_dict()
    it.close()
    for other, what in [(LocallyShuffleData(shuffled(10), 5, seed=0), "buffer_size=4, this flow has buffer_size=5"),
                        (LocallyShuffleData(shuffled(10), 4, 2, seed=0), "num_reuse=1"),
                        (LocallyShuffleData(shuffled(10), 4, shuffle_interval=2, seed=0), "shuffle_interval=1"),
                        (LocallyShuffleData(shuffled(10), 4, seed=0, one_pass=True), "one_pass=False")]:
        with pytest.raises(StateMismatchError, match=f"^LocallyShuffleData: the state is for {what}"):
            other.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="^LocallyShuffleData/DataFromList: .*length 10, this flow has "
                                                 "a dataset of length 11"):
        LocallyShuffleData(shuffled(11), 4, seed=0).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="buffer holds 9 datapoints, more than buffer_size=4"):
        LocallyShuffleData(shuffled(10), 4, seed=0).load_state_dict({**state, "fill": 9})


def test_a_source_that_yields_less_on_replay_is_named():
    class Shrinking(DataFlow):
        n = 12

        def __iter__(self):
            yield from ([i] for i in range(Shrinking.n))

        def __len__(self):
            return 12

    df = LocallyShuffleData(Shrinking(), 4, seed=0, one_pass=True)
    it = iter(df)
    for _ in range(10):
        next(it)
    state = df.state_dict()
    it.close()
    Shrinking.n = 5
    again = LocallyShuffleData(Shrinking(), 4, seed=0, one_pass=True)
    again.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="^LocallyShuffleData: resuming replays 10 datapoints of the "
                                                 "buffer, but the stream ended after 5"):
        iter(again)


def test_copies_in_worker_processes_start_their_own_streams(leak_check):
    flow = LocallyShuffleData(shuffled(20), 6, seed=1)
    flow.reset_state()
    next(iter(flow))  # this process's stream is under way when the runner copies the flow
    with bf.MultiProcessRunner(flow, 4, 2) as df:
        df.reset_state()
        out = [dp[0] for _ in range(3) for dp in df]
    assert len(out) == 60 and set(out) <= set(range(20))
