"""Parallel stages on threads or processes, sharing one worker loop and a shared-memory transport."""

from ._common import OversubscribedWarning
from ._compat import (
    MultiProcessMapAndBatchData,
    MultiProcessMapAndBatchDataZMQ,
    MultiProcessMapDataZMQ,
    MultiProcessPrefetchData,
    MultiProcessRunnerZMQ,
    PrefetchData,
    PrefetchDataZMQ,
    ThreadedMapData,
)
from ._stages import MultiProcessMapData, MultiProcessRunner, MultiThreadMapData, MultiThreadRunner
from ._transport.mapping import MappingHooks
from ._transport.pool import EXHAUSTED, RemoteError, WorkerContext, WorkerPool

__all__ = [
    "EXHAUSTED",
    "MappingHooks",
    "MultiProcessMapAndBatchData",
    "MultiProcessMapAndBatchDataZMQ",
    "MultiProcessMapData",
    "MultiProcessMapDataZMQ",
    "MultiProcessPrefetchData",
    "MultiProcessRunner",
    "MultiProcessRunnerZMQ",
    "MultiThreadMapData",
    "MultiThreadRunner",
    "OversubscribedWarning",
    "PrefetchData",
    "PrefetchDataZMQ",
    "RemoteError",
    "ThreadedMapData",
    "WorkerContext",
    "WorkerPool",
]
