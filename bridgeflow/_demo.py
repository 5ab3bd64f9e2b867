"""The built-in demo: build a dataset, serialize it once, and measure the pipeline that reads it.

``bridgeflow demo`` runs it. Each step prints one line, so the output reads as a short tour:

1. a source of fake 3x64x64 uint8 images with labels, serialized to an LMDB file (atomically);
2. the file read back: sequentially, and shuffled;
3. read + augment + batch, first in this process, then in two worker processes that read the file by
   index (the workers stack the batches straight into shared memory), with the stage's statistics.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any

import numpy as np

from ._batch import BatchData
from ._combine import JoinData
from ._sources import DataFromList, FakeData
from ._transforms import MapData
from .parallel import MultiProcessMapData
from .parallel._common import usable_cpus
from .pipeline import bottleneck, format_stats

__all__ = ["demo_source", "run_demo"]


def demo_source(size: int = 2048, seed: int = 0) -> JoinData:
    """Fake 3x64x64 uint8 images joined with int64 labels in [0, 9]: the demo's dataset."""
    images = FakeData([[3, 64, 64]], size=size, dtype="uint8", seed=seed)
    labels = FakeData([[]], size=size, dtype="int64", domain=(0, 9), seed=seed + 1)
    return JoinData([images, labels])


def augment(dp: list, rng: np.random.RandomState | None = None) -> list:
    """Random 56x56 crop, random flip, per-channel normalization to float32: a realistic light transform."""
    img, label = dp
    draw: Any = rng if rng is not None else np.random  # numpy's global RandomState functions by default
    y, x = draw.randint(0, 9, size=2)
    img = img[:, y:y + 56, x:x + 56]
    if draw.randint(2):
        img = img[:, :, ::-1]
    out = img.astype(np.float32)
    out -= _MEAN
    out *= _INV_STD
    return [out, label]


_MEAN = np.array([123.7, 116.3, 103.5], np.float32).reshape(3, 1, 1)
_INV_STD = (1 / np.array([58.4, 57.1, 57.4], np.float32)).reshape(3, 1, 1)


def load_and_augment(db: Any, index: int) -> list:
    """Read datapoint ``index`` from the dataset file and augment it: what each worker runs."""
    return augment(db[index])


def _rate(df, n: int) -> float:
    """Datapoints per second over one epoch of ``n`` datapoints."""
    t0 = time.perf_counter()
    count = sum(1 for _ in df)
    if count != n:
        raise RuntimeError(f"the demo expected {n} datapoints and got {count}")
    return n / (time.perf_counter() - t0)


def _cpu_note(cpus: int) -> str:
    """Why 2 workers may not give 2x, said before the figure: the CPUs they share."""
    if cpus >= 3:
        return f"{cpus} CPUs here: up to 2x"
    if cpus == 2:
        return "2 CPUs here for the 2 workers, this process and any other program: under 2x"
    return "1 CPU here for the 2 workers and this process: no speed-up"


def run_demo(size: int = 2048, workdir: str | None = None, batch_size: int = 64) -> int:
    """Build, serialize, read back and measure; prints one line per step, returns an exit code."""
    from .serialize import LMDBSerializer

    batch_size = max(1, min(batch_size, size))  # a dataset smaller than one batch still makes one batch
    n_batches = size // batch_size
    with tempfile.TemporaryDirectory(prefix="bridgeflow-demo-", dir=workdir) as tmp:
        path = os.path.join(tmp, "demo.lmdb")
        print(f"bridgeflow demo: {size} fake 3x64x64 uint8 images + labels, batches of {batch_size}")

        t0 = time.perf_counter()
        LMDBSerializer.save(demo_source(size), path, progress=False)
        dt = time.perf_counter() - t0
        print(f"1. serialized to LMDB: {size / dt:,.0f} datapoints/s, {os.path.getsize(path) / 2**20:.1f} MiB")

        with LMDBSerializer.load(path, shuffle=False) as seq, LMDBSerializer.load(path, shuffle=True) as shuf:
            seq.reset_state()
            shuf.reset_state()
            print(f"2. read back: {_rate(seq, size):,.0f} datapoints/s sequential, "
                  f"{_rate(shuf, size):,.0f} shuffled")

        # Send indices to the workers and let each one read the file: shipping decoded images from this
        # process to the workers would make this process the bottleneck.
        db = LMDBSerializer.load(path, shuffle=False)
        task = functools.partial(load_and_augment, db)
        indices = DataFromList(list(range(size)), shuffle=True, seed=0)
        with BatchData(MapData(indices, task), batch_size) as local:
            local.reset_state()
            in_process = _rate(local, n_batches) * batch_size
        with BatchData(MultiProcessMapData(indices, 2, task, buffer_size=4 * batch_size), batch_size) as parallel:
            parallel.reset_state()
            _rate(parallel, n_batches)  # the first epoch starts the workers
            two_workers = _rate(parallel, n_batches) * batch_size
            stats = parallel.stats()
        print(f"3. read + crop/flip/normalize + batch, in this process, then in 2 worker processes "
              f"({_cpu_note(usable_cpus())}):")
        print(f"   {in_process:,.0f} images/s in this process, {two_workers:,.0f} images/s with 2 workers "
              f"({two_workers / in_process:.2f}x)")
        print("   stage statistics (buffer_fill near 0: the workers are the slow side; near 1: the consumer):")
        print("\n".join("   " + line.strip() for line in format_stats(stats).splitlines()))
        verdict = bottleneck(stats)
        if verdict:
            print(f"   bottleneck: {verdict}")
    return 0
