"""Parallel stages on threads or processes, sharing one worker loop and a shared-memory transport."""

from .compat import (
    MultiProcessMapAndBatchData,
    MultiProcessMapAndBatchDataZMQ,
    MultiProcessMapDataZMQ,
    MultiProcessRunnerZMQ,
    PrefetchData,
    PrefetchDataZMQ,
)
from .pool import EXHAUSTED, RemoteError, WorkerContext, WorkerPool
from .stages import MultiProcessMapData, MultiProcessRunner, MultiThreadMapData, MultiThreadRunner

__all__ = [
    "EXHAUSTED",
    "MultiProcessMapAndBatchData",
    "MultiProcessMapAndBatchDataZMQ",
    "MultiProcessMapData",
    "MultiProcessMapDataZMQ",
    "MultiProcessRunner",
    "MultiProcessRunnerZMQ",
    "MultiThreadMapData",
    "MultiThreadRunner",
    "PrefetchData",
    "PrefetchDataZMQ",
    "RemoteError",
    "WorkerContext",
    "WorkerPool",
]
