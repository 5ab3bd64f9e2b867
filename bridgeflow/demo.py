"""The built-in demo: a small image pipeline on fake data, measured stage by stage.

``bridgeflow demo`` runs it. Each step prints one line, so the output reads as a short tour of the
library: build a source, transform and batch it, and measure it.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from .batch import BatchData
from .sources import FakeData
from .speed import TestDataSpeed
from .transforms import MapData

__all__ = ["demo_source", "run_demo"]


def demo_source(size: int = 2048, seed: int = 0) -> FakeData:
    """Fake 3x64x64 uint8 images with an int64 label: the demo's dataset."""
    return FakeData([[3, 64, 64], []], size=size, dtype=["uint8", "int64"], domain=(0, 9), seed=seed)


def _augment(dp: list) -> list:
    img, label = dp
    img = img[:, :, ::-1] if int(label) % 2 else img  # a label-dependent flip, to have a cheap transform
    return [np.ascontiguousarray(img, dtype=np.float32) * (1 / 255.0), label]


def run_demo(size: int = 2048, workdir: str | None = None, batch_size: int = 64) -> int:
    """Build, measure and print; returns a process exit code."""
    batch_size = max(1, min(batch_size, size))  # a dataset smaller than one batch still makes one batch
    with tempfile.TemporaryDirectory(prefix="bridgeflow-demo-", dir=workdir):
        print(f"bridgeflow demo: {size} fake 3x64x64 uint8 images + labels")
        pipeline = BatchData(MapData(demo_source(size), _augment), batch_size)
        t0 = time.perf_counter()
        rate = TestDataSpeed(pipeline, size=max(1, size // batch_size), progress=False).start()
        print(f"in-process pipeline: {rate * batch_size:.0f} images/s "
              f"({time.perf_counter() - t0:.2f}s for one epoch)")
        pipeline.close()
    return 0
