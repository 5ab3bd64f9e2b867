"""ParallelCopier: a large copy split across threads gives the same bytes as one ``copy_``, for every
dtype, odd sizes and range boundaries that cut through elements; what it cannot split it hands to torch."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import need

need("torch")

import torch

from bridgeflow.adapters.torch._staging import ParallelCopier, default_copy_threads

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool]


def _random(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        return torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g)).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 1000).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 97, 4099, 100_003])
def test_split_copies_are_identical(dtype, n, leak_check):
    src = _random(n, dtype, n)
    with ParallelCopier(threads=3, min_bytes=0, chunk=5) as copier:  # ranges of odd sizes, cutting elements
        dst = torch.zeros_like(src)
        assert copier.copy(dst, src) is dst
        assert copier.parallel(dst, src) == (src.nbytes >= 10)
    assert torch.equal(dst.view(torch.uint8) if dtype == torch.bool else dst,
                       src.view(torch.uint8) if dtype == torch.bool else src)
    assert dst.view(torch.uint8).tolist() == src.view(torch.uint8).tolist()  # bit for bit (NaNs, -0.0)


@pytest.mark.parametrize("shape", [(3, 5, 7), (64, 3, 31, 29), (1,), ()])
def test_shapes_and_a_large_batch(shape, leak_check):
    src = _random(max(1, int(torch.tensor(shape).prod().item()) if shape else 1), torch.float32, 1).reshape(shape)
    with ParallelCopier(threads=4, min_bytes=0, chunk=64) as copier:
        dst = torch.empty(shape)
        copier.copy(dst, src)
    assert torch.equal(dst, src)
    big = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8)  # one raw image batch, 9.6 MB
    with ParallelCopier(threads=4) as copier:
        out = torch.empty_like(big)
        assert copier.parallel(out, big)
        copier.copy(out, big)
    assert torch.equal(out, big)


def test_what_cannot_be_split_goes_to_torch(leak_check):
    with ParallelCopier(threads=4, min_bytes=0, chunk=4) as copier:
        base = torch.arange(200, dtype=torch.float32).reshape(10, 20)
        strided = base.t()  # not contiguous
        dst = torch.empty(20, 10)
        assert not copier.parallel(dst, strided)
        copier.copy(dst, strided)
        assert torch.equal(dst, strided)
        ints = torch.arange(100, dtype=torch.int32)
        floats = torch.empty(100, dtype=torch.float64)  # a dtype conversion
        assert not copier.parallel(floats, ints)
        copier.copy(floats, ints)
        assert floats.tolist() == list(map(float, range(100)))
        conj = torch.complex(torch.ones(50), torch.ones(50)).conj()  # a lazy conjugate view
        out = torch.empty(50, dtype=torch.complex64)
        assert not copier.parallel(out, conj)
        copier.copy(out, conj)
        assert torch.equal(out, conj.resolve_conj())
        grad = torch.ones(1000, requires_grad=True)
        out = torch.empty(1000)
        copier.copy(out, grad.detach())
        assert out.sum().item() == 1000
    small = torch.ones(10)
    with ParallelCopier(threads=4) as copier:  # below min_bytes: one thread, no helper started
        assert not copier.parallel(torch.empty(10), small)
        copier.copy(torch.empty(10), small)
        assert copier._pool is None


def test_the_ranges_run_in_helper_threads_which_close_joins(leak_check, monkeypatch):
    seen = set()
    real = np.copyto

    def spy(dst, src):
        seen.add(threading.current_thread().name)
        real(dst, src)

    src = torch.arange(4096, dtype=torch.int64)
    copier = ParallelCopier(threads=3, min_bytes=0, chunk=1024)
    monkeypatch.setattr(np, "copyto", spy)
    dst = torch.empty_like(src)
    copier.copy(dst, src)
    monkeypatch.undo()
    assert torch.equal(dst, src)
    assert threading.current_thread().name in seen and any(n.startswith("bf-copy") for n in seen)
    assert len(seen) >= 2
    copier.close()
    copier.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        copier.copy(torch.empty_like(src), src)


@pytest.mark.parametrize("kwargs", [dict(threads=0), dict(threads=True), dict(threads=2.0), dict(min_bytes=-1),
                                    dict(chunk=0)])
def test_bad_arguments_are_named(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name} should be an integer"):
        ParallelCopier(**kwargs)


def test_default_threads_fit_the_machine():
    assert 1 <= default_copy_threads() <= 8


@pytest.mark.parametrize("slow", ["split", "torch"])
def test_by_default_the_faster_way_is_chosen_by_timing_both(slow, monkeypatch, leak_check):
    import bridgeflow.adapters.torch._staging as staging

    real_copyto, real_torch = np.copyto, staging._torch_copy

    def slow_copyto(dst, src):
        time.sleep(0.002)
        real_copyto(dst, src)

    def slow_torch(dst, src):
        time.sleep(0.05)  # far slower than the split even with its threads on busy cores
        return real_torch(dst, src)

    if slow == "split":
        monkeypatch.setattr(np, "copyto", slow_copyto)
    else:
        monkeypatch.setattr(staging, "_torch_copy", slow_torch)
    monkeypatch.setattr(staging, "default_copy_threads", lambda: 3)  # a split is possible on any machine
    copier = ParallelCopier(min_bytes=0, chunk=64)
    src = torch.arange(10_000, dtype=torch.int32)
    assert copier.auto and copier.choice is None
    for i in range(2 * staging.TRIALS + 2):
        dst = torch.zeros_like(src)
        copier.copy(dst, src + i)
        assert torch.equal(dst, src + i)  # trials copy too
    copier.close()
    assert copier.choice == ("torch" if slow == "split" else "split")


def test_one_thread_means_torch_copy_and_is_decided_at_once():
    assert ParallelCopier(threads=1).choice == "torch"
    assert ParallelCopier(threads=3).choice == "split"
