"""Mutate real states of real pipelines: each must be refused with a StateError, or resume exactly.

For each *kind* of state (a source, a map, a local shuffle, a join, a batch, thread and process map stages,
a runner), a pipeline is iterated a few datapoints in, its state taken, and its uninterrupted rest (the rest
of the epoch and the next one) kept as the reference. A mutation replaces one field anywhere in the state
(or deletes it) with a value of another type, a negative or huge number, a live object, or a nearby number.
A fresh pipeline loads the mutated state and reads on. Outcomes:

- ``refused``: ``load_state_dict`` raised a :class:`~bridgeflow._state.StateError` whose message names the
  flow's path (what a damaged state must give);
- ``late``: the same error, but only at ``iter()``;
- ``same``: resumed to exactly the uninterrupted stream (the mutation hit nothing the flow uses, or the
  value was the same);
- ``other``: a plausible mutation (a nearby number, another string) resumed to another stream without
  an error: a valid position the flow could have saved, not counted as a failure;
- ``silent``: a mutation that no saved state can hold (another type, a negative or huge number, a live
  object, a missing field) resumed without an error to another stream: a silent wrong resume;
- ``foreign:<Type>``: any other exception; ``hang``: no end within the time limit.

Runner outputs interleave the workers by timing, so a runner's resume is compared as a multiset of
datapoints each worker can give, not in order. ``live`` objects record whether their ``__reduce__`` ran.

Example:
    python tests/fuzz/fuzz_states.py --kind MapData --mutations 5000 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bridgeflow import (
    BatchData,
    ConcatData,
    DataFromList,
    JoinData,
    LocallyShuffleData,
    MapData,
    MultiProcessMapData,
    MultiProcessRunner,
    MultiThreadMapData,
    RandomMixData,
    RepeatedData,
)
from bridgeflow._state import StateError

REDUCED: list[str] = []  # set by Live.__reduce__: a live object in a state was pickled


class Live:
    """A live object planted in a state: it must be refused before anything pickles it."""

    def __reduce__(self) -> tuple:
        REDUCED.append("reduced")
        return (Live, ())


def _src(n: int = 40, seed: int = 3) -> DataFromList:
    return DataFromList([[i] for i in range(n)], shuffle=True, seed=seed)


def _double(dp: list) -> list:
    return [dp[0] * 2]


KINDS: dict[str, Callable[[], Any]] = {
    "DataFromList": lambda: _src(),
    "MapData": lambda: MapData(_src(), _double),
    "LocallyShuffleData": lambda: LocallyShuffleData(_src(), 8),
    "JoinData": lambda: JoinData([_src(), _src(seed=5)]),
    "BatchData": lambda: BatchData(MapData(_src(), _double), 4),
    "MultiThreadMapData": lambda: MultiThreadMapData(_src(), 2, _double, buffer_size=8),
    "MultiProcessMapData": lambda: MultiProcessMapData(_src(), 2, _double, buffer_size=8),
    "MultiProcessRunner": lambda: MultiProcessRunner(MapData(_src(), _double), 4, 2),
    "FusedBatch": lambda: BatchData(MultiProcessMapData(_src(), 2, _double, buffer_size=8), 4),
    "ConcatData": lambda: ConcatData([_src(10), _src(30, seed=5)]),
    "RandomMixData": lambda: RandomMixData([_src(10), _src(30, seed=5)]),
    "RepeatedData": lambda: RepeatedData(_src(10), 3),
}
TAKEN = 7  # datapoints read before the state is taken


def _plain(dp: Any) -> Any:
    if isinstance(dp, np.ndarray):
        return dp.tolist()
    if isinstance(dp, (list, tuple)):
        return [_plain(v) for v in dp]
    if isinstance(dp, np.generic):
        return dp.item()
    return dp


def _epochs(df: Any, it: Any) -> list:
    """The rest of the epoch from ``it``, then one more epoch of ``df``."""
    return [_plain(dp) for dp in it] + [_plain(dp) for dp in df]


def reference(kind: str) -> tuple[dict, list]:
    """The state after ``TAKEN`` datapoints and the uninterrupted stream after it."""
    with KINDS[kind]() as df:
        it = iter(df)
        for _ in range(TAKEN):
            next(it)
        state = df.state_dict()
        return state, _epochs(df, it)


def leaves(state: Any, path: tuple = ()) -> list[tuple]:
    """Every path in the state (to dicts and lists too), the root excluded."""
    out = []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for k, v in items:
        out.append((*path, k))
        out.extend(leaves(v, (*path, k)))
    return out


DELETE = object()


def mutate(state: dict, path: tuple, value: Any) -> dict:
    s = copy.deepcopy(state)
    d = s
    for k in path[:-1]:
        d = d[k]
    if value is DELETE:
        if isinstance(d, dict):
            del d[path[-1]]
        else:
            d.pop(path[-1])
    else:
        d[path[-1]] = value
    return s


SEEDS = {"base", "epoch", "state", "inc", "key"}  # fields where any 64-bit number is a valid value


def impossible(key: Any, old: Any, value: Any) -> bool:
    """Whether no state this flow saves can hold ``value`` in field ``key``, where it held ``old``."""
    if value is DELETE or isinstance(value, Live):
        return True
    if type(old) is not type(value):
        return not (old is None or value is None)  # an optional field may hold None
    if isinstance(value, int) and not isinstance(value, bool):
        return value < 0 or value >= (1 << 64 if key in SEEDS else 10**9)
    return False


class _Hang(Exception):
    pass


def _alarm(*_: Any) -> None:
    raise _Hang


def run_one(kind: str, state: dict, ref: list, path: tuple, value: Any, limit: float = 20.0) -> str:
    """Load the mutated state into a fresh pipeline of ``kind`` and classify what happens."""
    old = state
    for k in path:
        old = old[k]
    mutated = mutate(state, path, value)
    df = KINDS[kind]()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    stage = "load"
    try:
        try:
            df.load_state_dict(mutated)
            stage = "iter"
            it = iter(df)
            got = _epochs(df, it)
        except StateError as exc:
            if type(df).__name__ not in str(exc):
                return f"foreign:{type(exc).__name__}(no path)"
            return "refused" if stage == "load" else "late"
        except _Hang:
            return "hang"
        except Exception as exc:  # what the fuzz is looking for
            return f"foreign:{type(exc).__name__}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        df.close()
    if kind == "MultiProcessRunner":
        same = _runner_plausible(got, ref)
    else:
        same = got == ref
    if same:
        return "same"
    return "silent" if impossible(path[-1], old, value) else "other"


def _runner_plausible(got: list, ref: list) -> bool:
    """Every datapoint one a worker could give (an even number below 80), and as many as the reference."""
    return len(got) == len(ref) and all(isinstance(dp, list) and dp[0] % 2 == 0 and 0 <= dp[0] < 80 for dp in got)


def values(old: Any, rng: np.random.Generator) -> Any:
    """One replacement value for a field that held ``old``."""
    choices: list = [DELETE, None, True, -1, -5, 10**9, 10**12, 2**64, 1.5, "x", [], {}, [1, 2], {"a": 1}, Live()]
    if isinstance(old, int) and not isinstance(old, bool):
        choices += [old + 1, old - 1, old * 2, -old - 1]
    if isinstance(old, str):
        choices += [old + "0", old[:-1], old.upper()]
    return choices[rng.integers(len(choices))]


def fuzz(kind: str, mutations: int, seed: int = 0, limit: float = 20.0) -> collections.Counter:
    state, ref = reference(kind)
    paths = leaves(state)
    rng = np.random.default_rng(seed)
    counts: collections.Counter = collections.Counter()
    for _ in range(mutations):
        path = paths[rng.integers(len(paths))]
        old = state
        for k in path:
            old = old[k]
        counts[run_one(kind, state, ref, path, values(old, rng), limit)] += 1
    counts["reduced"] = len(REDUCED)
    counts["leaked"] = len(leaks())
    return counts


def leaks(wait: float = 5.0) -> list[str]:
    """Child processes, threads and shared-memory segments of this process still there (after ``wait`` s)."""
    import os
    import threading

    deadline = time.monotonic() + wait
    while True:
        me = str(os.getpid())
        found = [f"pid {p}" for p in os.listdir("/proc") if p.isdigit() and _parent_of(p) == me]
        found += [f"thread {t.name}" for t in threading.enumerate() if t is not threading.main_thread()]
        found += [f"segment {n}" for n in os.listdir("/dev/shm") if n.startswith(f"bf{me}_")]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _parent_of(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[1] if fields[0] != "Z" else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=sorted(KINDS), action="append")
    parser.add_argument("--mutations", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bad = 0
    for kind in args.kind or sorted(KINDS):
        t0 = time.perf_counter()
        counts = fuzz(kind, args.mutations, args.seed)
        bad += sum(n for k, n in counts.items()
                   if k in ("silent", "hang", "reduced", "leaked") or k.startswith("foreign"))
        print(json.dumps({"kind": kind, "mutations": args.mutations, "seconds": round(time.perf_counter() - t0, 1),
                          **dict(sorted(counts.items()))}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
