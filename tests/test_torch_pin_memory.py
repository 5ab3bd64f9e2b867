"""BackgroundIterator and PinMemoryThread: batches produced (pinned) by a background thread, in order,
errors in place, a clean stop however the consumer ends; pinning checked with a host stand-in for
pinned memory (and for real on a GPU)."""

from __future__ import annotations

import collections
import gc
import threading
import time

import numpy as np
import pytest
import torch
from conftest import wait_for

from bridgeflow.adapters.torch.background import BackgroundIterator
from bridgeflow.adapters.torch.pin_memory import BatchPinner, PinMemoryThread
from bridgeflow.adapters.torch.staging import ParallelCopier

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
Pair = collections.namedtuple("Pair", ["image", "label"])


def test_items_come_in_order_computed_in_the_background(leak_check):
    names = []

    def fn(x):
        names.append(threading.current_thread().name)
        return x * 2

    it = BackgroundIterator(range(50), fn, depth=3, name="bf-test")
    assert list(it) == [2 * i for i in range(50)]
    assert set(names) == {"bf-test"} and not it.alive
    assert list(it) == []  # exhausted stays exhausted


def test_it_runs_at_most_depth_items_ahead(leak_check):
    pulled = []

    def source():
        for i in range(100):
            pulled.append(i)
            yield i

    it = BackgroundIterator(source(), depth=2)
    assert next(it) == 0
    time.sleep(0.2)
    # one handed out, two waiting, one produced and blocked on the full queue
    assert len(pulled) <= 1 + 2 + 1
    it.close()
    assert not it.alive


@pytest.mark.parametrize("where", ["source", "fn"])
def test_an_error_arrives_after_the_items_before_it(where, leak_check):
    class ShardMissing(KeyError):
        pass

    def source():
        for i in range(5):
            if where == "source" and i == 3:
                raise ShardMissing("shard 3")
            yield i

    def fn(x):
        if where == "fn" and x == 3:
            raise ShardMissing("shard 3")
        return x

    it = BackgroundIterator(source(), fn)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ShardMissing, match="shard 3"):
        next(it)
    assert not it.alive
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("how", ["close", "with", "garbage"])
def test_stopping_early_joins_the_thread_and_closes_the_source(how, leak_check):
    closed = []

    def endless():
        try:
            i = 0
            while True:
                yield np.full(1000, i)
                i += 1
        finally:
            closed.append(threading.current_thread().name)

    if how == "with":
        with BackgroundIterator(endless(), name="bf-endless") as it:
            next(it)
    else:
        it = BackgroundIterator(endless(), name="bf-endless")
        next(it)
        if how == "close":
            it.close()
        else:
            del it
            gc.collect()
    assert wait_for(lambda: closed == ["bf-endless"])
    assert not any(t.name == "bf-endless" for t in threading.enumerate())


def test_close_source_false_leaves_the_source_open(leak_check):
    class Source:
        closed = False

        def __iter__(self):
            return self

        def __next__(self):
            return 1

        def close(self):
            self.closed = True

    src = Source()
    it = BackgroundIterator(src, close_source=False)
    next(it)
    it.close()
    assert not src.closed


def test_len_and_bad_depth():
    it = BackgroundIterator([1, 2, 3])
    assert len(it) == 3
    it.close()
    with pytest.raises(ValueError, match="depth should be a positive integer"):
        BackgroundIterator([1], depth=0)


# --- pinning --------------------------------------------------------------------------------------------

class FakePinned:
    """Stands for torch's pinned allocator on a machine without one: remembers what it handed out, and in
    which thread; ``is_pinned`` is true for those tensors and for ``also`` (e.g. a registered slab)."""

    def __init__(self, also=()):
        self.ptrs = {t.data_ptr() for t in also}
        self.threads = set()

    def alloc(self, shape, dtype):
        self.threads.add(threading.current_thread().name)
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            self.ptrs.add(t.data_ptr())
        return t

    def is_pinned(self, t):
        return t.numel() > 0 and t.data_ptr() in self.ptrs


def _pinner(fake, **kwargs):
    return BatchPinner(ParallelCopier(threads=2, min_bytes=0, chunk=256), _alloc=fake.alloc,
                       _is_pinned=fake.is_pinned, **kwargs)


def test_batches_are_pinned_in_the_background_with_structure_and_values_kept(leak_check):
    fake = FakePinned()
    batches = [{"x": torch.arange(1000, dtype=torch.float32) + i, "pair": Pair(torch.full((3,), i), f"n{i}"),
                "mask": torch.tensor([True, False]), "h": torch.ones(5, dtype=torch.bfloat16) * i,
                "t": torch.arange(12).reshape(3, 4).t(), "meta": {"id": i}} for i in range(6)]
    pinner = _pinner(fake)
    with PinMemoryThread(iter(batches), pinner) as it:
        out = list(it)
    pinner.close()
    assert fake.threads == {"bf-pin-memory"}  # never the consumer's thread
    for got, src in zip(out, batches):
        assert type(got["pair"]) is Pair and got["pair"].label == src["pair"].label and got["meta"] == src["meta"]
        for key in ("x", "mask", "h", "t"):
            assert got[key].dtype == src[key].dtype and torch.equal(got[key], src[key])
            assert fake.is_pinned(got[key]) and got[key].data_ptr() != src[key].data_ptr()
        assert torch.equal(got["pair"].image, src["pair"].image) and fake.is_pinned(got["pair"].image)
    assert pinner.copied == 6 * 5 and pinner.passed == 0


def test_pinned_tensors_pass_and_registered_slabs_are_copied_unless_zero_copy(leak_check):
    allocator_pinned = torch.ones(100)
    in_slab = torch.full((100,), 2.0)
    fake = FakePinned(also=[allocator_pinned, in_slab])
    slab = (in_slab.data_ptr(), in_slab.data_ptr() + in_slab.nbytes)
    registered = lambda address: slab[0] <= address < slab[1]
    safe = _pinner(fake, registered=registered)
    got = safe([allocator_pinned, in_slab])
    assert got[0] is allocator_pinned and got[1] is not in_slab and torch.equal(got[1], in_slab)
    zero = _pinner(fake, registered=registered, zero_copy=True)
    got = zero([allocator_pinned, in_slab])
    assert got[0] is allocator_pinned and got[1] is in_slab
    safe.close(), zero.close()


def test_requires_grad_and_device_tensors(leak_check):
    fake = FakePinned()
    pinner = _pinner(fake)
    w = torch.ones(4, requires_grad=True)
    meta = torch.empty(3, device="meta")
    got = pinner([w, meta])
    assert got[0].requires_grad and torch.equal(got[0].detach(), w.detach()) and got[1] is meta
    pinner.close()


def test_an_error_from_the_loader_reaches_the_consumer_in_order(leak_check):
    def batches():
        yield torch.zeros(3)
        raise RuntimeError("DataLoader worker (pid 123) exited unexpectedly")

    fake = FakePinned()
    it = PinMemoryThread(batches(), _pinner(fake), close_source=True)
    assert next(it).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        next(it)
    it.pinner.close()


def test_an_unfinished_pin_thread_dropped_by_the_consumer_stops(leak_check):
    fake = FakePinned()
    it = PinMemoryThread((torch.full((10,), i) for i in range(10_000)), _pinner(fake), depth=2)
    next(it)
    pinner = it.pinner
    del it
    gc.collect()
    assert wait_for(lambda: not any(t.name == "bf-pin-memory" for t in threading.enumerate()))
    pinner.close()


def test_the_default_pinner_is_owned_and_closed(leak_check):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only error; the GPU test below pins for real")
    it = PinMemoryThread(iter([torch.zeros(2)]))  # torch cannot pin without an accelerator: the error arrives
    with pytest.raises(RuntimeError):
        next(it)
    it.close()
    assert it.pinner.copier._closed


@needs_cuda
def test_gpu_batches_come_out_pinned(leak_check):
    batches = [{"x": torch.randn(64, 3, 32, 32), "y": torch.arange(64)} for _ in range(4)]
    with PinMemoryThread(iter(batches), device="cuda") as it:
        out = list(it)
    for got, src in zip(out, batches):
        assert got["x"].is_pinned() and got["y"].is_pinned()
        assert torch.equal(got["x"], src["x"]) and torch.equal(got["y"], src["y"])
