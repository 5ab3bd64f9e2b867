"""CUDAPrefetcher: pass-through on CPU, the staging pipeline with a host backend, and GPU tests that skip
cleanly without CUDA."""

from __future__ import annotations

import collections
import ctypes
import gc
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import bridgeflow
from bridgeflow.adapters.torch import CUDAPrefetcher, DataLoader, DeviceUnavailableError
from bridgeflow.adapters.torch.pinning import SlabPinner

Pair = collections.namedtuple("Pair", ["image", "label"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batches(n=5):
    return [{"x": np.full((4, 3), i, dtype=np.float32), "pair": Pair(torch.full((2,), i), i),
             "names": [f"n{i}"], "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + i}
            for i in range(n)]


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


def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _as_tensors(batch):
    return {**batch, "x": torch.from_numpy(batch["x"])}


def test_cpu_pass_through_turns_arrays_into_tensors():
    batches = _batches()
    out = list(CUDAPrefetcher(batches, device="cpu"))
    for got, src in zip(out, batches):
        _same(got, _as_tensors(src))
        assert np.shares_memory(got["x"].numpy(), src["x"])  # zero copy
    assert len(CUDAPrefetcher(batches, device="cpu")) == 5


def test_without_cuda_it_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
        CUDAPrefetcher(_batches(), device="cuda")
    with pytest.raises(RuntimeError):  # DeviceUnavailableError is a RuntimeError too
        CUDAPrefetcher(_batches())


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_stages=0), "num_stages should be a positive integer"),
    (dict(num_stages=True), "num_stages should be a positive integer"),
    (dict(device="tpu:0"), "is not a device name|only 'cuda' devices"),
    (dict(device="meta"), "only 'cuda' devices"),
    (dict(device="cpu", copy_threads=0), "copy_threads should be a positive integer"),
    (dict(device="cpu", copy_threads=2.0), "copy_threads should be a positive integer"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CUDAPrefetcher(_batches(), **kwargs)


def test_loader_that_is_not_iterable():
    with pytest.raises(TypeError, match="iterable of batches, got int"):
        CUDAPrefetcher(3, device="cpu")


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_staging_pipeline_keeps_structure_and_values(num_stages, leak_check):
    backend = HostBackend()
    batches = _batches(7)
    out = list(CUDAPrefetcher(batches, num_stages=num_stages, _backend=backend))
    for got, src in zip(out, batches):
        _same(got, _as_tensors(src))
        assert not np.shares_memory(got["x"].numpy(), src["x"])  # it went through staging and a copy
    assert len(out) == 7 and backend.consumer_waits == 7
    assert backend.thread_names == {"bf-cuda-prefetch"}
    # buffers are reused: one per tensor leaf (x, pair.image, t) per buffer set (one more than the
    # stages), never per batch
    assert backend.allocations == 3 * min(num_stages + 1, 7)


def test_staging_buffers_grow_when_a_batch_is_larger(leak_check):
    backend = HostBackend()
    batches = [np.zeros(4, np.float32), np.ones(16, np.float32), np.full(8, 2, np.float32),
               np.full(32, 3, np.float32)]
    out = list(CUDAPrefetcher(batches, num_stages=1, _backend=backend))
    assert [o.tolist() for o in out] == [b.tolist() for b in batches]
    # two buffer sets: set 0 sees 4 then 8 floats (grows once), set 1 sees 16 then 32 (grows once)
    assert backend.allocations == 4


def test_loader_error_reaches_the_consumer(leak_check):
    def gen():
        yield np.zeros(2)
        raise KeyError("shard 3 missing")

    it = iter(CUDAPrefetcher(gen(), _backend=HostBackend()))
    assert next(it).tolist() == [0.0, 0.0]
    with pytest.raises(KeyError, match="shard 3 missing"):
        next(it)


def test_early_break_stops_the_thread_and_closes_the_source(leak_check):
    closed = []

    def endless():
        try:
            i = 0
            while True:
                yield np.full(3, i)
                i += 1
        finally:
            closed.append(True)

    for i, _ in enumerate(CUDAPrefetcher(endless(), num_stages=2, _backend=HostBackend())):
        if i == 3:
            break
    deadline = time.monotonic() + 2
    while not closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == [True]


def test_wraps_the_dataloader_and_a_dataflow(leak_check):
    source = bridgeflow.DataFromList([[np.full(2, i), i] for i in range(6)], shuffle=False)
    flow = bridgeflow.BatchData(source, 3)
    out = list(CUDAPrefetcher(flow, _backend=HostBackend()))
    assert [o[1].tolist() for o in out] == [[0, 1, 2], [3, 4, 5]]
    flow.close()
    loader = DataLoader(list(range(10)), batch_size=4, num_workers=2)
    assert [b.tolist() for b in CUDAPrefetcher(loader, device="cpu")] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# --- on a GPU ----------------------------------------------------------------------------------------

@needs_cuda
def test_gpu_batches_arrive_on_the_device_with_equal_values():
    batches = _batches(6)
    out = list(CUDAPrefetcher(batches, device="cuda", num_stages=2))
    for got, src in zip(out, batches):
        assert got["x"].is_cuda and got["pair"].image.is_cuda and got["t"].dtype == torch.bfloat16
        _same({k: v for k, v in got.items() if k != "pair"} | {"x": got["x"].cpu(), "t": got["t"].cpu()},
              {k: v for k, v in _as_tensors(src).items() if k != "pair"})
        assert got["pair"].image.cpu().tolist() == src["pair"].image.tolist()


@needs_cuda
def test_gpu_values_are_not_overwritten_by_later_batches():
    """Staging buffers are reused; batches held by the consumer must keep their own values."""
    batches = [np.full((256, 1024), i, dtype=np.float32) for i in range(8)]
    held = list(CUDAPrefetcher(batches, device="cuda", num_stages=2))
    torch.cuda.synchronize()
    assert [int(h[0, 0].item()) for h in held] == list(range(8))


@needs_cuda
def test_gpu_with_pinned_dataloader_batches():
    loader = DataLoader([np.full(3, i, np.float32) for i in range(6)], batch_size=2, pin_memory=True)
    out = [b.cpu().tolist() for b in CUDAPrefetcher(loader, device="cuda")]
    assert out == [[[0.0] * 3, [1.0] * 3], [[2.0] * 3, [3.0] * 3], [[4.0] * 3, [5.0] * 3]]


# --- the stream discipline, checked on the host -------------------------------------------------------

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


def _leaves(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return []


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_buffers_are_reused_only_after_their_copy_completed(num_stages, leak_check):
    backend = DeferredCopyBackend()
    batches = [{"x": np.full((8, 4), i, np.float32), "y": torch.arange(5) + i, "tag": f"b{i}"} for i in range(12)]
    held = list(CUDAPrefetcher(batches, num_stages=num_stages, _backend=backend))  # the consumer holds all
    for i, got in enumerate(held):
        assert got["x"].eq(i).all() and got["y"].tolist() == list(range(i, i + 5)) and got["tag"] == f"b{i}"
    assert backend.allocations == 2 * min(num_stages + 1, 12)
    # each reuse of a staging buffer comes after the event recorded behind its previous copy completed
    last_event_of: dict[int, int] = {}
    done: set[int] = set()
    current: list[int] = []
    for entry in backend.log:
        if entry[0] == "copy":
            ptr = entry[1]
            if ptr in last_event_of:
                assert last_event_of[ptr] in done, "a staging buffer was reused before its copy completed"
            current.append(ptr)
        elif entry[0] == "record":
            for ptr in current:
                last_event_of[ptr] = entry[1]
            current = []
        else:
            done.add(entry[1])


def test_consumer_waits_on_each_batch_and_gets_every_device_tensor_recorded(leak_check):
    backend = DeferredCopyBackend()
    batches = [(np.full(3, i, np.float64), [torch.full((2,), i), {"z": np.int32([i])}]) for i in range(6)]
    out = []
    for batch in CUDAPrefetcher(batches, num_stages=2, _backend=backend):
        out.append(batch)
        # the batch handed out is complete: the consumer waited on its event (no NaN / -1 left)
        assert batch[0].tolist() == [len(out) - 1] * 3 and batch[1][0].tolist() == [len(out) - 1] * 2
    assert [[id(t) for t in _leaves(b)] for b in out] == backend.waited_tensors  # record_stream on each
    assert [b[1][1]["z"].dtype for b in out] == [torch.int32] * 6


def test_shapes_that_grow_and_shrink_reuse_and_grow_the_buffers(leak_check):
    backend = DeferredCopyBackend()
    sizes = [4, 16, 2, 16, 32, 1, 0, 8]
    batches = [np.arange(n, dtype=np.int64) * 10 + k for k, n in enumerate(sizes)]
    held = list(CUDAPrefetcher(batches, num_stages=2, _backend=backend))
    assert [h.tolist() for h in held] == [b.tolist() for b in batches]
    # three buffer sets: set 0 sees 4, 16, 0 (grows once); set 1 sees 16, 32, 8 (grows once); set 2
    # sees 2, 1 (never grows)
    assert backend.allocations == 5


def test_pinned_host_tensors_are_copied_from_directly_and_kept_until_copied(leak_check):
    pinned = [torch.full((64,), float(i)) for i in range(5)]
    backend = DeferredCopyBackend(pinned=pinned)
    held = list(CUDAPrefetcher([[t] for t in pinned], num_stages=2, _backend=backend))
    assert backend.allocations == 0  # no staging buffer for batches that are pinned already
    assert [float(h[0][0]) for h in held] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_leaves_that_are_not_numeric_arrays_pass_through_unchanged(leak_check):
    strings, objects = np.array(["a", "b"]), np.array([{"k": 1}, None], dtype=object)
    batch = {"s": strings, "o": objects, "n": None, "i": 3, "f": 2.5, "b": b"raw", "t": ("x", [1, 2])}
    backend = DeferredCopyBackend()
    (got,) = list(CUDAPrefetcher([batch], _backend=backend))
    assert got["s"] is strings and got["o"] is objects
    assert {k: got[k] for k in ("n", "i", "f", "b", "t")} == {k: batch[k] for k in ("n", "i", "f", "b", "t")}
    assert backend.allocations == 0 and backend.waited_tensors == [[]]


def test_arrays_torch_cannot_view_are_converted(leak_check):
    flipped = np.arange(6, dtype=np.float32)[::-1]
    swapped = np.arange(3, dtype=">i4")
    for kwargs in (dict(device="cpu"), dict(_backend=DeferredCopyBackend())):
        (got,) = list(CUDAPrefetcher([[flipped, swapped]], **kwargs))
        assert got[0].tolist() == flipped.tolist() and got[1].tolist() == [0, 1, 2]
        assert got[1].dtype == torch.int32


def test_early_break_over_the_dataloader_ends_its_workers(leak_check):
    loader = DataLoader([np.full(4, i, np.float32) for i in range(64)], batch_size=2, num_workers=2)
    for i, batch in enumerate(CUDAPrefetcher(loader, num_stages=2, _backend=DeferredCopyBackend())):
        assert batch.tolist() == [[2.0 * i] * 4, [2.0 * i + 1] * 4]
        if i == 2:
            break


# --- copies that complete later, as DMA does: overlap, zero-copy, no early reuse -----------------------

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


def _zero_copy_setup(n):
    backend = DmaBackend()
    pinner = SlabPinner(backend.reg)
    slabs = [SimSlab(backend, pinner) for _ in range(n)]
    return backend, pinner, slabs


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_zero_copy_batches_are_read_in_place_and_kept_until_their_copy_ran(num_stages, leak_check):
    """Tensors in registered slabs are copied from where they lie (no staging buffer), and the slab is
    let go only after the copy that reads it ran: the consumer holds nothing of the host batch."""
    backend, pinner, slabs = _zero_copy_setup(8)

    def source():  # keeps no reference to a batch once it has been yielded
        for i, slab in enumerate(slabs):
            yield {"x": slab.batch(float(i)), "i": i}

    got = []
    for batch in CUDAPrefetcher(source(), num_stages=num_stages, _backend=backend):
        got.append(batch)
        gc.collect()
    backend.run_dma()
    assert [slab.violations for slab in slabs] == [[]] * 8
    assert [b["x"][0].item() for b in got] == [float(i) for i in range(8)]
    assert all(b["x"].eq(b["i"]).all() for b in got)
    assert backend.allocations == 0  # no staging buffer was ever needed
    assert [slab.returned for slab in slabs] == [1] * 8  # every slab went back to its worker


def test_zero_copy_and_staged_leaves_in_one_batch(leak_check):
    backend, pinner, slabs = _zero_copy_setup(4)
    batches = ({"pinned": slab.batch(float(i)), "pageable": np.full(5, i, np.int16)} for i, slab in enumerate(slabs))
    prefetcher = CUDAPrefetcher(batches, num_stages=1, _backend=backend)
    got = list(prefetcher)
    backend.run_dma()
    assert [(b["pinned"][0].item(), b["pageable"].tolist()) for b in got] == [(float(i), [i] * 5) for i in range(4)]
    assert prefetcher.stats()["zero_copy"] == 4 and prefetcher.stats()["staged"] == 4
    assert backend.allocations == 2  # one staging buffer (the pageable leaf) per buffer set
    assert [slab.violations for slab in slabs] == [[]] * 4


def test_no_early_reuse_when_the_loader_fails_or_the_consumer_is_interrupted(leak_check):
    backend, pinner, slabs = _zero_copy_setup(6)

    def failing():
        for i, slab in enumerate(slabs[:3]):
            yield slab.batch(float(i))
        raise RuntimeError("worker 1 died")

    with pytest.raises(RuntimeError, match="worker 1 died"):
        for _ in CUDAPrefetcher(failing(), num_stages=2, _backend=backend):
            pass
    with pytest.raises(KeyboardInterrupt):
        for _ in CUDAPrefetcher((s.batch(1.0) for s in slabs[3:]), num_stages=2, _backend=backend):
            raise KeyboardInterrupt  # Ctrl-C in the training step while copies are in flight
    gc.collect()
    assert [slab.violations for slab in slabs] == [[]] * 6
    # the batches issued were all copied before their slabs went back (the last one may not have been read)
    assert sum(slab.returned for slab in slabs) >= 4


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_staging_the_next_batch_overlaps_the_copy_of_this_one(num_stages, leak_check):
    """Batch i+1 is staged and its copy issued before anything waits for batch i's copy: the stager
    never waits for the copy it should overlap (only for older ones, whose buffers it reuses)."""
    backend = DmaBackend()
    batches = [np.full((16,), i, np.float32) for i in range(8)]
    got = []
    for b in CUDAPrefetcher(batches, num_stages=num_stages, _backend=backend):
        got.append(b)
    backend.run_dma()
    assert [int(b[0]) for b in got] == list(range(8))
    order = {}  # event id -> position of its record and of its first completion in the log
    for pos, (what, key) in enumerate(backend.log):
        if what == "record":
            order[key] = [pos, None]
        elif what in ("sync", "dma", "wait") and key in order and order[key][1] is None:
            order[key][1] = pos
    events = [id(e) for e in backend.events]
    for i in range(len(events) - 1):
        assert order[events[i + 1]][0] < order[events[i]][1], f"batch {i + 1} waited for batch {i}'s copy"
    # and the stager synchronized only on copies num_stages + 1 batches back, when it reused their buffers
    syncs = [events.index(key) for what, key in backend.log if what == "sync" and key in events]
    records_before = [sum(1 for w, _ in backend.log[:backend.log.index(("sync", events[j]))] if w == "record")
                      for j in syncs[:3]]
    assert all(r - j >= num_stages + 1 for r, j in zip(records_before, syncs)), (records_before, syncs)


def test_the_loader_is_read_in_its_own_thread_and_large_batches_by_several(leak_check):
    names = set()

    def source():
        for i in range(3):
            names.add(threading.current_thread().name)
            yield torch.arange(3_000_000, dtype=torch.float32) + i  # 12 MB: split across copy threads

    backend = HostBackend()
    out = list(CUDAPrefetcher(source(), num_stages=2, copy_threads=3, _backend=backend))
    assert names == {"bf-cuda-fetch"} and backend.thread_names == {"bf-cuda-prefetch"}
    for i, t in enumerate(out):
        assert torch.equal(t, torch.arange(3_000_000, dtype=torch.float32) + i)


def test_slabs_of_a_hooked_flow_are_registered_once_and_unregistered_on_close(leak_check):
    """A flow offering ``set_mapping_hooks`` gets the prefetcher's pinner; its slabs are then read in
    place. The flow stands for a parallel stage: it maps slabs and calls the hooks as the core does."""
    backend = DmaBackend()

    class HookedFlow(bridgeflow.DataFlow):
        def __init__(self):
            self.hooks = None
            self.slabs = []

        def set_mapping_hooks(self, hooks):
            self.hooks = hooks

        def __iter__(self):
            if not self.slabs:
                self.slabs = [SimSlab(backend, self.hooks) for _ in range(2)]  # opened() once each
            for i in range(6):  # a region of its own per batch: the flow itself never overwrites a batch
                yield [self.slabs[i % 2].batch(float(i), offset=(i // 2) * 256), i]

        def close(self):
            for slab in self.slabs:
                self.hooks.closing(slab.mem, slab.address, len(slab.mem))
            self.slabs = []

    flow = HookedFlow()
    prefetcher = CUDAPrefetcher(flow, num_stages=1, _backend=backend)
    for _ in range(2):  # two epochs: the slabs stay registered between them
        got = list(prefetcher)
        backend.run_dma()
        assert [(b[0][0].item(), b[1]) for b in got] == [(float(i), i) for i in range(6)]
    assert prefetcher.pinner is not None and flow.hooks is prefetcher.pinner
    assert prefetcher.stats()["zero_copy"] == 12 and prefetcher.stats()["registered_slabs"] == 2
    flow.close()
    registers = [a for op, a in backend.reg.calls if op == "register"]
    unregisters = [a for op, a in backend.reg.calls if op == "unregister"]
    assert sorted(registers) == sorted(unregisters) and len(registers) == 2 and backend.reg.ranges == {}


def test_a_loader_without_hooks_gets_no_pinner(leak_check):
    prefetcher = CUDAPrefetcher([np.zeros(3)], _backend=DmaBackend())
    list(prefetcher)
    assert prefetcher.pinner is None and prefetcher.stats()["registered_slabs"] == 0


@needs_cuda
def test_gpu_batches_in_a_registered_shared_memory_mapping_are_copied_in_place():
    import mmap
    import os

    size = 4 << 20
    path = f"/dev/shm/bf{os.getpid()}_gputest"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        os.unlink(path)
    address = np.frombuffer(mm, np.uint8).ctypes.data

    class Flow(bridgeflow.DataFlow):
        """Stands for a parallel stage: one mapping, announced to the hook, a region of it per batch."""

        hooks = None

        def set_mapping_hooks(self, hooks):
            self.hooks = hooks

        def __iter__(self):
            self.hooks.opened(mm, address, size)
            for i in range(4):
                x = torch.frombuffer(mm, dtype=torch.float32, count=1 << 18, offset=i << 20)
                x.fill_(i)
                yield x

    flow = Flow()
    prefetcher = CUDAPrefetcher(flow, device="cuda", num_stages=1)
    out = [x.clone() for x in prefetcher]
    torch.cuda.synchronize()
    stats = prefetcher.stats()
    assert stats["pinning_failure"] is None, stats["pinning_failure"]
    assert stats["zero_copy"] == 4 and stats["staged"] == 0 and stats["registered_bytes"] == size
    assert [(x.min().item(), x.max().item()) for x in out] == [(float(i), float(i)) for i in range(4)]
    flow.hooks.closing(mm, address, size)
    assert prefetcher.pinner.registered == {}
    gc.collect()
    mm.close()


@needs_cuda
def test_gpu_large_pageable_batches_through_several_copy_threads():
    batches = [torch.randn(4, 1 << 20) for _ in range(5)]
    out = [b.cpu() for b in CUDAPrefetcher(batches, device="cuda", copy_threads=4)]
    assert all(torch.equal(a, b) for a, b in zip(out, batches))
