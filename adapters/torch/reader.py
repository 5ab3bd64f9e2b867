"""The DataLoader's pin-memory thread: reads the epoch ahead of the training loop and pins each batch.

With ``pin_memory=True`` and workers, torch's DataLoader pins batches in a background thread; so does
:class:`~bridgeflow.adapters.torch.DataLoader`. Here that thread does all the reading: it drives the worker
pool (sends tasks, receives results, pulls a DataFlow dataset's samples) through the epoch iterator's
``_read_step()`` and pins what it receives. As in torch, at most ``prefetch_factor * num_workers`` batches are
between the workers and the consumer: the task that replaces a batch is sent when the consumer gets that
batch (:meth:`~.pool_iter.PoolLoaderIter.grant`; map-style indices are drawn then, in the consumer's
thread), so the sampler and a DataFlow are read exactly as far as without the thread, at every point.

The loader's state must count only the batches *handed to the user*, while this thread works ahead. So
the thread updates a private copy of the epoch's :class:`~bridgeflow.adapters.torch.state.EpochRecord` and
sends a snapshot of it with every batch, error and end of epoch (a :class:`Step`); the iterator's
``__next__`` makes the snapshot current when it hands that step out. A DataFlow's ``state_dict()`` is only
ever called in this thread while it runs (the thread that iterates the flow).

:class:`PinningLoaderIter` is the iterator the user holds; the thread holds only the
:class:`~.pool_iter.PoolLoaderIter` it drives, so dropping the iterator stops the thread. A step blocked
waiting for a worker checks :func:`stop_requested` a few times a second, so stopping never waits for a
slow (or hung) worker.

Example:
    >>> from bridgeflow.adapters.torch import DataLoader                       # doctest: +SKIP
    >>> it = iter(DataLoader(ds, batch_size=64, num_workers=4, pin_memory=True))  # a PinningLoaderIter
    >>> batch = next(it)            # pinned by the thread; loader.state_dict() counts exactly this batch
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from . import _compat
from ._compat import torch
from .background import BackgroundIterator
from .pin_memory import BatchPinner
from .staging import ParallelCopier
from .state import EpochRecord

__all__ = ["DATA", "END", "ERROR", "EpochIterator", "PinningLoaderIter", "ReaderHandle", "Step", "Stopped",
           "loader_pinner", "stop_requested", "update_pinner"]

DATA, ERROR, END = "data", "error", "end"

_local = threading.local()  # in a reading thread: .stop (its stop event) and .handle (its ReaderHandle)


class Stopped(BaseException):
    """The reading thread was asked to stop while it waited (a BaseException: no ``except Exception`` of the
    epoch's code may take it for the dataset's error)."""


class Step:
    """What the reading thread sends per ``__next__``: a batch (pinned), an error to raise, or the end of
    the epoch, with the record as it is once that step is delivered; ``last``: the thread ends after it;
    ``credit``: handing it out lets the iterator send the task that replaces it."""

    __slots__ = ("kind", "value", "snapshot", "last", "credit")

    def __init__(self, kind: str, value: Any, snapshot: dict, last: bool, credit: bool = False) -> None:
        self.kind, self.value, self.snapshot, self.last, self.credit = kind, value, snapshot, last, credit


def stop_requested() -> threading.Event | None:
    """In a reading thread: its stop event (waits must check it); elsewhere None."""
    return getattr(_local, "stop", None)


def loader_pinner(loader: Any, *, threads: int | None = None) -> BatchPinner:
    """The :class:`BatchPinner` a loader's iterator pins with: torch's pinned allocator (or the loader's
    test backend, ``loader._bf_pin_backend``), aware of the slabs registered by the loader's mapping hooks."""
    backend = getattr(loader, "_bf_pin_backend", None)
    extra = {} if backend is None else {"_alloc": backend.alloc, "_is_pinned": backend.is_pinned}
    pinner = BatchPinner(ParallelCopier(threads), **extra)
    update_pinner(pinner, getattr(loader, "_bf_mapping_hooks", None))
    return pinner


def update_pinner(pinner: BatchPinner, hooks: Any) -> None:
    """Tell ``pinner`` which tensors lie in registered slabs (``hooks.contains``) and whether it may hand them
    out as they are (``hooks.zero_copy``: the batches' consumer keeps each one until its copies completed)."""
    contains = getattr(hooks, "contains", None)
    pinner.registered = contains if callable(contains) else None
    pinner.zero_copy = bool(getattr(hooks, "zero_copy", False))


def _enter(stop: threading.Event, handle: ReaderHandle, device: int | None) -> Any:
    def enter() -> None:
        _local.stop, _local.handle = stop, handle
        if device is not None:  # pinned memory is allocated for the current device, as torch's thread does
            torch.cuda.set_device(device)

    return enter


def _steps(engine: Any, pinner: BatchPinner) -> Iterator[Step]:
    """The reading thread's loop: the epoch iterator's steps, batches pinned."""
    while True:
        step = engine._read_step()
        if step.kind is DATA:
            try:
                step.value = pinner(step.value)
            except Exception as exc:  # delivered as this batch's error (the batch counts as delivered)
                step.kind, step.value = ERROR, exc
        yield step
        if step.last:
            return


class ReaderHandle:
    """The reading thread of an epoch iterator (a new one for each epoch of persistent workers) and the
    pinner it uses (kept across epochs, closed by :meth:`close`)."""

    def __init__(self, pinner: BatchPinner) -> None:
        self.pinner = pinner
        self._stop: threading.Event | None = None
        self._thread: BackgroundIterator | None = None

    @property
    def active(self) -> bool:
        return self._thread is not None

    def in_reader(self) -> bool:
        """Whether the calling thread is this handle's reading thread."""
        return getattr(_local, "handle", None) is self

    def start(self, engine: Any, depth: int) -> None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._stop = threading.Event()
        self._thread = BackgroundIterator(_steps(engine, self.pinner), depth=depth, name="bf-pin-memory",
                                          enter_thread=_enter(self._stop, self, device))

    def next(self) -> Step:
        return next(self._thread)  # type: ignore[arg-type]

    def stop(self) -> None:
        """Stop the reading thread and drop what it read ahead. From another thread this joins it (it stops
        within a fraction of a second, whatever the workers do); from the reading thread it only tells it."""
        stop, thread = self._stop, self._thread
        self._stop = self._thread = None
        if stop is not None:
            stop.set()
        if thread is not None:
            thread.close()

    def close(self) -> None:
        """Stop the thread and close the pinner (its copy threads). Idempotent."""
        self.stop()
        self.pinner.close()


class EpochIterator(_compat.BaseLoaderIter):
    """A torch DataLoader iterator (frameworks check the class) with torch's private names for what every
    epoch iterator here does: ``reset`` (persistent workers' next epoch) and ``shutdown``."""

    # torch's names, for code that calls them on a DataLoader iterator
    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        self.reset(loader, EpochRecord(loader))

    def _shutdown_workers(self) -> None:
        self.shutdown()

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} holds an epoch in progress and cannot be pickled")


class PinningLoaderIter(EpochIterator):
    """The epoch iterator of a loader with workers and ``pin_memory=True``: a
    :class:`~.pool_iter.PoolLoaderIter` (the *engine*) driven by a reading thread that pins what it reads.

    The engine works on its own copy of the epoch record; the loader's record (``record``) is updated
    from the snapshot sent with each step as that step is handed out. The reading thread holds the engine,
    never this object: dropping it stops the thread, then shuts the engine down.
    """

    def __init__(self, loader: Any, record: EpochRecord, resume: dict | None = None) -> None:
        from .pool_iter import PoolLoaderIter

        self._engine = PoolLoaderIter(loader, record, resume)
        self._engine._pins_here = False  # the reading thread pins
        self._engine.read_ahead()
        self._handle = ReaderHandle(loader_pinner(loader))
        self._published = record
        self._finalizer = weakref.finalize(self, _release, self._handle, self._engine)
        self._start_thread()

    def _start_thread(self) -> None:
        engine = self._engine
        self._published = engine._record
        engine._record = self._published.copy()
        # at most prefetch_factor * num_workers batches between the workers and the consumer, as in torch:
        # the queue never fills before that
        self._handle.start(engine, depth=engine._max_tasks + 1)

    @property
    def closed(self) -> bool:
        return self._engine.closed

    @property
    def _num_yielded(self) -> int:  # torch's name, read by some frameworks
        return self._engine._num_yielded

    def __iter__(self) -> PinningLoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._engine)

    def __next__(self) -> Any:
        if not self._handle.active:
            raise StopIteration
        step = self._handle.next()
        self._published.restore(step.snapshot)  # the loader's state: this step delivered, nothing after it
        if step.credit:
            self._engine.grant()  # the task replacing this batch (a map-style index is drawn here, as torch)
        if step.last:  # the thread ends after it: the epoch is over, or the engine closed (a dead worker...)
            self._handle.stop()
            if self._engine.closed:
                self._handle.close()
        if step.kind is DATA:
            self._engine._count_yield()
            return step.value
        if step.kind is ERROR:
            raise step.value
        raise StopIteration

    def reset(self, loader: Any, record: EpochRecord) -> None:
        """Another epoch on the same workers: the thread of the last one stops first."""
        self._handle.stop()
        self._engine.reset(loader, record)
        self._start_thread()

    def shutdown(self) -> None:
        self._finalizer()

    def set_mapping_hooks(self, hooks: Any) -> None:
        update_pinner(self._handle.pinner, hooks)
        self._engine.set_mapping_hooks(hooks)


def _release(handle: ReaderHandle, engine: Any) -> None:
    """Shutdown, or the iterator collected: the reading thread stops before the engine's pool closes. Where
    collection happens in the reading thread itself (a reference cycle), it is only told to stop: the
    engine, let go when the thread ends, closes its pool then."""
    if handle.in_reader():
        handle.stop()
        return
    handle.close()
    engine.shutdown()
