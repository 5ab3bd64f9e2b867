"""tensorpack's other names for the parallel stages, with tensorpack's argument orders.

bridgeflow has one transport (shared memory), so the ``...ZMQ`` variants are the same stages; the
names exist so that ported code runs unchanged. New code should use the four stages directly. Every name
takes the same positional order as in tensorpack 0.11, and tensorpack's older ``nr_*`` keywords with a
``DeprecationWarning``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._base import DataFlow
from .._batch import BatchData
from .._renamed import renamed_keywords
from ._stages import MultiProcessMapData, MultiProcessRunner, MultiThreadMapData

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
    """``MultiProcessRunnerZMQ(ds, num_proc=1, hwm=50)``: a :class:`MultiProcessRunner` prefetching ``hwm``."""

    @renamed_keywords(nr_proc="num_proc")
    def __init__(self, ds: DataFlow, num_proc: int = 1, hwm: int = 50, **kwargs: Any) -> None:
        super().__init__(ds, num_prefetch=hwm, num_proc=num_proc, **kwargs)


PrefetchDataZMQ = MultiProcessRunnerZMQ


class PrefetchData(MultiProcessRunner):
    """``PrefetchData(ds, num_prefetch, num_proc)``: tensorpack's older name of :class:`MultiProcessRunner`."""


MultiProcessPrefetchData = PrefetchData


class ThreadedMapData(MultiThreadMapData):
    """``ThreadedMapData(ds, num_thread, map_func, buffer_size=200, strict=False)``: tensorpack's older name
    (gone from tensorpack 0.11) of :class:`MultiThreadMapData`."""


class MultiProcessMapDataZMQ(MultiProcessMapData):
    """``MultiProcessMapDataZMQ(ds, num_proc, map_func, buffer_size=200, strict=False)``."""


class MultiProcessMapAndBatchData(BatchData):
    """Map in ``num_proc`` processes and batch there: ``BatchData(MultiProcessMapData(...), batch_size)``.

    The workers stack each batch straight into shared memory, which is what tensorpack's class of this
    name was for.
    """

    @renamed_keywords(nr_proc="num_proc")
    def __init__(self, ds: DataFlow, num_proc: int, map_func: Callable[[Any], Any], batch_size: int,
                 buffer_size: int | None = None, **kwargs: Any) -> None:
        remainder = kwargs.pop("remainder", False)
        stage = MultiProcessMapData(ds, num_proc, map_func, buffer_size=buffer_size or 4 * batch_size, **kwargs)
        super().__init__(stage, batch_size, remainder=remainder)
        self.num_workers = stage.num_workers


MultiProcessMapAndBatchDataZMQ = MultiProcessMapAndBatchData
