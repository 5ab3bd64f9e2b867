"""Host stand-ins for CUDAPrefetcher's device backend, shared by the prefetcher and pinning tests.

- ``HostBackend``: plain host buffers, copies that clone, no-op events.
- ``DeferredCopyBackend``: copies run when their event is waited for (stager or consumer).
- ``DmaBackend``: copies run only at host-side waits or when the test runs the copy engine; registered
  ranges (``FakeRegistrar``) count as pinned and are read by address, so ``SimSlab`` catches a slab that
  goes back to its worker before the copy that reads it ran.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np
import torch

from bridgeflow.adapters.torch._pinning import SlabPinner


class HostBackend:
    """Runs the staging pipeline without a GPU: plain host buffers, copies that clone, no-op events.

    Records every staging buffer it hands out, so tests can check reuse."""

    class Event:
        def synchronize(self):
            pass

    def __init__(self):
        self.allocations = 0
        self.consumer_waits = 0
        self.thread_names = set()

    def alloc(self, nbytes):
        self.allocations += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def is_pinned(self, t):
        return False

    def context(self):
        import contextlib

        return contextlib.nullcontext()

    def enter_thread(self):
        self.thread_names.add(threading.current_thread().name)

    def to_device(self, host):
        return host.clone()

    def record(self):
        return self.Event()

    def wait_consumer(self, event, tensors):
        self.consumer_waits += 1


class DeferredCopyBackend(HostBackend):
    """A host backend whose copies are asynchronous, like a DMA on a side stream: ``to_device`` returns a
    NaN-filled tensor and only queues the copy; the copy happens when its event is synchronized (the
    stager, before reusing a buffer) or waited on (the consumer, before using a batch). So a staging
    buffer overwritten before the copy that reads it completed, or a batch handed out before the consumer
    waited, shows up as wrong values."""

    class Event:
        def __init__(self, copies, log):
            self.copies, self.log, self.lock = copies, log, threading.Lock()

        def complete(self, who):
            with self.lock:
                for dst, src in self.copies:
                    dst.copy_(src)
                self.copies = []
            self.log.append((who, id(self)))

        def synchronize(self):
            self.complete("sync")

    def __init__(self, pinned=()):
        super().__init__()
        self.pending = []
        self.log = []
        self.waited_tensors = []
        self.pinned = {t.data_ptr() for t in pinned}

    def is_pinned(self, t):
        return t.data_ptr() in self.pinned

    def to_device(self, host):
        dev = torch.full(host.shape, float("nan")).to(host.dtype) if host.is_floating_point() else \
            torch.full(host.shape, -1, dtype=host.dtype)
        self.pending.append((dev, host))
        self.log.append(("copy", host.data_ptr()))
        return dev

    def record(self):
        event = self.Event(self.pending, self.log)
        self.pending = []
        self.log.append(("record", id(event)))
        return event

    def wait_consumer(self, event, tensors):
        event.complete("wait")
        self.waited_tensors.append([id(t) for t in tensors])
        self.consumer_waits += 1


class FakeRegistrar:
    """Stands for cudaHostRegister: records every call and which ranges are registered."""

    def __init__(self):
        self.calls = []
        self.ranges = {}

    def register(self, address, nbytes):
        self.calls.append(("register", address))
        self.ranges[address] = nbytes

    def unregister(self, address):
        self.calls.append(("unregister", address))
        del self.ranges[address]

    def contains(self, address):
        return any(a <= address < a + n for a, n in self.ranges.items())


class DmaBackend(DeferredCopyBackend):
    """Copies run only when their event is waited for on the host (``synchronize``, as the stager does
    before reusing memory) or when the test runs the copy engine (``run_dma``); the consumer's wait is a
    device-side wait that completes nothing, as on a GPU. A copy from a registered range (the fake
    decides what is pinned: ``registrar.contains``) reads the host bytes by address when it runs, not
    through a reference, so memory let go before its copy ran is caught (see SimSlab)."""

    class Event(DeferredCopyBackend.Event):
        def __init__(self, copies, log):
            super().__init__(copies, log)
            self.done = False

        def complete(self, who):
            with self.lock:
                if self.done:
                    return
                self.done = True
                for dst, src in self.copies:
                    dst.copy_(src.read() if isinstance(src, _RawRead) else src)
            self.log.append((who, id(self)))

    def __init__(self):
        super().__init__()
        self.reg = FakeRegistrar()
        self.events = []

    def registrar(self):
        return self.reg

    def is_pinned(self, t):
        return self.reg.contains(t.data_ptr())

    def to_device(self, host):
        if not self.is_pinned(host):
            return super().to_device(host)
        dev = torch.full(host.shape, -1, dtype=host.dtype)
        self.pending.append((dev, _RawRead(host)))
        self.log.append(("copy", host.data_ptr()))
        return dev

    def record(self):
        event = super().record()
        self.events.append(event)
        return event

    def query(self, event):
        return event.done

    def wait_consumer(self, event, tensors):
        self.waited_tensors.append([id(t) for t in tensors])
        self.consumer_waits += 1

    def run_dma(self):
        for event in list(self.events):
            event.complete("dma")

    def reads_pending(self, lo, hi):
        """Whether a copy not yet run reads bytes in [lo, hi)."""
        return any(not e.done and any(isinstance(src, _RawRead) and lo <= src.address < hi
                                      for _, src in e.copies) for e in self.events)


class _RawRead:
    """The source of a DMA from pinned memory: an address and a length, holding no reference."""

    def __init__(self, host):
        self.address, self.nbytes, self.dtype, self.shape = host.data_ptr(), host.nbytes, host.dtype, host.shape

    def read(self):
        raw = ctypes.string_at(self.address, self.nbytes)
        return torch.frombuffer(bytearray(raw), dtype=self.dtype).reshape(self.shape)


class SimSlab:
    """Stands for a worker's shared-memory slab, registered as pinned: batches are tensors viewing its
    bytes, and when the last view is garbage-collected the slab goes back to its worker, which at once
    writes the next batch over it (0xEE bytes). If a copy that reads it has not run yet, that is an early
    reuse: recorded in ``violations`` (and the copy then reads the scribbled bytes)."""

    def __init__(self, backend, pinner, nbytes=4096):
        self.mem = bytearray(nbytes)  # stands for the mapping: outlives every batch built from it
        self.address = np.frombuffer(self.mem, np.uint8).ctypes.data
        self.backend = backend
        self.violations = []
        self.returned = 0
        pinner.opened(self.mem, self.address, nbytes)

    def batch(self, value, n=64, offset=0):
        lease = np.frombuffer(self.mem, np.uint8, count=n * 4, offset=offset)  # views keep it alive
        arr = lease.view(np.float32)
        arr[:] = value
        weakref.finalize(lease, self._back_to_worker, offset, n * 4)
        return torch.from_numpy(arr)

    def _back_to_worker(self, offset, nbytes):
        if self.backend.reads_pending(self.address + offset, self.address + offset + nbytes):
            self.violations.append("slab reused while a copy still reads it")
        self.mem[offset:offset + nbytes] = b"\xee" * nbytes
        self.returned += 1


def zero_copy_setup(n):
    backend = DmaBackend()
    pinner = SlabPinner(backend.reg)
    slabs = [SimSlab(backend, pinner) for _ in range(n)]
    return backend, pinner, slabs


class FakePinnedMemory:
    """Stands for torch's pinned allocator on a machine without an accelerator, as a DataLoader's
    ``_bf.pin_backend``: remembers the tensors it gave out (while they live) and the threads that asked;
    ``is_pinned`` is true for those, and for ranges a registrar registered (slabs page-locked by a
    ``SlabPinner``)."""

    def __init__(self, registrar=None):
        self.registrar = registrar
        self.live = set()
        self.threads = set()
        self.allocations = 0
        self.lock = threading.Lock()

    def alloc(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        with self.lock:
            self.threads.add(threading.current_thread().name)
            self.allocations += 1
            if t.numel():
                self.live.add(t.data_ptr())
                weakref.finalize(t, self.live.discard, t.data_ptr())
        return t

    def is_pinned(self, t):
        if t.numel() == 0:
            return False
        ptr = t.data_ptr()
        return ptr in self.live or (self.registrar is not None and self.registrar.contains(ptr))
