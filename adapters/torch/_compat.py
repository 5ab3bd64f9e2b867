"""The one place that touches private PyTorch internals (checked by tests/test_torch_compat.py).

``torch.utils.data.get_worker_info()`` reads a module global that torch's own worker loop sets; bridgeflow's
workers set the same global so datasets that shard themselves by worker id behave exactly as under torch.
Everything else here is public API gathered in one spot so the rest of the adapter imports from one module.

If a torch release moves these internals, the canary tests fail first and point here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from bridgeflow._deps import require

torch = require("torch", "bridgeflow.adapters.torch")

import torch.utils.data as tud  # noqa: E402  (after the require() that explains a missing torch)

__all__ = [
    "WORKER_MODULE",
    "accelerator_available",
    "clear_worker_info",
    "cpu_count",
    "current_accelerator_type",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "numpy_seed",
    "set_worker_info",
    "torch_generate_state",
    "worker_info_suspended",
]

# Private: the module whose ``_worker_info`` global backs ``torch.utils.data.get_worker_info()``.
WORKER_MODULE = tud._utils.worker

default_collate = tud.default_collate
default_convert = tud.default_convert
get_worker_info = tud.get_worker_info


def set_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> None:
    """Make ``get_worker_info()`` in this process report a DataLoader worker, as torch's worker loop does."""
    WORKER_MODULE._worker_info = WORKER_MODULE.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
    )


def clear_worker_info() -> None:
    """Back to "not in a worker" (``get_worker_info()`` returns None)."""
    WORKER_MODULE._worker_info = None


@contextlib.contextmanager
def worker_info_suspended() -> Iterator[None]:
    """Hide the worker info for a moment.

    torch's ``default_collate`` stacks into a fresh torch shared-memory segment whenever it runs in a worker;
    bridgeflow's transport already moves the batch through its own reused shared memory, so the default
    collate runs with the info hidden and allocates ordinary memory (same values, one mapping fewer).
    """
    saved = WORKER_MODULE._worker_info
    WORKER_MODULE._worker_info = None
    try:
        yield
    finally:
        WORKER_MODULE._worker_info = saved


def torch_generate_state(base_seed: int, worker_id: int) -> list[int] | None:
    """torch's private numpy-seed derivation, or None if this torch lacks it (used by the canary test)."""
    fn = getattr(WORKER_MODULE, "_generate_state", None)
    return None if fn is None else list(fn(base_seed, worker_id))


_MASK32 = 0xFFFFFFFF


def numpy_seed(base_seed: int, worker_id: int) -> np.ndarray:
    """The seed torch's worker loop gives ``numpy.random.seed``: four 32-bit words.

    torch hashes ``[worker_id, low32(base_seed), high32(base_seed), 0]`` with numpy's SeedSequence mixing
    and a pool of 4 words; numpy's public ``SeedSequence`` with the same entropy gives the same words.
    """
    entropy = [worker_id & _MASK32, base_seed & _MASK32, (base_seed >> 32) & _MASK32, 0]
    return np.random.SeedSequence(entropy, pool_size=4).generate_state(4)


def accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS...); torch pins memory only then."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return bool(torch.cuda.is_available())


def current_accelerator_type() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "current_accelerator"):
        dev = acc.current_accelerator()
        return None if dev is None else dev.type
    return "cuda" if torch.cuda.is_available() else None


def cpu_count() -> int | None:
    """CPUs this process may use (respects the affinity mask where the OS has one), like torch's check."""
    if hasattr(os, "sched_getaffinity"):
        try:
            return len(os.sched_getaffinity(0))
        except OSError:
            pass
    return os.cpu_count()
