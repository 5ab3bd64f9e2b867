"""``CUDAPrefetcher``: batches copied to the GPU on a side stream while the model works on the last one.

A background thread takes host batches from any iterable (this package's DataLoader, torch's, a
DataFlow), stages every tensor and numeric numpy array into a reused pinned buffer (one set of buffers per
stage, grown when a batch is larger, never pinned afresh per batch), and issues ``copy_(non_blocking=True)``
on its own CUDA stream followed by an event. The consumer's stream waits on that event before the batch
is handed out, and ``record_stream`` tells the caching allocator the batch is used on the consumer's
stream, so its memory is not reused while kernels still read it. Nested dicts, lists, tuples and
namedtuples keep their structure; strings and Python numbers pass through.

With ``device="cpu"`` batches pass through (numpy arrays become tensors, zero copy), so the same training
loop runs on a machine without a GPU. ``device="cuda"`` without CUDA raises :class:`DeviceUnavailableError`.

Example:
    >>> from bridgeflow.adapters.torch import CUDAPrefetcher, DataLoader   # doctest: +SKIP
    >>> for x, y in CUDAPrefetcher(DataLoader(ds, batch_size=64, num_workers=4), device="cuda"):
    ...     loss = model(x).sum()                                             # doctest: +SKIP
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from bridgeflow.errors import BridgeflowError

from ._compat import torch
from .convert import map_structure

__all__ = ["CUDAPrefetcher", "DeviceUnavailableError"]

_NUMERIC = frozenset("biufc")
_STOP = object()


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
    """Pinned host buffers, a side stream and events on one CUDA device."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def alloc(self, nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, t: Any) -> bool:
        return t.is_pinned()

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

    def wait_consumer(self, event: Any, tensors: list[Any]) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for t in tensors:
            t.record_stream(consumer)


class _Slot:
    """One stage's pinned buffers (one per leaf, reused) and the event of its last copy."""

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


class CUDAPrefetcher:
    """Iterate ``loader`` with each batch already on ``device``; copies overlap with the consumer's work.

    Args:
        loader: any iterable of batches (tensors / numpy arrays in nested dicts, lists, tuples).
        device: ``"cuda"``, ``"cuda:1"``, a ``torch.device``, or ``"cpu"`` for pass-through.
        num_stages: batches staged ahead of the consumer (>= 1); also the number of pinned buffer sets.
    """

    def __init__(self, loader: Iterable, device: Any = "cuda", num_stages: int = 2, *,
                 _backend: Any = None) -> None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"CUDAPrefetcher: num_stages should be a positive integer, got {num_stages!r}")
        if not hasattr(loader, "__iter__"):
            raise TypeError("CUDAPrefetcher: loader should be an iterable of batches, "
                            f"got {type(loader).__name__}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"CUDAPrefetcher: device={device!r} is not a device name") from exc
        self.loader = loader
        self.num_stages = num_stages
        self._backend = _backend
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
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._backend is None and self.device.type == "cpu":
            return (map_structure(b, _as_tensor, (np.ndarray,)) for b in self.loader)
        backend = self._backend or _CudaBackend(self.device)
        return self._pipeline(backend)

    def _pipeline(self, backend: Any) -> Iterator[Any]:
        ready: queue.Queue = queue.Queue(maxsize=self.num_stages)
        stop = threading.Event()
        args = (iter(self.loader), backend, self.num_stages, ready, stop)
        thread = threading.Thread(target=_stage_loop, args=args, name="bf-cuda-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _STOP:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                batch, event, tensors = item
                backend.wait_consumer(event, tensors)
                yield batch
        finally:
            stop.set()
            while thread.is_alive():
                try:  # unblock a stager waiting on a full queue
                    ready.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _put(ready: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            ready.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _stage_loop(batches: Iterator[Any], backend: Any, num_stages: int, ready: queue.Queue,
                stop: threading.Event) -> None:
    """Background thread: stage each batch in a slot's pinned buffers and start its copy to the device."""
    slots = [_Slot() for _ in range(num_stages)]
    try:
        backend.enter_thread()
        for i, batch in enumerate(batches):
            if stop.is_set():
                return
            slot = slots[i % num_stages]
            if slot.event is not None:
                slot.event.synchronize()  # the copy that last read these buffers is done
            slot.keep = []
            device_tensors: list[Any] = []
            counter = iter(range(1 << 62))

            def move(x: Any, slot: _Slot = slot, device_tensors: list = device_tensors,
                     counter: Iterator[int] = counter) -> Any:
                host = _as_tensor(x)
                if not isinstance(host, torch.Tensor) or host.device.type != "cpu":
                    return host if isinstance(host, torch.Tensor) else x
                if not backend.is_pinned(host):
                    staged = slot.staging(backend, next(counter), host)
                    staged.copy_(host)
                    host = staged
                slot.keep.append(host)
                dev = backend.to_device(host)
                device_tensors.append(dev)
                return dev

            with backend.context():
                out = map_structure(batch, move, (torch.Tensor, np.ndarray))
                slot.event = backend.record()
            if not _put(ready, (out, slot.event, device_tensors), stop):
                return
        _put(ready, _STOP, stop)
    except BaseException as exc:  # handed to the consumer, raised there
        _put(ready, _Failure(exc), stop)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
