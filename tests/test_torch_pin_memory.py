"""BatchPinner: batches copied into page-locked memory with structure, dtypes and values kept; pinned
tensors passed through, registered slabs copied unless zero-copy; checked with a host stand-in for pinned
memory (and for real on a GPU, through a loader's pin thread). The pin thread itself: test_torch_pin_thread."""

from __future__ import annotations

import collections
import threading

import pytest

from conftest import need

need("torch")

import torch

from bridgeflow.adapters.torch import DataLoader
from bridgeflow.adapters.torch._pin_memory import BatchPinner
from bridgeflow.adapters.torch._staging import ParallelCopier

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
Pair = collections.namedtuple("Pair", ["image", "label"])


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


def test_batches_are_pinned_with_structure_and_values_kept(leak_check):
    fake = FakePinned()
    batches = [{"x": torch.arange(1000, dtype=torch.float32) + i, "pair": Pair(torch.full((3,), i), f"n{i}"),
                "mask": torch.tensor([True, False]), "h": torch.ones(5, dtype=torch.bfloat16) * i,
                "t": torch.arange(12).reshape(3, 4).t(), "meta": {"id": i}} for i in range(6)]
    pinner = _pinner(fake)
    out = [pinner(b) for b in batches]
    pinner.close()
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


class Batches(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.items = [{"x": torch.randn(64, 3, 32, 32), "y": torch.arange(64)} for _ in range(4)]

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        return self.items[i]


@needs_cuda
def test_gpu_batches_come_out_pinned(leak_check):
    ds = Batches()
    with DataLoader(ds, batch_size=None, num_workers=2, pin_memory=True) as loader:
        out = list(loader)
    for got, src in zip(out, ds.items):
        assert got["x"].is_pinned() and got["y"].is_pinned()
        assert torch.equal(got["x"], src["x"]) and torch.equal(got["y"], src["y"])
