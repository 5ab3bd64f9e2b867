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
