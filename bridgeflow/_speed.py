"""Measure how fast a flow produces datapoints, and say which stage is the slow side."""

from __future__ import annotations

import sys
import time
from collections.abc import Generator, Iterator
from typing import Any

from ._base import DataFlow, reset_once
from ._batch import BatchData, BatchDataByShape, UnbatchData
from ._progress import progress_bar
from ._proxy import ProxyDataFlow
from .pipeline import bottleneck, format_stats, pipeline_stats

__all__ = ["TestDataSpeed", "collect_stats", "format_stats"]


collect_stats = pipeline_stats  # ``df.stats()``, also for a duck-typed flow at the top


class TestDataSpeed(ProxyDataFlow):
    """Iterate a flow ``size`` times behind a progress bar and report what it yields per second.

    ``start()`` runs the test and returns the rate; the first ``warmup`` items are not timed (worker
    start-up, caches). If the flow runs out before ``size`` it is iterated again. ``min_seconds`` times
    more rounds of ``size`` items until that long has passed: a fast flow read for a few milliseconds
    gives a rate that changes several-fold between runs (``bridgeflow bench`` times 2 s); the progress bar
    then counts without a percentage, the number of rounds being unknown. The items are called batches
    (with the datapoints per second beside them) when the flow batches: a ``BatchData`` or
    ``BatchDataByShape`` is in its chain of wrapped flows with no ``UnbatchData`` above it; ``unit`` names
    them otherwise (``size`` and ``warmup`` count them either way). Afterwards the
    statistics of every stage that keeps them (buffer fill, consumer wait, workers busy) are printed with
    a verdict on the slow side (see :func:`bridgeflow.pipeline.bottleneck`): an output buffer that is
    nearly always empty while the workers are busy means the workers are the bottleneck.

    Example:
        >>> from bridgeflow import FakeData
        >>> rate = TestDataSpeed(FakeData([[4]], size=100), size=50, progress=False).start()
        50 datapoints in ...
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, ds: DataFlow, size: int = 5000, warmup: int = 0, *, progress: bool = True,
                 file: Any = None, min_seconds: float = 0.0, unit: str | None = None) -> None:
        super().__init__(ds)
        if size <= 0 or warmup < 0 or not min_seconds >= 0:
            raise ValueError(f"TestDataSpeed needs size > 0, warmup >= 0 and min_seconds >= 0, got size={size} "
                             f"warmup={warmup} min_seconds={min_seconds}")
        self.test_size = int(size)
        self.warmup = int(warmup)
        self.min_seconds = float(min_seconds)
        self.progress = progress
        self.file = file
        self.unit = unit
        self.rate: float | None = None

    def _items(self) -> tuple[str, int | None]:
        """What the flow yields, in the plural, and the datapoints in each when they are batches."""
        if self.unit:
            return self.unit, None
        stage: Any = self.ds
        for _ in range(1000):  # a chain of wrapped flows (``ds``), outermost first
            if isinstance(stage, UnbatchData):
                break
            if isinstance(stage, (BatchData, BatchDataByShape)):
                return "batches", stage.batch_size
            stage = getattr(stage, "ds", None)
            if stage is None:
                break
        return "datapoints", None

    def _stream(self) -> Generator[Any, None, None]:
        while True:
            empty = True
            for dp in self.ds:
                empty = False
                yield dp
            if empty:
                raise ValueError(f"TestDataSpeed: {type(self.ds).__name__} yielded no datapoint")

    def start(self) -> float:
        """Run the test; returns the items (datapoints, or batches) per second and prints a summary."""
        reset_once(self)
        out = self.file or sys.stdout
        stream = self._stream()
        try:
            for _ in range(self.warmup):
                next(stream)
            n = 0
            items, per_batch = self._items()
            with progress_bar(enabled=self.progress, total=None if self.min_seconds else self.test_size,
                              unit="batch" if per_batch else "dp", leave=False) as bar:
                t0 = time.perf_counter()  # after the bar is made: its first use imports tqdm
                while True:
                    for _ in range(self.test_size):
                        next(stream)
                        bar.update(1)
                    n += self.test_size
                    elapsed = time.perf_counter() - t0
                    if elapsed >= self.min_seconds:
                        break
        finally:
            stream.close()
        self.rate = n / max(elapsed, 1e-9)
        line = f"{n} {items} in {elapsed:.3f}s: {self.rate:.1f} {items}/s"
        if per_batch:
            line += f" ({self.rate * per_batch:.1f} datapoints/s at {per_batch} a batch)"
        print(line, file=out)
        stats = pipeline_stats(self.ds)
        if stats:
            print("stage statistics:\n" + format_stats(stats), file=out)
            verdict = bottleneck(stats)
            if verdict:
                print(f"bottleneck: {verdict}", file=out)
        return self.rate

    start_test = start  # tensorpack's older name

    def _why_not_resumable(self) -> str:
        return "TestDataSpeed cannot save its position: it is a timer, iterated once; save the flow it times"

    def _iter_epoch(self) -> Iterator:
        self.start()
        yield from self.ds


def bench_counts(args: Any) -> tuple[int, int]:
    """``bridgeflow bench``'s ``--size`` and ``--warmup`` count datapoints; with ``--batch B`` TestDataSpeed
    counts batches, so it is given the batches that hold that many datapoints (rounded up)."""
    size, warmup, batch = int(getattr(args, "size", 2000)), int(getattr(args, "warmup", 0)), getattr(args, "batch", 0)
    if batch:
        return -(-size // batch), -(-warmup // batch)
    return size, warmup
