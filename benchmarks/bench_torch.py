"""Benchmark: bridgeflow's torch DataLoader against torch.utils.data.DataLoader (the anchor), same run.

Cases (map-style datasets, batch 64, num_workers=2, fork, one epoch timed from iter() to exhaustion,
worker start-up included as it is in every non-persistent epoch):

- ``numpy``: samples are 3x224x224 uint8 numpy arrays + an int label;
- ``tensor``: the same samples as torch tensors;
- ``transform_2ms``: numpy samples through a ~2 ms CPU-bound per-sample transform;
- ``cuda`` (GPU machines only; one "skipped" line elsewhere): CUDAPrefetcher's host-to-device throughput
  against a raw pinned ``copy_`` of the same bytes, and a loop with a GPU step of known length.

Repetitions are interleaved (torch, bridgeflow, torch, ...); each line is one JSON object: per loader
the median seconds per epoch and samples/s, then the ratio torch_median / bridgeflow_median.

Run: python benchmarks/bench_torch.py [--reps 5] [--batches 100]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import DataLoader as BFDataLoader

BATCH = 64
SHAPE = (3, 224, 224)
TARGETS = {"numpy": 2.5, "tensor": 2.5, "transform_2ms": 1.0}


class ImageDataset(tud.Dataset):
    """``n`` samples cycling over 64 distinct random images (reading them costs next to nothing)."""

    def __init__(self, n: int, as_tensor: bool = False, transform_ms: float = 0.0) -> None:
        rng = np.random.default_rng(0)
        self.images = [rng.integers(0, 256, SHAPE, dtype=np.uint8) for _ in range(64)]
        if as_tensor:
            self.images = [torch.from_numpy(im) for im in self.images]
        self.n = n
        self.transform_s = transform_ms / 1000.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image = self.images[i % 64]
        if self.transform_s:
            end = time.perf_counter() + self.transform_s  # stands for a CPU-bound augmentation
            while time.perf_counter() < end:
                pass
        return image, i


def run_epoch(loader_cls, dataset) -> tuple[float, float]:
    """Seconds for one epoch (worker start-up included) and seconds until the first batch."""
    loader = loader_cls(dataset, batch_size=BATCH, num_workers=2, multiprocessing_context="fork")
    start = time.perf_counter()
    first = None
    n = 0
    for images, labels in loader:
        if first is None:
            first = time.perf_counter() - start
        n += int(labels.shape[0])
        assert images.shape == (labels.shape[0], *SHAPE)
    elapsed = time.perf_counter() - start
    assert n == len(dataset), (n, len(dataset))
    return elapsed, first


def _median_time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    return out


def bench_cuda(reps: int, batches: int, machine: dict) -> None:
    """GPU cases: CUDAPrefetcher's host-to-device throughput against a raw pinned ``copy_`` of the same
    bytes, and a loop whose GPU step takes a known time (the copy should hide behind it)."""
    from bridgeflow.adapters.torch import CUDAPrefetcher

    if not torch.cuda.is_available():
        print(json.dumps({"bench": "torch_cuda", "skipped": "no CUDA device on this machine", **machine}))
        return
    machine = {**machine, "gpu": torch.cuda.get_device_name()}
    shape = (BATCH, *SHAPE)
    nbytes = int(np.prod(shape))
    rng = np.random.default_rng(0)
    pageable = [torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(4)]
    pinned = [t.pin_memory() for t in pageable]
    dev = torch.empty(shape, dtype=torch.uint8, device="cuda")

    def raw_copy():
        for i in range(batches):
            dev.copy_(pinned[i % 4], non_blocking=True)

    def prefetch(source):
        def run():
            for _ in CUDAPrefetcher([source[i % 4] for i in range(batches)], device="cuda"):
                pass
        return run

    cases = {"raw_pinned_copy": raw_copy, "prefetcher_pageable_in": prefetch(pageable),
             "prefetcher_pinned_in": prefetch(pinned)}
    for fn in cases.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            times[name] += _median_time(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, m in med.items():
        print(json.dumps({"bench": "torch_cuda", "case": "h2d_throughput", "variant": name, "reps": reps,
                          "GB_per_s": round(batches * nbytes / m / 1e9, 2), "median_s": round(m, 4),
                          **machine}))
    for name in ("prefetcher_pageable_in", "prefetcher_pinned_in"):
        print(json.dumps({"bench": "torch_cuda", "case": "h2d_throughput", "variant": name,
                          "ratio_vs_raw_pinned_copy": round(med["raw_pinned_copy"] / med[name], 3),
                          "target": 0.85}))

    # A step of known length: a chain of matmuls whose time is measured alone first.
    a = torch.randn(2048, 2048, device="cuda")
    copy_per_batch = med["raw_pinned_copy"] / batches
    k = 1
    while statistics.median(_median_time(lambda k=k: [a @ a for _ in range(k)], 3)) < 2 * copy_per_batch:
        k *= 2

    def step(x):
        for _ in range(k):
            a @ a
        return x.float().mean()

    step_alone = statistics.median(_median_time(lambda: [step(dev) for _ in range(batches)], reps)) / batches

    def loop():
        for x in CUDAPrefetcher([pageable[i % 4] for i in range(batches)], device="cuda"):
            step(x)

    loop()
    per_batch = statistics.median(_median_time(loop, reps)) / batches
    bound = max(step_alone, copy_per_batch)
    print(json.dumps({"bench": "torch_cuda", "case": "overlap", "step_s": round(step_alone, 5),
                      "copy_s": round(copy_per_batch, 5), "loop_per_batch_s": round(per_batch, 5),
                      "ratio_vs_max_step_copy": round(per_batch / bound, 3), "target_max": 1.1, **machine}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batches", type=int, default=100, help="batches per epoch (transform case: 1/4)")
    parser.add_argument("--cases", default="numpy,tensor,transform_2ms,cuda")
    args = parser.parse_args()
    machine = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__}
    for case in args.cases.split(","):
        if case == "cuda":
            bench_cuda(args.reps, args.batches, machine)
            continue
        batches = args.batches if case != "transform_2ms" else max(2, args.batches // 4)
        dataset = ImageDataset(batches * BATCH, as_tensor=case == "tensor",
                               transform_ms=2.0 if case == "transform_2ms" else 0.0)
        loaders = {"torch": tud.DataLoader, "bridgeflow": BFDataLoader}
        times: dict[str, list[float]] = {name: [] for name in loaders}
        firsts: dict[str, list[float]] = {name: [] for name in loaders}
        run_epoch(tud.DataLoader, dataset)  # warm-up (imports, page cache)
        run_epoch(BFDataLoader, dataset)
        for _ in range(args.reps):
            for name, cls in loaders.items():
                elapsed, first = run_epoch(cls, dataset)
                times[name].append(elapsed)
                firsts[name].append(first)
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name, med in medians.items():
            print(json.dumps({"bench": "torch_dataloader", "case": case, "loader": name, "reps": args.reps,
                              "batch": BATCH, "batches": batches, "num_workers": 2,
                              "median_s": round(med, 4), "samples_per_s": round(len(dataset) / med, 1),
                              "first_batch_median_s": round(statistics.median(firsts[name]), 4),
                              "all_s": [round(t, 4) for t in times[name]], **machine}), flush=True)
        ratio = medians["torch"] / medians["bridgeflow"]
        print(json.dumps({"bench": "torch_dataloader", "case": case, "ratio_vs_torch": round(ratio, 3),
                          "target": TARGETS.get(case), "meets_target": ratio >= TARGETS.get(case, 0)}),
              flush=True)


if __name__ == "__main__":
    main()
