"""CUDAPrefetcher with copies that complete later, as DMA does: staging overlaps the previous copy,
batches in registered slabs are read in place, and nothing a copy reads is let go before it ran."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import bridgeflow
from conftest import need

need("torch")

import torch
from torch_backends import DmaBackend, HostBackend, SimSlab, zero_copy_setup

from bridgeflow.adapters.torch import CUDAPrefetcher

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_zero_copy_batches_are_read_in_place_and_kept_until_their_copy_ran(num_stages, leak_check):
    """Tensors in registered slabs are copied from where they lie (no staging buffer), and the slab is
    let go only after the copy that reads it ran: the consumer holds nothing of the host batch."""
    backend, pinner, slabs = zero_copy_setup(8)

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
    backend, pinner, slabs = zero_copy_setup(4)
    batches = ({"pinned": slab.batch(float(i)), "pageable": np.full(5, i, np.int16)} for i, slab in enumerate(slabs))
    prefetcher = CUDAPrefetcher(batches, num_stages=1, _backend=backend)
    got = list(prefetcher)
    backend.run_dma()
    assert [(b["pinned"][0].item(), b["pageable"].tolist()) for b in got] == [(float(i), [i] * 5) for i in range(4)]
    assert prefetcher.stats()["zero_copy"] == 4 and prefetcher.stats()["staged"] == 4
    assert backend.allocations == 2  # one staging buffer (the pageable leaf) per buffer set
    assert [slab.violations for slab in slabs] == [[]] * 4


def test_no_early_reuse_when_the_loader_fails_or_the_consumer_is_interrupted(leak_check):
    backend, pinner, slabs = zero_copy_setup(6)

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
