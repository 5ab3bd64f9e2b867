"""CUDAPrefetcher: pass-through on CPU, the staging pipeline with a host backend, and GPU tests that skip
cleanly without CUDA."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import bridgeflow
from conftest import need, wait_for

need("torch")

import torch
from torch_backends import DeferredCopyBackend, HostBackend

from bridgeflow.adapters.torch import CUDAPrefetcher, DataLoader, DeviceUnavailableError

Pair = collections.namedtuple("Pair", ["image", "label"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _batches(n=5):
    return [{"x": np.full((4, 3), i, dtype=np.float32), "pair": Pair(torch.full((2,), i), i),
             "names": [f"n{i}"], "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + i}
            for i in range(n)]


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
    assert wait_for(lambda: closed) and closed == [True]


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
