"""SIGKILL worker processes at random moments and compare every epoch with an undisturbed run.

Each run is drawn from ``(seed, index)``: its kind, the sizes (datapoints, batch size, bytes per datapoint: some
runs send arrays of 32 KiB and more, which travel in shared-memory slabs), how long the work takes per
datapoint, and 1 to 3 moments at which a killer thread sends SIGKILL to a random live worker of the pipeline:
once a random share of the run's datapoints has been received, plus up to 20 ms, and at least ``MIN_GAP`` after
the last kill. The pipeline runs with ``max_restarts`` above the kills and holds every batch of an
epoch until the epoch ends (so arrays in the slabs of dead workers are read after their workers died); then:

- ``ordered``: ``BatchData(MultiProcessMapData(source, 2, f, ordered=True), B)`` (batched in the workers):
  every batch equals the undisturbed one, in order (``exact``);
- ``unordered``: the same with ``ordered=False, strict=True``: each epoch's datapoints are the source's, each
  once (``multiset``);
- ``runner``: ``MultiProcessRunner`` of 2 workers over a resumable flow whose datapoints carry their worker
  copy's tag and number: the datapoints of each worker are its copy's stream, numbered 0, 1, 2... without a
  gap or a repeat (``per-worker stream``: how the workers interleave is timing's, as in every run);
- ``loader``: bridgeflow's torch ``DataLoader`` over a map-style dataset, ``num_workers=2``, shuffled from a
  seeded generator: every batch equals the one ``num_workers=0`` gives (``exact``).

A worker is killed while both hold tasks (it peeks at the pool's bookkeeping). A run also checks that
``stats()`` counts no more restarts than kills reached a live worker (a worker killed after it sent the last
result the run needs from it is never waited for, so its death goes unnoticed and uncounted: the summary
gives both sums, and the runs with a restart), that no process,
thread or shared-memory segment is left after it, and that it ends within ``--timeout`` seconds. One JSON line
per failed run; a summary line per kind.

The killer signals only live children of this process, held by a pidfd (``tests/deaths.py``): a worker's pid,
freed once the pool reaped it, may belong to any process of the machine a moment later. And a run that has more
than ``MAX_CHILDREN`` child processes at once ends the script (a pool restarting without end): run it under a
pids limit too (``ulimit`` does not bound root; a pids cgroup does).

Examples:
    python tests/fuzz/fuzz_restart.py --runs 200 --seed 0 > results.jsonl
    python tests/fuzz/fuzz_restart.py --only 17 --seed 0 --verbose
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import functools
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

import bridgeflow as bf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for deaths.py
from deaths import kill_child
from procs import children

KINDS = ("ordered", "unordered", "runner", "loader")
SLAB_BYTES = 32 * 1024  # arrays this large travel in shared memory
# Seconds between two kills at least: the same worker killed again while it runs a dead worker's batch once more
# would count as a second death of that batch, which two deaths make a poison batch (raised, not run again)
MIN_GAP = 0.25
MAX_CHILDREN = 24  # child processes at once: 2 workers, the ones being replaced, torch's helpers; more is a runaway


def draw(seed: int, index: int, kinds: tuple[str, ...] = KINDS) -> dict:
    """Run ``index`` of ``seed``: a plain dict (it goes into the failure lines as it is)."""
    rng = random.Random(f"{seed}:{index}")
    kind = kinds[index % len(kinds)]
    big = rng.random() < 0.5
    return {
        "kind": kind,
        "n": rng.randrange(40, 160),  # datapoints per epoch
        "batch": rng.choice([1, 2, 4, 8]),
        "width": rng.choice([SLAB_BYTES // 8 + rng.randrange(512), 4 * SLAB_BYTES // 8]) if big else
        rng.choice([1, 64]),
        "work_ms": rng.choice([0.3, 1.0, 3.0]),
        # when to kill: once this share of the run's datapoints was received, plus a few milliseconds
        "kills": sorted(round(rng.uniform(0.02, 0.9), 3) for _ in range(rng.randint(1, 3))),
        "delays": [round(rng.uniform(0.0, 0.02), 4) for _ in range(3)],
        "victims": [rng.random() for _ in range(3)],
        "seed": rng.randrange(1 << 20),
    }


# --- the pipelines --------------------------------------------------------------------------------


def work(dp: list, width: int, work_ms: float) -> list:
    """The map function: deterministic, ``width`` int64 per datapoint, ``work_ms`` of busy time."""
    if work_ms:
        end = time.perf_counter() + work_ms / 1000
        while time.perf_counter() < end:
            pass
    x = dp[0]
    return [np.arange(width, dtype=np.int64) + x, x]


class Tagged(bf.RNGDataFlow):
    """A resumable flow for the runner: ``[tag, i, array]``, ``tag`` drawn from the copy's seed at its reset."""

    def __init__(self, n: int, width: int, work_ms: float) -> None:
        self.n, self.width, self.work_ms, self.i, self.tag = n, width, work_ms, 0, -1

    def __len__(self) -> int:
        return self.n

    def reset_state(self) -> None:
        super().reset_state()
        self.tag, self.i = int(self.rng.randint(1 << 30)), 0

    def __iter__(self) -> Any:
        while True:
            i = self.i
            self.i += 1
            yield [self.tag, i, work([i], self.width, self.work_ms)[0]]

    def state_dict(self) -> dict:
        return {"i": self.i, "tag": self.tag}

    def load_state_dict(self, state: dict) -> None:
        self.i, self.tag = state["i"], state["tag"]


def build(spec: dict, restarts: int, workers: int = 2) -> Any:
    """The pipeline of ``spec`` (a DataFlow, or a DataLoader) and the stage whose pool has the workers (None
    for the loader: its iterator's)."""
    kind, n, width, work_ms = spec["kind"], spec["n"], spec["width"], spec["work_ms"]
    f = functools.partial(work, width=width, work_ms=work_ms)
    if kind in ("ordered", "unordered"):
        src = bf.DataFromList([[i] for i in range(n)], shuffle=False)
        stage = bf.MultiProcessMapData(src, 2, f, buffer_size=16, ordered=kind == "ordered",
                                       strict=kind == "unordered", seed=spec["seed"], max_restarts=restarts)
        return bf.BatchData(stage, spec["batch"], remainder=True), stage
    if kind == "runner":
        stage = bf.MultiProcessRunner(Tagged(n, width, work_ms), 8, 2, seed=spec["seed"], max_restarts=restarts)
        return stage, stage
    import torch

    from bridgeflow.adapters.torch import DataLoader
    loader = DataLoader(Samples(n, width, work_ms), batch_size=spec["batch"], shuffle=True,
                        generator=torch.Generator().manual_seed(spec["seed"]), num_workers=workers,
                        max_restarts=restarts)
    return loader, None


class Samples:
    """A map-style dataset for the loader: sample ``i`` is ``work([i])``'s array as a tensor."""

    def __init__(self, n: int, width: int, work_ms: float) -> None:
        self.n, self.width, self.work_ms = n, width, work_ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch
        return torch.from_numpy(work([i], self.width, self.work_ms)[0])


def epochs_of(spec: dict, restarts: int, kill: bool, workers: int = 2) -> tuple[list, int, int]:
    """Two epochs of the run's pipeline (killed at the spec's moments when ``kill``), each as a list of
    batches in plain numbers; the kills that reached a live worker; the restarts ``stats()`` counted."""
    flow, stage = build(spec, restarts, workers)
    out: list = []
    delivered = 0
    counted = 0
    stop = threading.Event()
    current: list = [None]  # the loader's iterator: its pool has the workers
    received = [0]  # datapoints received so far
    total = 2 * spec["n"]

    def live() -> list[int]:
        """The workers' pids, when both are up and the chosen victim holds tasks (a worker that has sent every
        result the run needs from it may die unnoticed: no kill then)."""
        if stage is not None:
            pool = stage._pool
        else:
            it = current[0]
            pool = it._pool._pool if it is not None and it._pool is not None else None
        if pool is None or pool._supervisor is None:
            return []
        pids = list(pool.pids)
        return pids if len(pids) == 2 and all(pool._supervisor.held) else []

    def killer() -> None:
        nonlocal delivered
        last = 0.0
        for share, delay, victim in zip(spec["kills"], spec["delays"], spec["victims"]):
            while received[0] < share * total or time.monotonic() < last + MIN_GAP:
                if stop.wait(0.002):
                    return
            if stop.wait(delay):
                return
            pids: list[int] = []
            while len(pids) != 2:  # a worker being replaced (or the next epoch's starting): wait for them
                if stop.wait(0.002):
                    return
                pids = live()
            if kill_child(pids[int(victim * len(pids))], signal.SIGKILL):
                delivered += 1
            last = time.monotonic()

    thread = threading.Thread(target=killer, daemon=True)
    try:
        if spec["kind"] == "loader":
            for _ in range(2):
                current[0] = iter(flow)
                if kill and not thread.is_alive() and not out:
                    thread.start()
                held = []  # every batch held until the epoch ends
                for batch in current[0]:
                    held.append(batch)
                    received[0] += len(batch)
                out.append([b.tolist() for b in held])
                counted += flow.stats().get("DataLoader", {}).get("restarts", 0)  # a pool per epoch
                current[0] = None
        else:
            with flow:
                if kill:
                    thread.start()
                for _ in range(2):
                    held = []  # every batch held until the epoch ends
                    for dp in flow:
                        held.append(dp)
                        received[0] += 1 if spec["kind"] == "runner" else len(dp[1])
                    if spec["kind"] == "runner":
                        out.append([[int(dp[0]), int(dp[1]), int(dp[2][0]), int(dp[2][-1])] for dp in held])
                    else:
                        out.append([[b[0][:, 0].tolist(), b[0][:, -1].tolist(), b[1].tolist()] for b in held])
                counted = stage._pool.restarts if stage._pool is not None else 0
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
    return out, delivered, counted


def reference(spec: dict) -> Any:
    """The undisturbed run's epochs."""
    kind, n, batch, width = spec["kind"], spec["n"], spec["batch"], spec["width"]
    if kind == "loader":
        return epochs_of(spec, 0, kill=False, workers=0)[0]
    if kind == "runner":
        return None
    rows = [[i, i + width - 1, i] for i in range(n)]
    batches = [rows[i:i + batch] for i in range(0, n, batch)]
    epoch = [[[r[0] for r in b], [r[1] for r in b], [r[2] for r in b]] for b in batches]
    return [epoch, epoch]


def compare(spec: dict, got: list, ref: Any) -> str | None:
    """None when ``got`` keeps the kind's promise, else what is wrong."""
    kind = spec["kind"]
    if kind in ("ordered", "loader"):
        for e, (a, b) in enumerate(zip(got, ref)):
            if a != b:
                first = next(i for i, (x, y) in enumerate(zip(a + [None], b + [None])) if x != y)
                return f"epoch {e}: batch {first} differs (or the count: {len(a)} vs {len(b)})"
        return None
    if kind == "unordered":
        for e, epoch in enumerate(got):
            values = sorted(v for b in epoch for v in b[2])
            if values != list(range(spec["n"])):
                return f"epoch {e}: the datapoints are not the source's, each once ({len(values)} of {spec['n']})"
            for b in epoch:
                if [x + spec["width"] - 1 for x in b[0]] != b[1] or b[0] != b[2]:
                    return f"epoch {e}: a batch's arrays do not hold its datapoints' values"
        return None
    streams: dict[int, list[int]] = collections.defaultdict(list)
    for e, epoch in enumerate(got):
        if len(epoch) != spec["n"]:
            return f"epoch {e}: {len(epoch)} datapoints, not {spec['n']}"
        for tag, i, first, last in epoch:
            if first != i or last != i + spec["width"] - 1:
                return f"a datapoint's array does not hold its number {i}"
            streams[tag].append(i)
    if len(streams) > 2:
        return f"{len(streams)} worker streams (tags), not 2: a restarted copy drew another tag"
    for tag, numbers in streams.items():
        if numbers != list(range(len(numbers))):
            return f"worker stream {tag} is not 0, 1, 2... without a gap or a repeat: {numbers[:40]}"
    return None


def _left() -> tuple[set[int], set[str], set[str]]:
    """This process's live children, its shared-memory segments and its other non-daemon threads."""
    shm = {s for s in os.listdir("/dev/shm") if s.startswith(f"bf{os.getpid()}_")}
    threads = {f"{t.name}@{t.ident}" for t in threading.enumerate()
               if t is not threading.main_thread() and t.is_alive() and not t.daemon}
    return children(), shm, threads


def leaks(before: tuple[set[int], set[str], set[str]]) -> str | None:
    """What the run left that was not there before it (``_left()`` then): in the suite, this process has run
    other tests, whose leftovers are theirs to answer for."""
    import gc
    gc.collect()
    deadline = time.monotonic() + 10
    while True:
        children, shm, threads = (now - then for now, then in zip(_left(), before))
        if not (children or shm or threads):
            return None
        if time.monotonic() > deadline:
            return f"left behind: processes {sorted(children)}, segments {sorted(shm)[:5]}, threads {sorted(threads)}"
        time.sleep(0.05)


def _bound_children(stop: threading.Event, spec: dict) -> None:
    """End this process when it has more than ``MAX_CHILDREN`` children at once: a pool that restarts its
    workers without end must not go on forking (the processes under it exit with it: they watch their parent)."""
    while not stop.wait(0.5):
        n = len(children())
        if n > MAX_CHILDREN:
            sys.stderr.write(json.dumps({"status": "runaway", "children": n, "spec": spec}) + "\n")
            sys.stderr.flush()
            os._exit(3)


def check_run(seed: int, index: int, timeout: float | None = 120.0, kinds: tuple[str, ...] = KINDS) -> dict:
    """Run ``index`` of ``seed`` and check it; ``timeout``: seconds before a hang ends the process with every
    thread's stack (None: the caller guards, e.g. pytest's hang guard)."""
    spec = draw(seed, index, kinds)
    result: dict = {"seed": seed, "index": index, "spec": spec, "status": "ok"}
    before = _left()
    if timeout is not None:
        faulthandler.dump_traceback_later(timeout, exit=True)
    stop = threading.Event()
    bound = threading.Thread(target=_bound_children, args=(stop, spec), name="fuzz-children-bound", daemon=True)
    bound.start()
    try:
        ref = reference(spec)
        got, delivered, counted = epochs_of(spec, restarts=len(spec["kills"]) + 3, kill=True)
        result.update(kills=delivered, restarts=counted)
        wrong = compare(spec, got, ref)
        if wrong is None and not counted <= delivered:
            wrong = f"stats() counted {counted} restarts for {delivered} kills"
        if wrong is not None:
            result.update(status="wrong", why=wrong)
    except Exception as exc:
        result.update(status="error", why=f"{type(exc).__name__}: {exc}"[:2000], trace=traceback.format_exc()[-3000:])
    finally:
        stop.set()
        bound.join()
        if timeout is not None:
            faulthandler.cancel_dump_traceback_later()
    left = leaks(before)
    if left is not None and result["status"] == "ok":
        result.update(status="leak", why=left)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", type=int, nargs="*", help="run these indices only")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take (a hang ends the script)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    indices = args.only if args.only else range(args.runs)
    summary: dict = collections.defaultdict(lambda: collections.Counter())
    started = time.monotonic()
    for index in indices:
        result = check_run(args.seed, index, args.timeout, kinds)
        kind = result["spec"]["kind"]
        summary[kind]["runs"] += 1
        summary[kind][result["status"]] += 1
        summary[kind]["kills"] += result.get("kills", 0)
        summary[kind]["restarts"] += result.get("restarts", 0)
        summary[kind]["runs with a restart"] += result.get("restarts", 0) > 0
        if result["status"] != "ok" or args.verbose:
            print(json.dumps(result), flush=True)
    for kind, counts in summary.items():
        print(json.dumps({"kind": kind, **counts}), flush=True)
    print(json.dumps({"runs": len(indices), "seconds": round(time.monotonic() - started, 1),
                      "failed": sum(c["runs"] - c["ok"] for c in summary.values())}), flush=True)
    return 0 if all(c["runs"] == c["ok"] for c in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
