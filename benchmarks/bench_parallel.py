"""Parallel stages against in-process iteration and torch's DataLoader (issue: parallel execution).

W1: map-style source of 3x224x224 uint8 + int label, trivial map, BatchData(64) after the parallel stage,
    2 workers.
W1-state: the W1 stage's state bookkeeping (what ``state_dict()`` needs) against the same stage with a
    ledger that records nothing (``untracked``: no snapshots of the source, no receipts; the counters
    remain), and with a ``state_dict()`` after every batch (``saving``), as a checkpointing loader does.
    Each configuration runs alone (its workers prefetch across epochs, which would slow whichever ran
    next), new per repetition, in alternating order; besides samples/s, the consumer thread's CPU time
    per batch, where all the bookkeeping runs, is less sensitive to a busy machine. ``paired`` is the
    median of the per-repetition ratios (the two runs of a repetition are seconds apart, so they share the
    machine's load); ``direct`` times the ledger calls the consumer makes per batch (one snapshot of the
    source's state, one receipt) on their own, as a share of the tracked stage's wall time per batch.
    ``state_dict`` times ``state_dict()`` on a stage with 2 process workers and 256 datapoints in flight.
W2: the same with ~2 ms of GIL-holding work per sample, and as the machine's ceiling two
    bare processes doing only that work (two-bare-processes / in-process is what two cores give here:
    2.0 on two free cores, less when the vCPUs share a core or a neighbour). W3: time to the first batch.
Configurations run interleaved, ``--reps`` times each (each time an untimed epoch, then three timed
consecutive epochs: see ``throughput``); one JSON line per result, then the ratios.

Run: python benchmarks/bench_parallel.py [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import bridgeflow as bf
from bridgeflow.parallel import MultiProcessMapData, MultiThreadMapData
from bridgeflow.parallel._progress import SourceLedger
from bridgeflow.parallel._resume_plan import MapCursor

BANK_SIZE = 512  # 77 MB of images: more than the caches hold, as with a real dataset
BATCH = 64
_bank: np.ndarray | None = None
_work_iters = 0


def bank() -> np.ndarray:
    global _bank
    if _bank is None:
        _bank = np.random.default_rng(0).integers(0, 256, (BANK_SIZE, 3, 224, 224), dtype=np.uint8)
    return _bank


def load(i: int) -> list:
    """The map-style dataset's __getitem__: an image and its label."""
    return [bank()[i % BANK_SIZE], i]


def busy(i: int) -> list:
    """~2 ms of numpy work in small pieces, so the GIL is held nearly all the time."""
    img, label = load(i)
    x = img[0, :16, :16].astype(np.int32)
    for _ in range(_work_iters):
        x = (x * 3 + 1) % 251
    return [img, label + int(x[0, 0]) * 0]


def calibrate(target_s: float = 0.002) -> int:
    global _work_iters
    _work_iters = 100
    t0 = time.perf_counter()
    for i in range(50):
        busy(i)
    per = (time.perf_counter() - t0) / 50
    _work_iters = max(1, int(100 * target_s / per))
    return _work_iters


def identity(dp):
    return dp


class TorchDataset:
    """A torch map-style Dataset returning numpy, as the issue prescribes."""

    def __init__(self, fn, n):
        self.fn, self.n = fn, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.fn(i)


def _bare_worker(fn, conn) -> None:
    while True:
        span = conn.recv()
        if span is None:
            return
        for i in range(*span):
            fn(i)
        conn.send(True)


class BareProcesses:
    """The machine's own ceiling for two workers: two forked processes apply ``fn`` to halves of each
    epoch and send nothing back (no transport, no collation, no batching). Yields ``n // 64`` empty
    batches once both are done, so ``epoch_rate`` can time it like a loader."""

    def __init__(self, fn, n: int) -> None:
        import multiprocessing as mp

        self.n = n
        ctx = mp.get_context("fork")
        self.conns, self.procs = [], []
        for _ in range(2):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_bare_worker, args=(fn, there), daemon=True)
            proc.start()
            self.conns.append(here)
            self.procs.append(proc)

    def __iter__(self):
        half = self.n // 2
        for k, conn in enumerate(self.conns):
            conn.send((k * half, self.n if k else half))
        for conn in self.conns:
            conn.recv()
        for _ in range(self.n // BATCH):
            yield None, range(BATCH)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            conn.send(None)
            proc.join()


class _NullLedger(SourceLedger):
    """Records nothing: the baseline for the cost of a stage's state bookkeeping."""

    def snapshot(self) -> None:
        self.next_snap = float("inf")

    def received(self, start: int, length: int) -> None:
        pass


class _UntrackedCursor(MapCursor):
    __slots__ = ()

    def new_ledger(self, ds: bf.DataFlow, loose: bool) -> SourceLedger:
        self.skips.clear()
        self.index_of.clear()
        self.ledger = _NullLedger(ds)
        return self.ledger


class UntrackedProcesses(MultiProcessMapData):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._cursor = _UntrackedCursor()


class Saving:
    """Iterates a flow and takes its state after every batch."""

    def __init__(self, df: bf.DataFlow) -> None:
        self.df = df

    def reset_state(self) -> None:
        self.df.reset_state()

    def __iter__(self):
        df = self.df
        for batch in df:
            df.state_dict()
            yield batch

    def close(self) -> None:
        self.df.close()


def source(n: int) -> bf.DataFlow:
    return bf.DataFromList(list(range(n)), shuffle=False)


def make(config: str, fn, n: int):
    if config == "in-process":
        return bf.BatchData(bf.MapData(source(n), fn), BATCH)
    if config == "bridgeflow-processes":
        return bf.BatchData(MultiProcessMapData(source(n), 2, fn, start_method="fork"), BATCH)
    if config == "bridgeflow-processes-unfused":  # a MapData between: batches are stacked in this process
        return bf.BatchData(bf.MapData(MultiProcessMapData(source(n), 2, fn, start_method="fork"), identity),
                            BATCH)
    if config == "bridgeflow-processes-untracked":
        return bf.BatchData(UntrackedProcesses(source(n), 2, fn, start_method="fork"), BATCH)
    if config == "bridgeflow-processes-saving":
        return Saving(bf.BatchData(MultiProcessMapData(source(n), 2, fn, start_method="fork"), BATCH))
    if config == "bridgeflow-threads":
        return bf.BatchData(MultiThreadMapData(source(n), 2, fn), BATCH)
    if config == "two-bare-processes":
        return BareProcesses(fn, n)
    if config == "torch-DataLoader":
        import torch.utils.data as tud

        return tud.DataLoader(TorchDataset(fn, n), batch_size=BATCH, num_workers=2, persistent_workers=True,
                              multiprocessing_context="fork")
    raise ValueError(config)


def epoch_rate(loader, n: int) -> float:
    t0 = time.perf_counter()
    count = 0
    for batch in loader:
        count += len(batch[1])
    dt = time.perf_counter() - t0
    assert count == n - n % BATCH, (count, n)
    return count / dt


def throughput(name: str, fn, n: int, configs: list[str], reps: int, epochs: int = 3) -> dict[str, float]:
    """Median samples/s of each configuration over ``reps`` interleaved repetitions.

    A repetition runs each configuration in turn: one untimed epoch, then ``epochs`` consecutive timed
    epochs. A non-strict bridgeflow stage keeps its workers mapping the next epoch when one ends; the
    untimed epoch absorbs what they did while the other configurations ran, and over a run of consecutive
    epochs the work in flight at the start matches the work in flight at the end, so prefetching across
    epoch boundaries counts only where a training loop would see it.
    """
    loaders = {}
    for c in configs:
        loader = make(c, fn, n)
        if isinstance(loader, (bf.DataFlow, Saving)):
            loader.reset_state()
        epoch_rate(loader, n)  # warm up: workers started, caches and shared memory in place
        loaders[c] = loader
    rates: dict[str, list[float]] = {c: [] for c in configs}
    for _ in range(reps):
        for c in configs:  # interleaved, so drift in machine load hits every configuration alike
            epoch_rate(loaders[c], n)
            t0 = time.perf_counter()
            for _ in range(epochs):
                epoch_rate(loaders[c], n)
            rates[c].append(epochs * (n - n % BATCH) / (time.perf_counter() - t0))
    for loader in loaders.values():
        if isinstance(loader, (bf.DataFlow, BareProcesses, Saving)):
            loader.close()
    medians = {}
    for c in configs:
        medians[c] = statistics.median(rates[c])
        emit(bench=name, config=c, median_samples_per_s=round(medians[c]), reps=[round(r) for r in rates[c]])
    return medians


def first_batch_time(config: str, fn, n: int) -> float:
    t0 = time.perf_counter()
    loader = make(config, fn, n)
    if isinstance(loader, bf.DataFlow):
        loader.reset_state()
    it = iter(loader)
    next(it)
    dt = time.perf_counter() - t0
    del it
    if isinstance(loader, bf.DataFlow):
        loader.close()
    return dt


def bookkeeping(n: int, reps: int, epochs: int = 10) -> None:
    """W1-state: tracked, untracked and saving stages, each alone, alternating; see the module doc."""
    names = {"tracked": "bridgeflow-processes", "untracked": "bridgeflow-processes-untracked",
             "saving": "bridgeflow-processes-saving"}
    rate: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    batches = epochs * (n // BATCH)
    for rep in range(reps):
        order = list(names) if rep % 2 == 0 else list(reversed(names))
        for key in order:
            loader = make(names[key], load, n)
            loader.reset_state()
            epoch_rate(loader, n)
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(epochs):
                epoch_rate(loader, n)
            cpu[key].append((time.thread_time() - c0) / batches)
            rate[key].append(batches * BATCH / (time.perf_counter() - t0))
            loader.close()
    med = {k: statistics.median(v) for k, v in rate.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    for key in names:
        emit(bench="W1-state", config=key, median_samples_per_s=round(med[key]), reps=[round(r) for r in rate[key]],
             consumer_cpu_us_per_batch=round(cpu_med[key] * 1e6, 1))
    wall_per_batch = BATCH / med["tracked"]
    emit(bench="W1-state", ratio="tracked/untracked", value=round(med["tracked"] / med["untracked"], 3), target=0.98,
         met=med["tracked"] / med["untracked"] >= 0.98)
    paired = statistics.median(t / u for t, u in zip(rate["tracked"], rate["untracked"]))
    emit(bench="W1-state", ratio="tracked/untracked paired", value=round(paired, 3), target=0.98, met=paired >= 0.98)
    emit(bench="W1-state", ratio="saving/untracked", value=round(med["saving"] / med["untracked"], 3))
    direct = ledger_cost(n)
    emit(bench="W1-state", cost="ledger calls per batch, timed alone / wall time per batch", us_per_batch=
         round(direct * 1e6, 2), share=round(direct / wall_per_batch, 4), target=0.02)
    emit(bench="W1-state", cost="consumer CPU of the bookkeeping / wall time per batch",
         tracked=round((cpu_med["tracked"] - cpu_med["untracked"]) / wall_per_batch, 4),
         saving=round((cpu_med["saving"] - cpu_med["untracked"]) / wall_per_batch, 4), target=0.02)


def ledger_cost(n: int, reps: int = 9) -> float:
    """Seconds per batch of the ledger calls a fused W1 stage makes per batch, on the real source."""
    times = []
    for _ in range(reps):
        df = source(n)
        df.reset_state()
        it = iter(df)
        ledger = SourceLedger(df)
        t0 = time.perf_counter()
        for start in range(0, n - BATCH + 1, BATCH):
            ledger.snapshot()  # the stage takes one every SNAPSHOT_EVERY (= BATCH) pulls
            for _ in range(BATCH):
                next(it)
            ledger.pulled += BATCH
            ledger.received(start, BATCH)
        t1 = time.perf_counter()
        it.close()
        it = iter(df)  # the same pulls without the ledger
        for _start in range(0, n - BATCH + 1, BATCH):
            for _ in range(BATCH):
                next(it)
        times.append(((t1 - t0) - (time.perf_counter() - t1)) / (n // BATCH))
        df.close()
    return statistics.median(times)


def state_dict_times(n: int, calls: int = 200) -> dict:
    """``state_dict()`` on a process stage (2 workers) with 256 datapoints in flight, between datapoints."""
    df = MultiProcessMapData(source(n), 2, load, buffer_size=256, start_method="fork")
    df.reset_state()
    it = iter(df)
    times, in_flight = [], []
    try:
        for _ in range(calls):
            next(it)
            in_flight.append(df._pool.outstanding)
            t0 = time.perf_counter()
            df.state_dict()
            times.append(time.perf_counter() - t0)
    finally:
        it.close()
        df.close()
    return {"median_ms": round(statistics.median(times) * 1e3, 4), "max_ms": round(max(times) * 1e3, 4),
            "calls": calls, "in_flight_min": min(in_flight), "in_flight_max": max(in_flight)}


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smaller epochs, for a smoke run")
    args = parser.parse_args()
    bank()
    emit(machine=f"{os.cpu_count()} cpus", python=sys.version.split()[0], numpy=np.__version__)

    configs = ["in-process", "bridgeflow-processes", "bridgeflow-processes-unfused", "bridgeflow-threads",
               "torch-DataLoader"]
    n1 = 64 * (20 if args.quick else 80)
    w1 = throughput("W1", load, n1, configs, args.reps)
    ratio("W1", "bridgeflow-processes", "torch-DataLoader", w1, target=3.0)
    ratio("W1", "bridgeflow-processes", "in-process", w1, target=0.8)
    ratio("W1", "bridgeflow-processes-unfused", "in-process", w1)
    bookkeeping(n1, args.reps)
    emit(bench="state_dict", stage="MultiProcessMapData(2 workers, buffer_size=256)",
         **state_dict_times(64 * (20 if args.quick else 80)), target_ms=50)

    emit(bench="W2", calibrated_iterations=calibrate())
    n2 = 64 * (4 if args.quick else 10)
    w2 = throughput("W2", busy, n2, ["in-process", "bridgeflow-processes", "bridgeflow-threads",
                                     "torch-DataLoader", "two-bare-processes"], args.reps)
    ratio("W2", "bridgeflow-processes", "in-process", w2, target=1.8)
    ratio("W2", "bridgeflow-processes", "torch-DataLoader", w2, target=1.0)
    ratio("W2", "two-bare-processes", "in-process", w2)  # what two cores give this machine, at best
    ratio("W2", "bridgeflow-processes", "two-bare-processes", w2)

    times: dict[str, list[float]] = {"bridgeflow-processes": [], "torch-DataLoader": []}
    for _ in range(args.reps):
        for c in times:
            times[c].append(first_batch_time(c, load, 64 * 20))
    for c, ts in times.items():
        emit(bench="W3", config=c, median_first_batch_s=round(statistics.median(ts), 4),
             reps=[round(t, 4) for t in ts])
    emit(bench="W3", ratio="bridgeflow-processes/torch-DataLoader",
         value=round(statistics.median(times["bridgeflow-processes"]) / statistics.median(times["torch-DataLoader"]),
                     3), note="lower is faster")
    return 0


def ratio(bench: str, a: str, b: str, medians: dict[str, float], target: float | None = None) -> None:
    value = medians[a] / medians[b]
    fields = {"bench": bench, "ratio": f"{a}/{b}", "value": round(value, 3)}
    if target is not None:
        fields.update(target=target, met=value >= target)
    emit(**fields)


if __name__ == "__main__":
    sys.exit(main())
