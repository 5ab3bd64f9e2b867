"""Exceptions raised by bridgeflow.

Every error the library raises on purpose derives from :class:`BridgeflowError`, so callers can catch
them all at once; where a builtin type carries meaning (``TypeError`` for an unknown length,
``ValueError`` for a bad argument) the error derives from that too.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BatchError",
    "BridgeflowError",
    "DataFlowReentrantError",
    "DataFlowTerminated",
    "DatapointError",
    "LengthUnknownError",
    "MissingDependencyError",
    "WorkerError",
    "WorkerTimeoutError",
]


class BridgeflowError(Exception):
    """Base class of the errors bridgeflow raises on purpose."""


class LengthUnknownError(BridgeflowError, TypeError):
    """``len()`` of a flow whose length is not known without iterating it.

    It is a ``TypeError`` so that ``list(df)`` and ``operator.length_hint`` treat the flow as length-free.
    """


def length_unknown(message: str) -> LengthUnknownError:
    """A :class:`LengthUnknownError` with ``message``; when torch's own DataLoader asked (it reads any dataset
    that is not an ``IterableDataset`` by index, after its length), it also says what to use instead."""
    import sys

    frame: Any = sys._getframe(1)
    for _ in range(12):  # len() of the outermost flow asks its source's, and so on down
        frame = frame.f_back
        if frame is None:
            break
        if frame.f_globals.get("__name__", "").startswith("torch.utils.data"):
            message += ("; torch.utils.data.DataLoader reads a dataset by index after asking its length: give the "
                        "flow to bridgeflow.adapters.torch.DataLoader, a drop-in subclass that iterates a flow "
                        "without one")
            break
    return LengthUnknownError(message)


class DataFlowReentrantError(BridgeflowError, RuntimeError):
    """One flow iterated by two consumers at the same time."""


class DataFlowTerminated(BridgeflowError):
    """Raised inside a flow that was closed while a consumer was still iterating it."""


class DatapointError(BridgeflowError, ValueError):
    """A datapoint with the wrong structure: not a list/tuple/dict, a missing key, a wrong length."""


class BatchError(DatapointError):
    """A component that cannot be batched (ragged shapes without padding, mixed types)."""


class WorkerError(BridgeflowError, RuntimeError):
    """A parallel worker died without reporting an exception (signal, ``os._exit``, OOM kill)."""

    def __init__(self, message: str, *, stage: str = "", worker: int = -1, pid: int | None = None,
                 exitcode: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.worker = worker
        self.pid = pid
        self.exitcode = exitcode


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A worker returned no result within the stage's ``timeout``; names the stage, worker, pid and the
    worker's state (running, stopped...). Catch it as ``TimeoutError`` or as ``WorkerError``."""


class MissingDependencyError(BridgeflowError, ImportError):
    """An optional dependency is needed for the feature used; the message names the extra to install."""
