"""The one place that touches private PyTorch internals (checked by tests/test_torch_compat.py).

``torch.utils.data.get_worker_info()`` reads a module global that torch's own worker loop sets; bridgeflow's
workers set the same global so datasets that shard themselves by worker id behave exactly as under torch.
Everything else here is public API gathered in one spot so the rest of the adapter imports from one module.

If a torch release moves these internals, the canary tests fail first and point here.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from bridgeflow.engine import require, take_block

torch = require("torch", "bridgeflow.adapters.torch")

import torch.utils.data as tud  # noqa: E402  (after the require() that explains a missing torch)

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = [
    "BaseLoaderIter",
    "Dataset",
    "DatasetKind",
    "InfiniteConstantSampler",
    "IterDataPipe",
    "IterableDataset",
    "MapDataPipe",
    "WORKER_MODULE",
    "accelerator_available",
    "apply_random_seed",
    "apply_sharding",
    "clear_worker_info",
    "cpu_count",
    "current_accelerator_type",
    "default_collate",
    "default_convert",
    "distributed_settings",
    "fast_default_collate",
    "get_worker_info",
    "numpy_seed",
    "pipe_for_workers",
    "pipe_from_parent",
    "set_worker_info",
    "seed_group",
    "share_seed",
    "TorchDataLoader",
    "TorchIteratorNames",
    "auto_collation",
    "held_iterator",
    "index_sampler",
    "iterable_length_seen",
    "read_as_iterable",
    "set_held_iterator",
    "torch_generate_state",
    "worker_info_suspended",
]

# Private: the module whose ``_worker_info`` global backs ``torch.utils.data.get_worker_info()``.
WORKER_MODULE = tud._utils.worker

# Public: the classes the adapter subclasses (names mypy can follow, unlike ``torch.utils.data.X`` through the
# module object ``require`` returns).
Dataset = tud.Dataset
IterableDataset = tud.IterableDataset
TorchDataLoader = tud.DataLoader

default_collate = tud.default_collate
default_convert = tud.default_convert
get_worker_info = tud.get_worker_info

# Private: the base class of torch's epoch iterators (code such as Lightning's CombinedLoader recognises
# DataLoader iterators by it), the placeholder sampler of iterable datasets and the dataset-kind enum.
BaseLoaderIter = tud.dataloader._BaseDataLoaderIter
InfiniteConstantSampler = tud.dataloader._InfiniteConstantSampler
DatasetKind = tud.dataloader._DatasetKind


# Private: what torch's DataLoader keeps about itself, read (and two of them set) by the adapter.

def index_sampler(loader: DataLoader) -> Any:
    """What the loader draws each task from: the batch sampler with auto-batching, else the sampler."""
    return loader._index_sampler


def auto_collation(loader: DataLoader) -> bool:
    """Whether samples are batched and collated (``batch_size`` or ``batch_sampler`` given)."""
    return loader._auto_collation


def iterable_length_seen(loader: DataLoader) -> int | None:
    """The length ``len(loader)`` reported for an iterable dataset (torch warns when more batches come)."""
    return loader._IterableDataset_len_called


def read_as_iterable(loader: DataLoader, iterable: bool | None = None) -> bool:
    """Whether torch's loader reads its dataset as an iterable one; ``iterable=True`` makes it (a DataFlow
    read as a stream: ``len(loader)`` then works as for an IterableDataset)."""
    if iterable:
        loader._dataset_kind = DatasetKind.Iterable
    return loader._dataset_kind == DatasetKind.Iterable


def held_iterator(loader: DataLoader) -> Any:
    """The iterator torch's loader holds for its persistent workers (None when it holds none)."""
    return loader.__dict__.get("_iterator")


def set_held_iterator(loader: DataLoader, it: Any) -> None:
    loader._iterator = it


class TorchIteratorNames(BaseLoaderIter):
    """torch's private names for what a DataLoader iterator does, mapped onto bridgeflow's public ones (code
    written for torch's iterators calls them): ``_reset`` is ``reset``, ``_shutdown_workers`` is
    ``shutdown``, ``_workers`` are the worker processes, ``_num_yielded`` the batches handed out. Like
    torch's, an iterator refuses to be pickled. None of torch's iterator code runs.

    A subclass (the epoch iterator) provides the public names: ``reset``, ``shutdown``, ``worker_processes``
    and ``yielded``."""

    yielded: int  # batches handed out this epoch (set by the subclass)

    def reset(self, loader: DataLoader) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    @property
    def worker_processes(self) -> list:
        raise NotImplementedError

    def _reset(self, loader: DataLoader, first_iter: bool = False) -> None:
        self.reset(loader)

    def _shutdown_workers(self) -> None:
        self.shutdown()

    @property
    def _workers(self) -> list:
        return self.worker_processes

    @property
    def _num_yielded(self) -> int:  # type: ignore[override]  # read-only here: torch's __init__ never runs
        return self.yielded

    def __getstate__(self):
        raise TypeError(f"{type(self).__name__} holds an epoch in progress and cannot be pickled")


IterDataPipe = tud.IterDataPipe
MapDataPipe = tud.MapDataPipe


def pipe_for_workers(dataset: Any) -> Any:
    """A DataPipe as torch's loader sends it to spawn and forkserver workers: in torch's wrapper, which pickles
    it with pickle, else with ``dill`` when installed (a lambda in its graph); anything else as it is."""
    from torch.utils.data.datapipes.datapipe import (
        _IterDataPipeSerializationWrapper,
        _MapDataPipeSerializationWrapper,
    )

    if isinstance(dataset, IterDataPipe):
        return _IterDataPipeSerializationWrapper(dataset)
    if isinstance(dataset, MapDataPipe):
        return _MapDataPipeSerializationWrapper(dataset)
    return dataset


def pipe_from_parent(dataset: Any) -> Any:
    """The DataPipe :func:`pipe_for_workers` wrapped, in the worker that unpickled it."""
    from torch.utils.data.datapipes.datapipe import _DataPipeSerializationWrapper

    return getattr(dataset, "_datapipe") if isinstance(dataset, _DataPipeSerializationWrapper) else dataset  # noqa: B009
apply_sharding = tud.graph_settings.apply_sharding
apply_random_seed = tud.graph_settings.apply_random_seed


def distributed_settings() -> tuple[int, int]:
    """``(world_size, rank)`` of the default process group, ``(1, 0)`` outside ``torch.distributed``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def seed_group() -> Any:
    """The process group DataPipe seeds are shared over: a new gloo group under ``torch.distributed`` (a
    collective call: every rank creates its iterator), else None. torch makes one per iterator."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.new_group(backend="gloo")
    return None


def share_seed(generator: Any, group: Any) -> int:
    """The DataPipe shuffle seed of one epoch: drawn from ``generator`` (the global RNG when None) and,
    with a ``group``, rank 0's value sent to every rank, as torch does."""
    seed = torch.empty((), dtype=torch.int64).random_(generator=generator)
    if group is not None:
        torch.distributed.broadcast(seed, src=0, group=group)
    return int(seed.item())


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


# Private: torch's collate engine and its type -> handler map (public API documents editing the map).
COLLATE_MODULE = tud._utils.collate
_NUMERIC_KINDS = frozenset("biufc")


def _stack_numpy(arrays: list[np.ndarray], alloc: Any = None) -> Any:
    """``np.stack`` into a contiguous array (``alloc(shape, dtype)``'s, e.g. in shared memory) then
    ``torch.from_numpy``, contiguous whatever the inputs' layout (as ``torch.stack``); None when torch's own
    path must decide (mixed input)."""
    first = arrays[0]
    dtype, shape = first.dtype, first.shape
    if dtype.kind not in _NUMERIC_KINDS or not dtype.isnative:
        return None
    block = take_block(arrays)  # the samples were read into the rows of one array (a bridgeflow reader's)
    if block is not None:
        try:
            return torch.from_numpy(block)
        except TypeError:  # a numpy dtype torch has no type for
            return None
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape:
            return None
    try:
        out = torch.from_numpy((alloc or np.empty)((len(arrays), *shape), dtype))
    except TypeError:  # a numpy dtype torch has no type for
        return None
    np.stack(arrays, out=out.numpy())
    return out


def _fast_tensor_fn(batch: list, *, collate_fn_map: dict | None = None, alloc: Any = None) -> Any:
    first = batch[0]
    if all(type(t) is torch.Tensor and not t.is_nested and t.device.type == "cpu" and t.layout == torch.strided
           and not t.requires_grad and not t.is_conj() and not t.is_neg() and t.dtype == first.dtype
           for t in batch):
        try:
            out = _stack_numpy([t.numpy() for t in batch], alloc)
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            out = None
        if out is not None:
            return out
    return COLLATE_MODULE.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


def _fast_numpy_fn(batch: list, *, collate_fn_map: dict | None = None, alloc: Any = None) -> Any:
    out = _stack_numpy(batch, alloc)
    if out is not None:
        return out
    return COLLATE_MODULE.collate_numpy_array_fn(batch, collate_fn_map=collate_fn_map)


def fast_default_collate(batch: Any, alloc: Any = None) -> Any:
    """``default_collate`` with the same output, stacking tensors and arrays through numpy, into
    ``alloc(shape, dtype)``'s arrays when given (a worker's shared-memory slab).

    ``torch.stack`` into a fresh tensor pays a page fault per 4 KiB of the new batch (about 3 ms for a
    64x3x224x224 uint8 batch, 5x the copy itself); ``np.empty`` gets recycled memory from the C heap, and a
    slab is reused. Only uniform batches of plain CPU tensors or numeric arrays take this path, and only
    while torch's own handlers are registered (a user's entry in ``default_collate_fn_map`` is respected).
    """
    table = COLLATE_MODULE.default_collate_fn_map
    fast = dict(table)
    if table.get(torch.Tensor) is COLLATE_MODULE.collate_tensor_fn:
        fast[torch.Tensor] = functools.partial(_fast_tensor_fn, alloc=alloc)
    if table.get(np.ndarray) is COLLATE_MODULE.collate_numpy_array_fn:
        fast[np.ndarray] = functools.partial(_fast_numpy_fn, alloc=alloc)
    return COLLATE_MODULE.collate(batch, collate_fn_map=fast)


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
