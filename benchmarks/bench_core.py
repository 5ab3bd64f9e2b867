"""Benchmark: what the core costs on top of the work it does, measured against hand-written loops.

Cases, each timed with interleaved repetitions (anchor, bridgeflow, anchor, ...) in one run:

- ``batch_stack``: ``BatchData(FakeData([[3, 224, 224]], dtype=uint8, random=False), 64)`` against a
  hand-written loop that ``np.stack``-s the same fixed array 64 times per batch. Both produce the same
  batches, so the ratio bridgeflow / hand is the share of the stacking speed the core keeps
  (target >= 0.9).
- ``batch_overhead``: the same two loops on 1-byte arrays, where stacking is nearly free: what the core
  itself costs per batch of 64, in microseconds (set it beside the stacking time of a real batch).
- ``map_chain``: five ``MapData(identity)`` wrappers around a source of small datapoints, against the
  bare source: the time each wrapper adds per datapoint, in microseconds.
- ``state_bookkeeping``: what keeping track of the position (for ``state_dict()``) costs.
  ``BatchData(MapData(DataFromList(shuffled)), 64)`` over small datapoints, against the same pipeline
  built from copies of the flows as they were before they had state (``resumable=False``, so not even
  the default counting runs). ``ratio_tracked`` is baseline time / tracked time (1.0: free; target >=
  0.98); ``ratio_state_every_batch`` adds a ``state_dict()`` call after every batch, as a checkpointing
  loader does, and ``state_dict_us`` is one such call.

- ``local_shuffle``: ``LocallyShuffleData(DataFromList(...), buffer)`` (tensorpack's buffer, endless) against
  the bare source, for buffers of 1,000 and 50,000: the time the buffer adds per datapoint, in
  microseconds. Then, deep into the stream, what a state costs: ``state_dict_us`` (one call; the buffer is
  scanned at most once per ``buffer // 4`` datapoints read), ``state_bytes`` (json), ``replay_buffers``
  (how far back the state rebuilds the buffer from, in buffers) and ``resume_s`` (the first ``iter()``
  after ``load_state_dict``, which replays that far without yielding).

- ``state_dict``: one ``state_dict()`` of four five-stage pipelines (maps, a thread stage, a local shuffle, a
  join with a random source), wall and CPU microseconds and the state's size; ``state_dict_largest``: a
  ``LocallyShuffleData(2000)`` over an unordered stage of 64 KB arrays, whose buffer is in its state.

Each line printed is one JSON object with the median of the repetitions (and the machine it ran on:
absolute rates mean something only beside it; the ratios are what to compare across machines).

Run: python benchmarks/bench_core.py [--reps 9] [--batches 60] [--datapoints 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from bridgeflow import (
    BatchData,
    DataFlow,
    DataFromList,
    FakeData,
    JoinData,
    LocallyShuffleData,
    MapData,
    MultiThreadMapData,
    RepeatedData,
    RNGDataFlow,
)
from bridgeflow._batch import batch_datapoints
from bridgeflow._transforms import _DATAPOINT_TYPES, check_datapoint

BATCH = 64
SHAPE = (3, 224, 224)
TARGET_RATIO = 0.9


def machine() -> dict:
    return {"machine": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__}


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def interleave(cases: dict[str, Callable[[], int]], reps: int) -> dict[str, list[float]]:
    """Run every case ``reps`` times, alternating between them; returns seconds per item for each."""
    out: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # one untimed warm-up each (page faults, caches, lazy imports)
        fn()
    for rep in range(reps):
        order = list(cases.items())
        if rep % 2:
            order.reverse()  # neither case always runs right after the other
        for name, fn in order:
            seconds, n = timed(fn)
            out[name].append(seconds / n)
    return out


def stack_cases(shape: tuple[int, ...], batches: int) -> tuple[dict[str, Callable[[], int]], np.ndarray]:
    """The hand loop and the BatchData pipeline over one fixed ``shape`` uint8 array."""
    n = batches * BATCH
    flow = BatchData(FakeData([list(shape)], size=n, dtype="uint8", random=False, seed=0), BATCH)
    flow.reset_state()
    fixed = next(iter(flow.ds))[0]  # the very array the flow stacks, for the hand loop to stack too

    def by_hand() -> int:
        count = 0
        for _ in range(batches):
            batch = np.stack([fixed for _ in range(BATCH)])
            count += len(batch)
        return count

    def by_bridgeflow() -> int:
        count = 0
        for (batch,) in flow:
            count += len(batch)
        return count

    check = next(iter(flow))[0]
    assert check.shape == (BATCH, *shape) and check.dtype == np.uint8 and np.array_equal(check[-1], fixed)
    return {"hand": by_hand, "bridgeflow": by_bridgeflow}, fixed


def bench_batch_stack(reps: int, batches: int) -> None:
    cases, _ = stack_cases(SHAPE, batches)
    times = interleave(cases, reps)
    hand, bf = statistics.median(times["hand"]), statistics.median(times["bridgeflow"])
    emit(bench="core", case="batch_stack", shape=list(SHAPE), dtype="uint8", batch=BATCH, batches=batches,
         reps=reps, hand_dp_per_s=round(1 / hand), bridgeflow_dp_per_s=round(1 / bf),
         ratio=round(hand / bf, 3), target=TARGET_RATIO, meets_target=hand / bf >= TARGET_RATIO,
         ratio_per_rep=[round(h / b, 3) for h, b in zip(times["hand"], times["bridgeflow"])], **machine())


def bench_batch_overhead(reps: int, batches: int) -> None:
    """The same comparison on 1-byte arrays, where stacking costs next to nothing: the core's own cost."""
    times = interleave(stack_cases((1,), batches)[0], reps)
    hand, bf = statistics.median(times["hand"]), statistics.median(times["bridgeflow"])
    emit(bench="core", case="batch_overhead", shape=[1], dtype="uint8", batch=BATCH, batches=batches, reps=reps,
         hand_us_per_batch=round(hand * BATCH * 1e6, 2), bridgeflow_us_per_batch=round(bf * BATCH * 1e6, 2),
         overhead_us_per_batch=round((bf - hand) * BATCH * 1e6, 2),
         overhead_us_per_dp=round((bf - hand) * 1e6, 4), **machine())


def bench_map_chain(reps: int, datapoints: int, wrappers: int = 5) -> None:
    payload = np.zeros(4, np.float32)
    source = DataFromList([[payload, i] for i in range(datapoints)], shuffle=False)
    chain = source
    for _ in range(wrappers):
        chain = MapData(chain, lambda dp: dp)  # identity: only the wrapper's own cost remains
    chain.reset_state()

    def count(df) -> Callable[[], int]:
        def run() -> int:
            n = 0
            for _ in df:
                n += 1
            return n
        return run

    times = interleave({"bare": count(source), "chain": count(chain)}, reps)
    bare, chained = statistics.median(times["bare"]), statistics.median(times["chain"])
    per_wrapper = [(c - b) / wrappers * 1e6 for b, c in zip(times["bare"], times["chain"])]
    emit(bench="core", case="map_chain", wrappers=wrappers, datapoints=datapoints, reps=reps,
         bare_us_per_dp=round(bare * 1e6, 4), chain_us_per_dp=round(chained * 1e6, 4),
         per_wrapper_us=round((chained - bare) / wrappers * 1e6, 4),
         per_wrapper_us_per_rep=[round(x, 4) for x in per_wrapper], **machine())


class _ListBefore(RNGDataFlow, resumable=False):
    """DataFromList as it was before it had a state (a shuffled epoch: a permutation, indexed)."""

    def __init__(self, lst, seed):
        self.lst, self.seed = lst, seed

    def __iter__(self):
        lst = self.lst
        for i in self.rng.permutation(len(lst)):
            yield lst[i]


class _MapBefore(DataFlow, resumable=False):
    def __init__(self, ds, func):
        self.ds, self.func = ds, func

    def reset_state(self):
        self.ds.reset_state()

    def __iter__(self):
        func = self.func
        types = _DATAPOINT_TYPES
        for dp in self.ds:
            out = func(dp)
            if out is None:
                continue
            if type(out) not in types:
                check_datapoint(out, "MapData function")
            yield out


class _BatchBefore(DataFlow, resumable=False):
    def __init__(self, ds, batch_size):
        self.ds, self.batch_size = ds, batch_size

    def reset_state(self):
        self.ds.reset_state()

    def __iter__(self):
        bs, use_list, pad = self.batch_size, False, None
        holder: list = []
        for dp in self.ds:
            holder.append(dp)
            if len(holder) == bs:
                yield batch_datapoints(holder, use_list, pad)
                holder = []


def bench_state(reps: int, datapoints: int) -> None:
    data = [[np.zeros(4, np.float32), i] for i in range(datapoints)]
    identity = lambda dp: dp
    tracked = BatchData(MapData(DataFromList(data, shuffle=True, seed=0), identity), BATCH)
    baseline = _BatchBefore(_MapBefore(_ListBefore(data, 0), identity), BATCH)
    saving = BatchData(MapData(DataFromList(data, shuffle=True, seed=0), identity), BATCH)
    for df in (tracked, baseline, saving):
        df.reset_state()

    def count(df, save=False) -> Callable[[], int]:
        def run() -> int:
            n = 0
            for _ in df:
                n += BATCH
                if save:
                    df.state_dict()
            return n
        return run

    times = interleave({"baseline": count(baseline), "tracked": count(tracked), "saving": count(saving, True)},
                       reps)
    base, tr, sv = (statistics.median(times[k]) for k in ("baseline", "tracked", "saving"))
    emit(bench="core", case="state_bookkeeping", datapoints=datapoints, batch=BATCH, reps=reps,
         baseline_us_per_dp=round(base * 1e6, 4), tracked_us_per_dp=round(tr * 1e6, 4),
         ratio_tracked=round(base / tr, 4), ratio_state_every_batch=round(base / sv, 4),
         state_dict_us=round((sv - tr) * BATCH * 1e6, 2), target=0.98, meets_target=base / tr >= 0.98,
         ratio_tracked_per_rep=[round(b / t, 3) for b, t in zip(times["baseline"], times["tracked"])],
         **machine())


def bench_local_shuffle(reps: int, datapoints: int) -> None:
    for buffer in (1000, 50_000):
        data = [[i] for i in range(datapoints + buffer)]
        bare = DataFromList(data, shuffle=False)
        shuffled = LocallyShuffleData(DataFromList(data, shuffle=False), buffer, seed=0)
        for df in (bare, shuffled):
            df.reset_state()
        streams = {"bare": iter(RepeatedDataForever(bare)), "shuffled": iter(RepeatedDataForever(shuffled))}

        def take(it) -> Callable[[], int]:
            def run() -> int:
                for _ in range(datapoints // 4):
                    next(it)
                return datapoints // 4
            return run

        times = interleave({name: take(it) for name, it in streams.items()}, reps)
        base, lsd = statistics.median(times["bare"]), statistics.median(times["shuffled"])
        deep_data = [[i] for i in range(max(datapoints, 20 * buffer) + buffer)]
        deep = LocallyShuffleData(DataFromList(deep_data, shuffle=False), buffer, seed=0)
        it = iter(RepeatedDataForever(deep))
        for _ in range(max(datapoints, 20 * buffer)):  # deep enough for the buffer's oldest to settle
            next(it)
        t0 = time.perf_counter()
        state = deep.state_dict()
        state_us = (time.perf_counter() - t0) * 1e6
        text = json.dumps(state)
        again = LocallyShuffleData(DataFromList(deep_data, shuffle=False), buffer, seed=0)
        again.load_state_dict(json.loads(text))
        t0 = time.perf_counter()
        resumed = iter(again)
        resume_s = time.perf_counter() - t0
        assert next(resumed) == next(it)
        emit(bench="core", case="local_shuffle", buffer=buffer, datapoints=datapoints, reps=reps,
             bare_us_per_dp=round(base * 1e6, 4), added_us_per_dp=round((lsd - base) * 1e6, 4),
             state_dict_us=round(state_us, 1), state_bytes=len(text),
             replay_buffers=round(state["replay"] / buffer, 2), resume_s=round(resume_s, 3), **machine())


def _identity(dp):
    return dp


def bench_state_pipelines(reps: int) -> None:
    """``state_dict()`` of five-stage pipelines as users build them, deep into an epoch: wall and CPU
    microseconds per call (median of ``reps`` rounds of 500 calls), and the state's size as JSON. Then the
    largest state: ``LocallyShuffleData(2000)`` over an unordered thread stage of 64 KB arrays (its buffer is
    in the state), seconds for one ``state_dict()`` and ``json.dumps``, and megabytes."""
    data = [[np.zeros(4, np.float32), i] for i in range(100_000)]
    listed = lambda: DataFromList(data, shuffle=True, seed=0)
    pipelines = {
        "list_map_map_map_batch": lambda: BatchData(MapData(MapData(MapData(listed(), _identity), _identity),
                                                            _identity), 64),
        "list_map_threads_map_batch": lambda: BatchData(MapData(MultiThreadMapData(
            MapData(listed(), _identity), 2, _identity, seed=1), _identity), 64),
        "list_map_localshuffle_map_batch": lambda: BatchData(MapData(LocallyShuffleData(
            MapData(listed(), _identity), 1000, seed=1), _identity), 64),
        "list+fake_join_map_repeat_batch": lambda: BatchData(RepeatedData(MapData(JoinData(
            [DataFromList(data, shuffle=False), FakeData([[1]], size=len(data), seed=1)]), _identity), 2), 64),
    }
    for name, make in pipelines.items():
        df = make()
        df.reset_state()
        it = iter(df)
        for _ in range(100):
            next(it)
        walls, cpus = [], []
        for _ in range(reps):
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(500):
                state = df.state_dict()
            walls.append((time.perf_counter() - w0) / 500)
            cpus.append((time.process_time() - c0) / 500)
        emit(bench="core", case="state_dict", pipeline=name, reps=reps,
             wall_us=round(statistics.median(walls) * 1e6, 1), cpu_us=round(statistics.median(cpus) * 1e6, 1),
             state_bytes=len(json.dumps(state)), **machine())
        df.close()
    arrays = [[np.full(16384, i, np.float32)] for i in range(3000)]
    df = LocallyShuffleData(MultiThreadMapData(DataFromList(arrays, shuffle=False), 2, _identity, ordered=False),
                            2000, seed=1)
    df.reset_state()
    it = iter(df)
    for _ in range(100):
        next(it)
    w0, c0 = time.perf_counter(), time.process_time()
    state = df.state_dict()
    w1, c1 = time.perf_counter(), time.process_time()
    text = json.dumps(state)
    emit(bench="core", case="state_dict_largest", pipeline="LocallyShuffleData(unordered thread stage, 64 KB), 2000",
         state_dict_s=round(w1 - w0, 3), state_dict_cpu_s=round(c1 - c0, 3),
         json_dumps_s=round(time.perf_counter() - w1, 3), state_mb=round(len(text) / 1e6, 1), **machine())
    df.close()


class RepeatedDataForever:
    """Epoch after epoch of a flow, as one iterator."""

    def __init__(self, df: DataFlow) -> None:
        self.df = df

    def __iter__(self):
        while True:
            yield from self.df


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions per case (median; >= 5)")
    parser.add_argument("--batches", type=int, default=60, help="batches of 64 per batch_stack repetition")
    parser.add_argument("--datapoints", type=int, default=200_000, help="datapoints per map_chain repetition")
    args = parser.parse_args()
    if args.reps < 5:
        parser.error("--reps must be >= 5 (the median of fewer says little on a shared machine)")
    bench_batch_stack(args.reps, args.batches)
    bench_batch_overhead(args.reps, 2000)
    bench_map_chain(args.reps, args.datapoints)
    bench_state(args.reps, args.datapoints)
    bench_local_shuffle(args.reps, max(args.datapoints, 400_000))
    bench_state_pipelines(args.reps)


if __name__ == "__main__":
    main()
