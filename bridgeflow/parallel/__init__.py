"""Parallel stages on threads or processes, sharing one worker loop and a shared-memory transport."""

from .pool import EXHAUSTED, RemoteError, WorkerContext, WorkerPool
from .stages import MultiProcessMapData, MultiProcessRunner, MultiThreadMapData, MultiThreadRunner

__all__ = [
    "EXHAUSTED",
    "MultiProcessMapData",
    "MultiProcessRunner",
    "MultiThreadMapData",
    "MultiThreadRunner",
    "RemoteError",
    "WorkerContext",
    "WorkerPool",
]
