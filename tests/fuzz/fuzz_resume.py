"""Resume random pipelines at random points: a resumed flow must yield what the uninterrupted one yields.

Each pipeline is drawn from a seed: a source (a list, FakeData, a generator function, an LMDB, HDF5 or npz
file, shuffled or not) under up to four wrappers (map, filter, batch and unbatch, repeat, repeat each
datapoint, fixed size, cache, local shuffle, shard, concat, join, random mix, thread and process map stages,
ordered or not, strict or not, with a BatchData over them batching in the workers). The reference is three
uninterrupted epochs. Then, for resume points in several epochs (after 0, 1, a few, all datapoints), a new
pipeline iterates to the point, saves its state through ``json``, and a third pipeline loads it and reads
the rest: the rest of that epoch and the following ones must equal the reference's. Where an unordered
stage makes the order a matter of timing, a strict one's stretch is compared as a multiset (the rest of
the epoch being what the first run had not received), a carried one's by its counts only.

One JSON line per pipeline that failed or raised, and a summary line. Pipelines run in this process;
``--seed`` and ``--pipelines`` pick them, so two trees given the same arguments run the same pipelines.
Uses only bridgeflow's public API. Not collected by pytest.

Example:
    python tests/fuzz/fuzz_resume.py --pipelines 200 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np

import bridgeflow as bf

EPOCHS = 3
N_FILE = 11  # datapoints of the file sources
ORDERED_ONLY = False  # --ordered-only: no unordered stage, so every failure is the library's, not timing's


# --- functions the stages run (module level, so process workers can use them) -----------------------------

def inc_last(dp: Any) -> list:
    return [*list(dp)[:-1], np.asarray(dp[-1]) + 1]


def drop_thirds(dp: Any) -> list | None:
    return None if int(np.sum(dp[0])) % 3 == 0 else list(dp)


def keep(dp: Any) -> bool:
    return int(np.sum(dp[0])) % 4 != 1


def generated(n: int) -> Any:
    def make() -> Any:
        return ([np.int64(i)] for i in range(n))
    return make


# --- pipelines from specs -----------------------------------------------------------------------------


class Files:
    def __init__(self, folder: str) -> None:
        data = [[np.int64(100 + i)] for i in range(N_FILE)]
        self.paths = {"lmdb": os.path.join(folder, "d.lmdb"), "hdf5": os.path.join(folder, "d.h5"),
                      "npz": os.path.join(folder, "d.npz")}
        bf.LMDBSerializer.save(bf.DataFromList(data, shuffle=False), self.paths["lmdb"])
        bf.HDF5Serializer.save(bf.DataFromList(data, shuffle=False), self.paths["hdf5"], ["x"])
        bf.NumpySerializer.save(bf.DataFromList(data, shuffle=False), self.paths["npz"])

    def load(self, kind: str, shuffle: bool, seed: int) -> Any:
        if kind == "lmdb":
            return bf.LMDBSerializer.load(self.paths[kind], shuffle=shuffle, seed=seed)
        if kind == "hdf5":
            return bf.HDF5Serializer.load(self.paths[kind], ["x"], shuffle=shuffle, seed=seed)
        return bf.NumpySerializer.load(self.paths[kind], shuffle=shuffle, seed=seed)


def draw_source(r: random.Random) -> tuple:
    kind = r.choice(["list", "list", "fake", "gen", "lmdb", "hdf5", "npz"])
    n = r.randint(3, 12)
    return (kind, n, r.random() < 0.5, r.randrange(1000))


def draw(r: random.Random, depth: int) -> tuple:
    if depth == 0 or r.random() < 0.25:
        return draw_source(r)
    kind = r.choice(["map", "filter", "batch", "unbatch", "repeat", "repeat_dp", "fixed", "cache", "shuffle",
                     "shard", "concat", "join", "mix", "tmap", "tmap", "pmap", "fused"])
    child = draw(r, depth - 1)
    if kind in ("concat", "join", "mix"):
        return (kind, [child, draw(r, depth - 1)], r.randrange(1000))
    if kind in ("tmap", "pmap", "fused"):
        return (kind, child, r.randint(1, 2), r.random() < 0.75 or ORDERED_ONLY, r.random() < 0.5,
                r.random() < 0.2, r.randint(1, 4), r.random() < 0.5)
    return (kind, child, r.randint(1, 4), r.random() < 0.5, r.randrange(1000))


def make(spec: tuple, files: Files) -> Any:
    kind = spec[0]
    if kind == "list":
        _, n, shuffle, seed = spec
        return bf.DataFromList([[np.int64(i)] for i in range(n)], shuffle=shuffle, seed=seed)
    if kind == "fake":
        _, n, _, seed = spec
        return bf.FakeData([[2]], size=n, dtype="int64", domain=(0, 999), seed=seed)
    if kind == "gen":
        return bf.DataFromGenerator(generated(spec[1]), size=spec[1])
    if kind in ("lmdb", "hdf5", "npz"):
        return files.load(kind, spec[2], spec[3])
    if kind in ("concat", "join", "mix"):
        parts = [make(s, files) for s in spec[1]]
        return {"concat": lambda: bf.ConcatData(parts), "join": lambda: bf.JoinData(parts),
                "mix": lambda: bf.RandomMixData(parts, seed=spec[2])}[kind]()
    if kind in ("tmap", "pmap", "fused"):
        _, child, workers, ordered, strict, drop, batch, remainder = spec
        func = drop_thirds if drop and ordered else inc_last  # unordered and dropping: epochs are timing's
        src = make(child, files)
        if kind == "pmap" or (kind == "fused" and workers == 2):
            stage = bf.MultiProcessMapData(src, workers, func, buffer_size=6, strict=strict, ordered=ordered,
                                           start_method="fork", seed=1)
        else:
            stage = bf.MultiThreadMapData(src, workers, func, buffer_size=6, strict=strict, ordered=ordered, seed=1)
        return bf.BatchData(stage, batch, remainder=remainder) if kind == "fused" else stage
    _, child, k, flag, seed = spec
    c = make(child, files)
    if kind == "map":
        return bf.MapData(c, inc_last)
    if kind == "filter":
        return bf.FilterData(c, keep)
    if kind == "batch":
        return bf.BatchData(c, k, remainder=flag)
    if kind == "unbatch":
        return bf.UnbatchData(bf.BatchData(c, k, remainder=True))
    if kind == "repeat":
        return bf.RepeatedData(c, min(k, 2))
    if kind == "repeat_dp":
        return bf.RepeatedDataPoint(c, min(k, 2))
    if kind == "fixed":
        return bf.FixedSizeData(c, k + 2, keep_state=flag)
    if kind == "cache":
        return bf.CacheData(c, shuffle=flag, seed=seed)
    if kind == "shuffle":
        return bf.LocallyShuffleData(c, k + 1, seed=seed, one_pass=flag)
    if kind == "shard":
        world = min(k, 3) if k > 1 else 2
        return bf.ShardData(c, seed % world, world, drop_last=flag)
    raise ValueError(kind)


def looseness(spec: tuple) -> int:
    """0: the order is exact; 1: a strict unordered stage (each stretch is a multiset); 2: a carried unordered
    stage (which results make an epoch depends on timing too: only the counts are checked)."""
    own = 0
    if spec[0] in ("tmap", "pmap", "fused") and not spec[3]:
        own = 1 if spec[4] else 2
    children = spec[1] if spec[0] in ("concat", "join", "mix") else [spec[1]] if isinstance(spec[1], tuple) else []
    return max([own, *(looseness(c) for c in children)])


def valid(spec: tuple, files: Files) -> bool:
    """Pipelines that cannot be built (a shard of a flow without length, say) are drawn again."""
    try:
        with make(spec, files) as df:
            df.reset_state()
            first = [next(iter(df), None)]
            return first[0] is not None
    except Exception:
        return False


# --- comparing ----------------------------------------------------------------------------------------


def key(dp: Any) -> Any:
    if isinstance(dp, dict):
        return ("d", tuple((k, key(v)) for k, v in sorted(dp.items())))
    if isinstance(dp, (list, tuple)):
        return ("l", tuple(key(v) for v in dp))
    a = np.asarray(dp)
    return ("a", a.dtype.str, a.shape, a.tobytes())


def epochs(df: Any, count: int, limit: int = 400) -> list[list]:
    out = []
    for _ in range(count):
        epoch = []
        for dp in df:
            epoch.append(key(dp))
            if len(epoch) >= limit:
                raise RuntimeError("an epoch longer than the limit")
        out.append(epoch)
    return out


def check(spec: tuple, files: Files, r: random.Random) -> dict:
    with make(spec, files) as df:
        ref = epochs(df, EPOCHS)
    loose = looseness(spec)
    points = 0
    failures = []
    for e in range(EPOCHS - 1):
        n = len(ref[e])
        for k in sorted({0, min(1, n), r.randint(0, n), n}):
            points += 1
            with make(spec, files) as a:
                for _ in range(e):
                    for _ in a:
                        pass
                it = iter(a)
                received = [key(dp) for _, dp in zip(range(k), it)]
                state = json.loads(json.dumps(a.state_dict()))
                it.close()
            with make(spec, files) as b:
                b.load_state_dict(state)
                got = epochs(b, EPOCHS - e)
            want = [ref[e][k:], *ref[e + 1:]]
            if loose == 2:
                same = [len(x) for x in got] == [len(x) for x in want]
            elif loose:  # the datapoints not received yet, in any order: what the first run received is timing's
                rest = collections.Counter(ref[e]) - collections.Counter(received)
                same = collections.Counter(sum(got, [])) == rest + collections.Counter(sum(ref[e + 1:], []))
            else:
                same = got == want
            if not same:
                failures.append({"epoch": e, "k": k, "got": [len(x) for x in got], "want": [len(x) for x in want]})
    return {"points": points, "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--only", type=int, nargs="*", help="run only these pipelines (their indices)")
    parser.add_argument("--ordered-only", action="store_true", help="no unordered stages (no timing in results)")
    args = parser.parse_args()
    global ORDERED_ONLY
    ORDERED_ONLY = args.ordered_only
    totals: collections.Counter = collections.Counter()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        files = Files(folder)
        for i in args.only if args.only else range(args.pipelines):
            r = random.Random(args.seed * 100_003 + i)
            spec = draw(r, args.depth)
            while not valid(spec, files):
                spec = draw(r, args.depth)
            try:
                result = check(spec, files, r)
            except Exception as exc:
                totals["raised"] += 1
                print(json.dumps({"pipeline": i, "spec": repr(spec), "raised": f"{type(exc).__name__}: {exc}",
                                  "where": traceback.format_exc().splitlines()[-3].strip()}), flush=True)
                continue
            totals["pipelines"] += 1
            totals["points"] += result["points"]
            totals["failed_points"] += len(result["failures"])
            if result["failures"]:
                print(json.dumps({"pipeline": i, "spec": repr(spec), "failures": result["failures"]}), flush=True)
    print(json.dumps({"summary": dict(totals), "seconds": round(time.perf_counter() - t0, 1),
                      "bridgeflow": os.path.dirname(bf.__file__)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
