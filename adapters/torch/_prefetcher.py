"""``CUDAPrefetcher``: batches copied to the GPU on a side stream while the model works on the last one.

Two background threads feed the training loop. The *fetch* thread pulls host batches from any iterable
(this package's DataLoader, torch's, a DataFlow). The *stage* thread starts each batch's copy to the
device with ``copy_(non_blocking=True)`` on its own CUDA stream, records an event behind it, and queues
the device batch; the consumer's stream waits on that event before the batch is handed out, and
``record_stream`` tells the caching allocator the batch is used on the consumer's stream.

Where the host bytes come from:

- **Pinned already** (a ``pin_memory=True`` loader, or a shared-memory slab registered as page-locked:
  see :mod:`._pinning`; the prefetcher registers the slabs of the bridgeflow loader or flow it reads,
  through their ``set_mapping_hooks``, for as long as it lives): the copy reads the batch where it lies,
  with no host copy at all. Its :class:`~._pinning.SlabPinner` says ``zero_copy``, so a ``pin_memory=True``
  loader hands tensors in registered slabs out as they are.
- **Pageable** (in-process flows, user iterables): the batch is first copied into reused pinned buffers,
  large tensors by several threads at once (:class:`~._staging.ParallelCopier`). There are
  ``num_stages + 1`` sets of buffers, so staging the next batch never waits for the copy of this one.

No early reuse: host memory a copy reads (a staging buffer, or the batch's own tensors, and with them the
slab they view) is kept until the event of that copy has completed, then let go; a slab goes back to its
worker only then. At the end (exhaustion, an error, an early ``break``) the stage thread waits for every
copy still in flight before releasing anything.

Iterating again ends the iteration in progress first (:meth:`CUDAPrefetcher.close`), whatever the source:
a DataFlow, or a loader over one, has a single reader at a time.

Nested dicts, lists, tuples and namedtuples keep their structure; strings and Python numbers pass
through. With ``device="cpu"`` batches pass through (numpy arrays become tensors, zero copy), so the same
training loop runs without a GPU. ``device="cuda"`` without CUDA raises :class:`DeviceUnavailableError`.

Example:
    >>> from bridgeflow.adapters.torch import CUDAPrefetcher, DataLoader   # doctest: +SKIP
    >>> for x, y in CUDAPrefetcher(DataLoader(ds, batch_size=64, num_workers=4), device="cuda"):
    ...     loss = model(x).sum()                                             # doctest: +SKIP
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import numpy as np

from bridgeflow import BridgeflowError, DataFlow
from bridgeflow.engine import BackgroundIterator, Producer, warn_if_unsharded

from ._compat import torch
from ._convert import map_structure
from ._pinning import CudaHostRegistrar, SlabPinner, attach_pinner
from ._staging import ParallelCopier

__all__ = ["CUDAPrefetcher", "DeviceUnavailableError"]

log = logging.getLogger(__name__)

_NUMERIC = frozenset("biufc")


class DeviceUnavailableError(BridgeflowError, RuntimeError):
    """The device asked for is not usable here (no CUDA build, no GPU, bad index)."""


def _as_tensor(x: Any) -> Any:
    """A numeric numpy array as a tensor (zero copy when torch can view it); anything else unchanged."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in _NUMERIC:
            return x
        if not x.dtype.isnative:  # torch has no byte-swapped dtypes
            x = x.astype(x.dtype.newbyteorder("="))
        if any(s < 0 for s in x.strides):  # a flipped view: torch has no negative strides
            x = np.ascontiguousarray(x)
        return torch.from_numpy(x if x.flags.writeable else x.copy())
    return x


class _CudaBackend:
    """Pinned host buffers, a side stream, events and slab registration on one CUDA device."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def alloc(self, nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, t: Any) -> bool:
        return t.is_pinned()

    def registrar(self) -> Any:
        return CudaHostRegistrar(self.device)

    def context(self) -> Any:
        return torch.cuda.stream(self.stream)

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def to_device(self, host: Any) -> Any:
        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        dev.copy_(host, non_blocking=True)
        return dev

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def query(self, event: Any) -> bool:
        return event.query()

    def wait_consumer(self, event: Any, tensors: list[Any]) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for t in tensors:
            t.record_stream(consumer)


class _Slot:
    """One set of pinned staging buffers (one per leaf, reused), the event of the last copy that read
    them, and the host tensors that copy reads (kept alive until the event has completed)."""

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self.event: Any = None
        self.keep: list[Any] = []

    def staging(self, backend: Any, k: int, like: Any) -> Any:
        nbytes = like.numel() * like.element_size()
        if k == len(self.buffers):
            self.buffers.append(None)
        buf = self.buffers[k]
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[k] = backend.alloc(max(nbytes, 1))
        return buf[:nbytes].view(like.dtype).view(like.shape)

    def wait(self) -> None:
        """Block until the last copy from this slot has completed, then let go of what it read."""
        if self.event is not None:
            self.event.synchronize()
        self.keep = []

    def release_if_done(self, backend: Any) -> None:
        """Let go of the host tensors early when their copy has already completed (no blocking)."""
        query = getattr(backend, "query", None)
        if self.keep and self.event is not None and query is not None and query(self.event):
            self.keep = []


class CUDAPrefetcher:
    """Iterate ``loader`` with each batch already on ``device``; copies overlap with the consumer's work.

    Args:
        loader: any iterable of batches (tensors / numpy arrays in nested dicts, lists, tuples).
        device: ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or ``"cpu"`` for pass-through.
        num_stages: batches on the device ahead of the consumer (>= 1); there is one more set of pinned
            staging buffers than stages.
        copy_threads: threads that copy one large pageable batch into pinned memory; default: a split
            across several threads or torch's ``copy_``, whichever its first copies show faster here.
        pin_slabs: page-lock the shared-memory slabs of the bridgeflow loader or flow being read (where
            it offers ``set_mapping_hooks``), so their batches reach the GPU with no host copy.
    """

    def __init__(self, loader: Iterable, device: Any = "cuda", num_stages: int = 2, *,
                 copy_threads: int | None = None, pin_slabs: bool = True, _backend: Any = None) -> None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"CUDAPrefetcher: num_stages should be a positive integer, got {num_stages!r}")
        if copy_threads is not None and (isinstance(copy_threads, bool) or not isinstance(copy_threads, int)
                                         or copy_threads < 1):
            raise ValueError(f"CUDAPrefetcher: copy_threads should be a positive integer, got {copy_threads!r}")
        if not hasattr(loader, "__iter__"):
            raise TypeError("CUDAPrefetcher: loader should be an iterable of batches, "
                            f"got {type(loader).__name__}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"CUDAPrefetcher: device={device!r} is not a device name") from exc
        self.loader = loader
        self.num_stages = num_stages
        self.copy_threads = copy_threads
        self.pin_slabs = pin_slabs
        self.pinner: SlabPinner | None = None  # set once slabs of the loader are being registered
        self._latest: Any = None  # weak reference to the latest iteration (a generator)
        # The loader's state as of the last batch handed out (``_LIVE``: ask the loader itself), and the
        # thread that fetches batches ahead (it asks the loader for the live state).
        self._delivered: Any = _LIVE
        self._fetch_thread: int | None = None
        self._backend = _backend
        self._shard_checked = False  # a DataFlow read by one of several ranks: warned if unsharded
        self._counts: dict[str, Any] = {"zero_copy": 0, "staged": 0, "staging_copy": None}
        if _backend is None and self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceUnavailableError(
                    f"CUDAPrefetcher: device={device!r} needs CUDA, but torch {torch.__version__} sees no "
                    "CUDA device here (CPU-only build or no GPU); pass device='cpu' to pass batches through")
            if self.device.index is not None and self.device.index >= torch.cuda.device_count():
                raise DeviceUnavailableError(f"CUDAPrefetcher: device={device!r} but only "
                                             f"{torch.cuda.device_count()} CUDA device(s) are visible")
            if self.device.index is None:  # the stager thread must name the device it works on
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif _backend is None and self.device.type != "cpu":
            raise ValueError(f"CUDAPrefetcher: device={device!r}: only 'cuda' devices and 'cpu' are "
                             "supported")

    def __len__(self) -> int:
        loader = self.loader
        if not isinstance(loader, Sized):  # as len() itself: a TypeError
            raise TypeError(f"CUDAPrefetcher: the loader, a {type(loader).__name__}, has no len()")
        return len(loader)

    def stats(self) -> dict[str, Any]:
        """Tensors copied straight from where they lay (``zero_copy``: pinned or in a registered slab)
        and through a staging buffer (``staged``), how large staging copies are made (``staging_copy``:
        ``"split"`` across threads, ``"torch"``'s ``copy_``, ``None`` while undecided), and the slabs
        registered now."""
        registered = self.pinner.registered if self.pinner is not None else {}
        return {**self._counts, "registered_slabs": len(registered),
                "registered_bytes": sum(registered.values()),
                "pinning_failure": self.pinner.failure if self.pinner is not None else None}

    # --- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The loader's state as of the last batch handed to you (the prefetcher reads a few batches
        ahead; the loader's own ``state_dict()`` answers the same while it is read by this prefetcher).

        For a loader with ``state_dict()``: bridgeflow's ``DataLoader``, torchdata's
        ``StatefulDataLoader``, a bridgeflow DataFlow. Restore with :meth:`load_state_dict` (or the
        loader's own) before the next ``iter()``.
        """
        fn = getattr(self.loader, "state_dict", None)
        if not callable(fn):
            raise TypeError(f"CUDAPrefetcher: the loader, a {type(self.loader).__name__}, has no state_dict()")
        delivered = self.delivered_state(self.loader)
        return delivered if delivered is not None else fn()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """End the iteration in progress and give ``state`` to the loader: the next ``iter()`` resumes."""
        fn = getattr(self.loader, "load_state_dict", None)
        if not callable(fn):
            raise TypeError(f"CUDAPrefetcher: the loader, a {type(self.loader).__name__}, has no "
                            "load_state_dict()")
        self.close()
        self._delivered = _LIVE
        fn(state)

    def delivered_state(self, source: Any) -> dict[str, Any] | None:
        """The loader's state as of the last batch handed out, or None where the loader's live state is
        the answer (no batch is held ahead, or the caller is the thread fetching ahead)."""
        delivered = self._delivered
        if delivered is _LIVE or threading.get_ident() == self._fetch_thread:
            return None
        if isinstance(delivered, _StateFailure):  # the loader could not say where it was then
            raise delivered.error
        return copy.deepcopy(delivered)

    def _track(self, loader_state: Callable[[], Any] | None) -> Callable[[Any], Any] | None:
        """What the fetch thread applies to each batch: pair it with the loader's state right after it."""
        if loader_state is None:
            return None

        def with_state(batch: Any) -> tuple[Any, Any]:
            self._fetch_thread = threading.get_ident()
            try:
                state = loader_state()
            except Exception as exc:  # raised only if someone asks for a state (see state_dict)
                state = _StateFailure(exc)
            return batch, state

        return with_state

    def __iter__(self) -> Iterator[Any]:
        """A new iteration; one still held ends here (its threads stop, the loader's iterator is let go),
        so a DataFlow or a DataLoader over one gets a single reader at a time, as frameworks expect."""
        self.close()
        if isinstance(self.loader, DataFlow) and not self._shard_checked:
            self._shard_checked = True
            warn_if_unsharded(self.loader, "CUDAPrefetcher")
        if self._backend is None and self.device.type == "cpu":
            it = self._pass_through()
        else:
            backend = self._backend or _CudaBackend(self.device)
            if self.pin_slabs and self.pinner is None and hasattr(backend, "registrar"):
                pinner = SlabPinner(backend.registrar(), zero_copy=True)  # batches are held until copied
                if attach_pinner(self.loader, pinner):
                    self.pinner = pinner
                    # the registrations end with this prefetcher: the loader, read directly later, copies
                    weakref.finalize(self, pinner.close)
            it = self._pipeline(backend)
        self._latest = weakref.ref(it)
        return it

    def close(self) -> None:
        """End the iteration in progress, if any: its threads are joined, copies in flight completed, and
        the loader's iterator closed or let go. Idempotent; ``iter()`` calls it first."""
        latest, self._latest = (self._latest() if self._latest is not None else None), None
        if latest is not None:
            try:
                latest.close()
            except ValueError as exc:  # "generator already executing": another thread is inside it
                raise RuntimeError("CUDAPrefetcher: the previous iteration is running in another thread; it "
                                   "cannot be ended from here") from exc

    def _pass_through(self) -> Iterator[Any]:
        """``device="cpu"``: the loader's batches, numpy arrays made tensors; its iterator closed at the end."""
        it = iter(self.loader)
        try:
            for batch in it:
                yield map_structure(batch, _as_tensor, (np.ndarray,))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _pipeline(self, backend: Any) -> Iterator[Any]:
        loader_state = getattr(self.loader, "state_dict", None)
        loader_state = loader_state if callable(loader_state) else None
        self._delivered, self._fetch_thread = _LIVE, None
        if loader_state is not None:
            try:  # where this iteration starts (a loaded state, or an epoch boundary)
                self._delivered = loader_state()
            except Exception as exc:
                self._delivered = _StateFailure(exc)
        fetched = BackgroundIterator(self.loader, self._track(loader_state), depth=1, name="bf-cuda-fetch")
        attach = getattr(self.loader, "attach_read_ahead", None)  # bridgeflow._base.ReadAhead
        if loader_state is not None and attach is not None:
            attach(self)  # the loader's (or flow's) own state_dict() now answers with what was handed out
        copier = ParallelCopier(self.copy_threads)
        stage = functools.partial(_stage_loop, fetched, backend, copier, self.num_stages + 1, self._counts,
                                  loader_state is not None)
        stager = Producer(stage, depth=self.num_stages, name="bf-cuda-prefetch")
        try:
            while True:
                try:
                    batch, event, tensors, state = stager.get()
                except BaseException:  # the end of the epoch, or an error: the loader knows where it is
                    self._delivered = _LIVE
                    raise
                backend.wait_consumer(event, tensors)
                if loader_state is not None:
                    self._delivered = state
                yield batch
                del batch, event, tensors
        except StopIteration:
            return
        finally:
            stager.close()
            copier.close()


class _StateFailure:
    """The loader's ``state_dict()`` failed at that point; raised only when that state is asked for."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_LIVE = object()  # no batch held ahead: the loader's own state is the answer


def _stage_batch(batch: Any, slot: _Slot, backend: Any, copier: ParallelCopier,
                 counts: dict[str, Any]) -> tuple[Any, list[Any]]:
    """Start the copies of one batch to the device (on the backend's stream); returns the device batch
    and its device tensors. The host tensors the copies read go to ``slot.keep``."""
    device_tensors: list[Any] = []
    staged_leaves = 0

    def move(x: Any) -> Any:
        nonlocal staged_leaves
        host = _as_tensor(x)
        if not isinstance(host, torch.Tensor) or host.device.type != "cpu":
            return host if isinstance(host, torch.Tensor) else x
        if host.is_contiguous() and backend.is_pinned(host):
            counts["zero_copy"] += 1  # read in place: it must outlive the copy
        else:
            staged = slot.staging(backend, staged_leaves, host)
            staged_leaves += 1
            copier.copy(staged, host)
            counts["staged"] += 1
            counts["staging_copy"] = copier.choice
            host = staged
        slot.keep.append(host)
        dev = backend.to_device(host)
        device_tensors.append(dev)
        return dev

    return map_structure(batch, move, (torch.Tensor, np.ndarray)), device_tensors


def _stage_loop(batches: BackgroundIterator, backend: Any, copier: ParallelCopier, num_buffers: int,
                counts: dict[str, Any], tracked: bool, handle: Any) -> None:
    """The stage thread: start each batch's copy to the device, from where it lies or from a staging
    buffer, and queue it for the consumer. ``num_buffers`` slots rotate; a slot is reused only after the
    copy that last read it has completed, and is one further than the copies in flight."""
    slots = [_Slot() for _ in range(num_buffers)]
    try:
        backend.enter_thread()
        for i, batch in enumerate(batches):
            state = None
            if tracked:  # (batch, the loader's state right after it)
                batch, state = batch
            if handle.stop.is_set():
                return
            for other in slots:
                other.release_if_done(backend)
            slot = slots[i % num_buffers]
            slot.wait()  # the copy that last read these buffers is done
            with backend.context():
                out, device_tensors = _stage_batch(batch, slot, backend, copier, counts)
                slot.event = backend.record()
            del batch  # the host batch now lives on only in slot.keep, until its copy completes
            if not handle.put((out, slot.event, device_tensors, state)):
                return
            del out, device_tensors
    finally:
        for slot in slots:  # nothing a copy still reads may be released (a slab reused, a buffer freed)
            try:
                slot.wait()
            except Exception as exc:  # a broken device: the copies cannot be waited for any more
                log.warning("CUDAPrefetcher: waiting for a copy in flight failed: %s", exc)
        batches.close()  # then the fetch thread stops and closes the loader's iterator (unmapping slabs)
