"""Canary tests for the private torch internals used in bridgeflow.adapters.torch._compat.

If a torch release moves them, these fail first and point at the one module to fix.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from bridgeflow.adapters.torch import _compat


@pytest.fixture
def clean_worker_info():
    yield
    _compat.clear_worker_info()


def test_worker_info_global_and_class_exist():
    assert hasattr(_compat.WORKER_MODULE, "_worker_info")
    fields = {f.name for f in dataclasses.fields(_compat.WORKER_MODULE.WorkerInfo)}
    assert {"id", "num_workers", "seed", "dataset"} <= fields
    assert tud.get_worker_info() is None  # the test process is not a worker


def test_set_worker_info_is_what_get_worker_info_returns(clean_worker_info):
    dataset = object()
    _compat.set_worker_info(1, 4, 12345, dataset)
    info = tud.get_worker_info()
    assert (info.id, info.num_workers, info.seed) == (1, 4, 12345) and info.dataset is dataset
    with _compat.worker_info_suspended():
        assert tud.get_worker_info() is None
    assert tud.get_worker_info() is info
    _compat.clear_worker_info()
    assert tud.get_worker_info() is None


def test_default_collate_uses_torch_shared_memory_only_inside_a_worker(clean_worker_info):
    """Why fetch.py hides the worker info around the default collate: inside a worker, torch's collate
    allocates a fresh torch shared-memory segment per batch."""
    batch = [torch.zeros(4), torch.ones(4)]
    assert not _compat.default_collate(batch).is_shared()
    _compat.set_worker_info(0, 1, 0, None)
    assert _compat.default_collate(batch).is_shared()
    with _compat.worker_info_suspended():
        assert not _compat.default_collate(batch).is_shared()


@pytest.mark.parametrize("base_seed", [0, 1, 2**31 + 7, 2**32, 12345678901234567, 2**63 - 1, -5])
@pytest.mark.parametrize("worker_id", [0, 1, 7])
def test_numpy_seed_equals_torchs_private_derivation(base_seed, worker_id):
    reference = _compat.torch_generate_state(base_seed, worker_id)
    assert reference is not None, "torch.utils.data._utils.worker._generate_state is gone"
    assert _compat.numpy_seed(base_seed, worker_id).tolist() == reference


def test_numpy_seed_words_seed_numpy():
    np.random.seed(_compat.numpy_seed(3, 1))
    a = np.random.randint(1 << 30, size=4)
    np.random.seed(_compat.torch_generate_state(3, 1))
    assert np.array_equal(a, np.random.randint(1 << 30, size=4))


def test_accelerator_probe_agrees_with_torch():
    assert _compat.accelerator_available() == torch.accelerator.is_available()
    assert _compat.cpu_count() >= 1


def _same_or_same_error(batch):
    def run(fn):
        try:
            return fn(batch)
        except Exception as exc:
            return type(exc), str(exc)
    return run(tud.default_collate), run(_compat.fast_default_collate)


@pytest.mark.parametrize("batch", [
    [np.full((2, 3), i, dtype=np.uint8) for i in range(4)],
    [np.arange(3, dtype=np.float16), np.arange(3, dtype=np.float16)],
    [np.arange(3, dtype=">i4"), np.arange(3, dtype=">i4")],  # non-native byte order: torch decides
    [np.arange(3), np.arange(4)],  # ragged: torch's error
    [np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)],  # mixed dtypes: torch's promotion rules
    [np.array(["a", "b"]), np.array(["c", "d"])],  # strings: torch's TypeError
    [torch.arange(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)],
    [torch.arange(6).reshape(2, 3).t(), torch.zeros(3, 2, dtype=torch.int64)],  # non-contiguous
    [{"img": np.ones((2, 2), np.float32), "y": 1}, {"img": np.zeros((2, 2), np.float32), "y": 2}],
    [(torch.ones(2), "a"), (torch.zeros(2), "b")],
])
def test_fast_default_collate_equals_default_collate(batch):
    ref, got = _same_or_same_error(batch)
    if isinstance(ref, tuple) and len(ref) == 2 and isinstance(ref[0], type):
        assert got == ref
        return
    flat_ref, flat_got = [ref], [got]
    while flat_ref:
        a, b = flat_ref.pop(), flat_got.pop()
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            flat_ref.extend(a.values())
            flat_got.extend(b.values())
        elif isinstance(a, (list, tuple)):
            flat_ref.extend(a)
            flat_got.extend(b)
        else:
            assert a == b


def test_fast_default_collate_respects_a_users_handler(monkeypatch):
    table = _compat.COLLATE_MODULE.default_collate_fn_map
    monkeypatch.setitem(table, np.ndarray, lambda batch, *, collate_fn_map=None: "mine")
    assert _compat.fast_default_collate([np.zeros(2), np.ones(2)]) == "mine"
