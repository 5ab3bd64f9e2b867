"""Pinning: batches copied into page-locked memory, and the loader's pin thread.

:class:`BatchPinner` copies every CPU tensor of a batch into page-locked memory taken from torch's pinned
caching allocator, splitting large copies across a few threads (:class:`~._staging.ParallelCopier`).
Tensors already pinned by that allocator pass through. Tensors that view a *registered* shared-memory slab
(see :mod:`._pinning`) are pinned too, but the loader's user may start a non-blocking copy from them and
drop them at once; torch tracks such copies only for memory its own allocator gave out, so the slab could
go back to its worker while the copy still reads it. So they are copied as well, unless ``zero_copy=True``
says the consumer keeps each batch until its copies are done (as :class:`~._prefetcher.CUDAPrefetcher` does).

:class:`PinThread` is a batch source (see :mod:`._sources`) wrapped around the worker pool's when a loader
with workers pins (``pin_memory=True``), as torch's loader pins in a background thread: the thread sends
the tasks the epoch iterator queues, receives the batches and pins them, while the iterator (in the
user's thread) draws every task and keeps the epoch's record, so the loader's state counts exactly the
batches handed out. The thread holds the pool source, never the iterator: dropping the iterator stops it.

Example:
    >>> from bridgeflow.adapters.torch import DataLoader                            # doctest: +SKIP
    >>> it = iter(DataLoader(ds, batch_size=64, num_workers=4, pin_memory=True))   # doctest: +SKIP
    >>> batch = next(it)  # pinned by the thread; the state counts this batch   # doctest: +SKIP
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridgeflow.engine import Producer

from . import _compat
from ._compat import torch
from ._convert import map_structure
from ._result import BATCH, FAILED, Result
from ._staging import ParallelCopier

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = ["BatchPinner", "PinThread", "loader_pinner", "pins", "update_pinner"]


def _pinned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _is_pinned(t: Any) -> bool:
    return t.is_pinned()


class BatchPinner:
    """Return a batch whose CPU tensors are in page-locked memory (same structure, dtypes and values).

    Args:
        copier: copies into the pinned memory; default: a :class:`ParallelCopier` of its own (closed by
            :meth:`close`).
        registered: ``address -> bool``, true inside a registered slab (``SlabPinner.contains``).
        zero_copy: hand tensors in registered slabs out as they are (the consumer keeps each batch alive
            until its asynchronous copies have completed).
    """

    def __init__(self, copier: ParallelCopier | None = None, *, registered: Callable[[int], bool] | None = None,
                 zero_copy: bool = False, _alloc: Callable[[tuple[int, ...], Any], Any] = _pinned_empty,
                 _is_pinned: Callable[[Any], bool] = _is_pinned) -> None:
        self._own_copier = copier is None
        self.copier = copier if copier is not None else ParallelCopier()
        self.registered = registered
        self.zero_copy = zero_copy
        self._alloc = _alloc
        self._check_pinned = _is_pinned
        self.copied = 0  # tensors copied into pinned memory so far
        self.passed = 0  # tensors handed out as they were (pinned already)

    def pin_tensor(self, t: Any) -> Any:
        if t.device.type != "cpu":
            return t
        if self._check_pinned(t):
            in_slab = self.registered is not None and t.numel() > 0 and self.registered(t.data_ptr())
            if self.zero_copy or not in_slab:
                self.passed += 1
                return t
        out = self._alloc(tuple(t.shape), t.dtype)
        self.copier.copy(out, t)
        if t.requires_grad:
            out.requires_grad_(True)
        self.copied += 1
        return out

    def __call__(self, batch: Any) -> Any:
        return map_structure(batch, self.pin_tensor, (torch.Tensor,))

    def close(self) -> None:
        if self._own_copier:
            self.copier.close()


def pins(loader: DataLoader) -> bool:
    """Whether the loader's batches are pinned: ``pin_memory=True`` and an accelerator to pin for (not MPS,
    as torch), or a test backend standing for pinned memory (``loader._bf.pin_backend``)."""
    if not loader.pin_memory:
        return False
    if loader._bf.pin_backend is not None:
        return True
    return _compat.accelerator_available() and _compat.current_accelerator_type() != "mps"


def loader_pinner(loader: DataLoader, *, threads: int | None = None) -> BatchPinner:
    """The :class:`BatchPinner` a loader's iterator pins with: torch's pinned allocator (or the loader's
    test backend, ``loader._bf.pin_backend``), aware of the slabs registered by the loader's mapping hooks."""
    backend = loader._bf.pin_backend
    extra = {} if backend is None else {"_alloc": backend.alloc, "_is_pinned": backend.is_pinned}
    pinner = BatchPinner(ParallelCopier(threads), **extra)
    update_pinner(pinner, loader._bf.mapping_hooks)
    return pinner


def update_pinner(pinner: BatchPinner, hooks: Any) -> None:
    """Tell ``pinner`` which tensors lie in registered slabs (``hooks.contains``) and whether it may hand them
    out as they are (``hooks.zero_copy``: the batches' consumer keeps each one until its copies completed)."""
    contains = getattr(hooks, "contains", None)
    pinner.registered = contains if callable(contains) else None
    pinner.zero_copy = bool(getattr(hooks, "zero_copy", False))


class _Stopped(BaseException):
    """The pin thread was asked to stop while it waited (no ``except Exception`` may take it for an error)."""


def _pinned(result: Result, pinner: BatchPinner) -> Result:
    """A result with its batch pinned; a pinning error is that batch's error (it counts as delivered)."""
    if result.tag is not BATCH:
        return result
    try:
        return Result(BATCH, pinner(result.value), result.state)
    except Exception as exc:
        return Result(FAILED, exc, result.state)


class _Inbox:
    """Tasks queued by the iterator for the thread to send, and what the thread holds at its end."""

    def __init__(self) -> None:
        self.tasks: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.close_source = False  # the thread closes the source as it ends (see PinThread.close)


def _read(source: Any, inbox: _Inbox, pinner: BatchPinner, device: int | None, handle: Any) -> None:
    """The pin thread: send queued tasks, receive results in order, pin the batches, queue them."""
    stop, out = handle.stop, handle.queue
    outstanding = 0

    def send() -> bool:
        nonlocal outstanding
        if stop.is_set():
            raise _Stopped
        while inbox.tasks:
            source.put(*inbox.tasks.popleft())
            outstanding += 1
        return out.empty()  # the consumer has nothing waiting: its next task may come any moment

    try:
        if device is not None:  # pinned memory is allocated for the current device, as torch's thread does
            torch.cuda.set_device(device)
        while True:
            send()
            if outstanding == 0:
                inbox.wake.wait(0.1)
                inbox.wake.clear()
                continue
            worker, seq, result = source.get(between=send)
            outstanding -= 1
            if not handle.put((worker, seq, _pinned(result, pinner))):
                return
            del result  # hold nothing of a batch once it is queued (it may pin a shared-memory slab)
    except _Stopped:
        return
    finally:
        if inbox.close_source:
            source.close()


class PinThread:
    """The batch source ``source`` read by a background thread that pins each batch (see the module doc);
    ``depth``: results it may hold for the consumer (more than the tasks in flight: it never blocks)."""

    reads_ahead = True

    def __init__(self, source: Any, pinner: BatchPinner, depth: int) -> None:
        self._source, self.pinner, self._depth = source, pinner, depth
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._start()

    def _start(self) -> None:
        self._inbox = _Inbox()
        self._thread = Producer(functools.partial(_read, self._source, self._inbox, self.pinner, self._device),
                                depth=self._depth, name="bf-pin-memory")

    @property
    def workers(self) -> list:
        return self._source.workers

    def put(self, task: Any, worker: int | None, seq: int) -> None:
        self._inbox.tasks.append((task, worker, seq))
        self._inbox.wake.set()

    def get(self, between: Callable[[], None] | None = None) -> tuple[int | None, int, Result]:
        return self._thread.get()

    def reset(self, shared_seed: int | None) -> list[tuple[int, Any]]:
        """Stop the thread (what it read ahead is dropped), start the next epoch, start a new thread."""
        self._thread.close()
        states = self._source.reset(shared_seed)
        self._start()
        return states

    def set_mapping_hooks(self, hooks: Any) -> None:
        update_pinner(self.pinner, hooks)
        self._source.set_mapping_hooks(hooks)

    def close(self) -> None:
        """Stop and join the thread, then close the source and the pinner. Run by the thread itself (the
        iterator collected there, in a reference cycle) it only tells the thread to stop and close the
        source as it ends."""
        if self._thread.in_thread():
            self._inbox.close_source = True
            self._thread.stop.set()
            return
        self._thread.close()
        self.pinner.close()
        self._source.close()
