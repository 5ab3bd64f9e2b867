"""tensorpack's other names for the parallel stages, with tensorpack's argument orders.

bridgeflow has one transport (shared memory), so the ``...ZMQ`` variants are the same stages; the
names exist so that ported code runs unchanged. New code should use the four stages directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..base import DataFlow
from ..batch import BatchData
from .stages import MultiProcessMapData, MultiProcessRunner, MultiThreadMapData

__all__ = [
    "MultiProcessMapAndBatchData",
    "MultiProcessMapAndBatchDataZMQ",
    "MultiProcessMapDataZMQ",
    "MultiProcessPrefetchData",
    "MultiProcessRunnerZMQ",
    "PrefetchData",
    "PrefetchDataZMQ",
    "ThreadedMapData",
]


class MultiProcessRunnerZMQ(MultiProcessRunner):
    """``MultiProcessRunnerZMQ(ds, num_proc=1, hwm=50)``: a :class:`MultiProcessRunner`."""

    def __init__(self, ds: DataFlow, num_proc: int = 1, hwm: int = 50, **kwargs: Any) -> None:
        super().__init__(ds, num_proc, hwm, **kwargs)


PrefetchDataZMQ = MultiProcessRunnerZMQ


class PrefetchData(MultiProcessRunner):
    """``PrefetchData(ds, num_prefetch, num_proc)``: tensorpack's older name, in tensorpack's order."""

    def __init__(self, ds: DataFlow, num_prefetch: int, num_proc: int, **kwargs: Any) -> None:
        super().__init__(ds, num_proc, num_prefetch, **kwargs)


MultiProcessPrefetchData = PrefetchData


class ThreadedMapData(MultiThreadMapData):
    """``ThreadedMapData(ds, nr_thread, map_func, buffer_size=200, strict=False)``: tensorpack's older name."""


class MultiProcessMapDataZMQ(MultiProcessMapData):
    """``MultiProcessMapDataZMQ(ds, num_proc, map_func, buffer_size=200, strict=False)``."""


class MultiProcessMapAndBatchData(BatchData):
    """Map in ``num_proc`` processes and batch there: ``BatchData(MultiProcessMapData(...), batch_size)``.

    The workers stack each batch straight into shared memory, which is what tensorpack's class of this
    name was for.
    """

    def __init__(self, ds: DataFlow, num_proc: int, map_func: Callable[[Any], Any], batch_size: int,
                 buffer_size: int | None = None, **kwargs: Any) -> None:
        remainder = kwargs.pop("remainder", False)
        stage = MultiProcessMapData(ds, num_proc, map_func, buffer_size=buffer_size or 4 * batch_size, **kwargs)
        super().__init__(stage, batch_size, remainder=remainder)


MultiProcessMapAndBatchDataZMQ = MultiProcessMapAndBatchData
