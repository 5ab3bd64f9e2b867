"""Pin batches in a background thread, never in the training loop's thread.

:class:`BatchPinner` copies every CPU tensor of a batch into page-locked memory taken from torch's pinned
caching allocator, splitting large copies across a few threads (:class:`~.staging.ParallelCopier`).
Tensors already pinned by that allocator pass through. Tensors that view a *registered* shared-memory slab
(see :mod:`.pinning`) are pinned too, but the loader's user may start a non-blocking copy from them and
drop them at once; torch tracks such copies only for memory its own allocator gave out, so the slab could
go back to its worker while the copy still reads it. So they are copied as well, unless ``zero_copy=True``
says the consumer keeps each batch until its copies are done (as :class:`~.prefetcher.CUDAPrefetcher` does).

:class:`PinMemoryThread` runs a :class:`BatchPinner` over any iterator of batches in a background thread,
``depth`` batches ahead. (bridgeflow's DataLoader pins with a thread of its own that also drives its
workers and keeps its state exact: see :mod:`.reader`.)

Example:
    >>> from bridgeflow.adapters.torch.pin_memory import PinMemoryThread             # doctest: +SKIP
    >>> for batch in PinMemoryThread(iter(loader)):       # pinned batches, pinned in the background
    ...     x = batch[0].cuda(non_blocking=True)                                        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ._compat import torch
from .background import BackgroundIterator
from .convert import map_structure
from .staging import ParallelCopier

__all__ = ["BatchPinner", "PinMemoryThread"]


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


class PinMemoryThread(BackgroundIterator):
    """Batches of ``batches`` with their tensors pinned by a background thread, ``depth`` ahead.

    Exceptions from the source reach the consumer in order; :meth:`close` (or the end of the batches, an
    error, garbage collection) joins the thread. ``len()`` is the source's.

    Args:
        batches: an iterable of batches (a DataLoader's epoch iterator).
        pinner: a :class:`BatchPinner`; default: a new one, closed with this iterator.
        depth: batches pinned ahead (>= 1).
        device: a CUDA device the thread selects first (torch's pin thread does the same).
    """

    def __init__(self, batches: Iterable, pinner: BatchPinner | None = None, *, depth: int = 2,
                 device: Any = None, close_source: bool = False) -> None:
        self.pinner = pinner if pinner is not None else BatchPinner()
        self._own_pinner = pinner is None
        enter = None
        if device is not None and torch.device(device).type == "cuda":
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index  # this thread's, not the new one's

            def enter() -> None:
                torch.cuda.set_device(index)

        super().__init__(batches, self.pinner, depth=depth, name="bf-pin-memory", enter_thread=enter,
                         close_source=close_source)

    def close(self) -> None:
        super().close()
        if self._own_pinner:
            self.pinner.close()
