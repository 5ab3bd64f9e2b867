"""``DataLoader``: torch's constructor and batches, bridgeflow's workers and shared-memory transport.

Switch by changing one import::

    from bridgeflow.adapters.torch import DataLoader   # instead of torch.utils.data.DataLoader

Arguments, validation errors, ``len()``, sampler and batch_sampler handling, the random streams (worker seeds
and shuffles drawn from ``generator``), ``get_worker_info()`` inside workers and the task-to-worker
assignment follow torch, so the same arguments give the same batches. Workers are bridgeflow's
:class:`~bridgeflow.parallel.pool.WorkerPool`: batches come back through reused shared memory, arrays and
tensors without pickling their bytes.

Differences, on purpose:

- a bridgeflow :class:`~bridgeflow.DataFlow` is accepted as ``dataset``: it is length-free, iterated once
  per epoch in this process, and with ``num_workers > 0`` only ``collate_fn`` runs in the workers (put
  parallel stages inside the flow to parallelise the flow itself);
- ``in_order=False`` hands out map-style batches as they are ready, as torch does; iterable datasets and
  DataFlows keep their order (torch allows, never promises, reordering);
- a tensor that a worker returns without collation (``batch_size=None``, a custom ``collate_fn``) arrives
  with the same dtype, shape and values but compact: a view keeps neither its strides nor its sharing of
  storage with other returned tensors (torch ships the whole storage of every view, which costs a copy of
  e.g. a whole in-memory table per sample);
- an exception of a DataFlow comes after the batches read before it, as with ``num_workers=0``;
- a worker whose ``worker_init_fn`` or ``iter(dataset)`` failed raises that error with its first batch
  (as torch), then a ``RuntimeError`` naming it for its later map-style batches; an iterable worker is
  then exhausted (torch raises an ``UnboundLocalError`` for each);
- DataPipes get no sharding or shuffle settings (torch deprecated them);
- ``close()`` ends persistent workers now instead of at garbage collection.

Example:
    >>> import torch
    >>> from bridgeflow.adapters.torch import DataLoader
    >>> loader = DataLoader(list(range(10)), batch_size=4)
    >>> [b.tolist() for b in loader]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
"""

from __future__ import annotations

import math
import multiprocessing as python_multiprocessing
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from bridgeflow.base import DataFlow

from . import _compat
from ._compat import torch
from .fetch import COLLATE, ITERABLE, MAP

__all__ = ["DataLoader"]

_tud = torch.utils.data
_FROZEN_AFTER_INIT = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


class InfiniteConstantSampler(_tud.Sampler):
    """Yields ``None`` forever: the placeholder sampler of an iterable dataset (one per sample)."""

    def __iter__(self):
        while True:
            yield None


def _check_counts(num_workers: int, timeout: float, prefetch_factor: int | None,
                  persistent_workers: bool) -> int | None:
    """Validate the worker-count options in torch's order and with torch's messages."""
    if num_workers < 0:
        raise ValueError("num_workers option should be non-negative; "
                         "use num_workers=0 to disable multiprocessing.")
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError("prefetch_factor option could only be specified in multiprocessing."
                         "let num_workers > 0 to enable multiprocessing, "
                         "otherwise set prefetch_factor to None.")
    if num_workers > 0 and prefetch_factor is None:
        prefetch_factor = 2
    elif prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    return prefetch_factor


def _check_iterable_args(what: str, shuffle: Any, sampler: Any, batch_sampler: Any) -> None:
    if shuffle not in {False, None}:
        raise ValueError(f"DataLoader with {what}: expected unspecified shuffle option, "
                         f"but got shuffle={shuffle}")
    if sampler is not None:
        raise ValueError(f"DataLoader with {what}: expected unspecified sampler option, "
                         f"but got sampler={sampler}")
    if batch_sampler is not None:
        raise ValueError(f"DataLoader with {what}: expected unspecified batch_sampler option, "
                         f"but got batch_sampler={batch_sampler}")


class DataLoader:
    """Drop-in replacement for ``torch.utils.data.DataLoader`` running on bridgeflow's worker pool.

    Takes exactly torch's arguments (see the module docstring for the few differences). ``dataset`` may
    be a map-style dataset, a ``torch.utils.data.IterableDataset`` or a bridgeflow ``DataFlow``.
    """

    __initialized = False

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable | None = None, pin_memory: bool = False, drop_last: bool = False,
                 timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: Any = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True) -> None:
        prefetch_factor = _check_counts(num_workers, timeout, prefetch_factor, persistent_workers)
        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.in_order = in_order

        if isinstance(dataset, DataFlow):
            self._bf_kind = COLLATE
            _check_iterable_args("DataFlow", shuffle, sampler, batch_sampler)
        elif isinstance(dataset, _tud.IterableDataset):
            self._bf_kind = ITERABLE
            _check_iterable_args("IterableDataset", shuffle, sampler, batch_sampler)
        else:
            self._bf_kind = MAP
            shuffle = bool(shuffle)
        self._dataset_kind = _tud._DatasetKind.Map if self._bf_kind == MAP else _tud._DatasetKind.Iterable

        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, "
                                 "sampler, and drop_last")
            batch_size, drop_last = None, False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive "
                             "with drop_last")

        if sampler is None:
            if self._bf_kind != MAP:
                sampler = InfiniteConstantSampler()
            elif shuffle:
                sampler = _tud.RandomSampler(dataset, generator=generator)
            else:
                sampler = _tud.SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = _tud.BatchSampler(sampler, batch_size, drop_last)

        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        if collate_fn is None:
            collate_fn = _compat.default_collate if self._auto_collation else _compat.default_convert
        self.collate_fn = collate_fn
        self.persistent_workers = persistent_workers
        self.__initialized = True
        self._IterableDataset_len_called: int | None = None
        self._iterator: Any = None
        self.check_worker_number_rationality()

    # --- attributes guarded as torch guards them --------------------------------------------------

    @property
    def multiprocessing_context(self) -> Any:
        return self.__multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        if context is not None:
            if self.num_workers <= 0:
                raise ValueError("multiprocessing_context can only be used with multi-process loading "
                                 f"(num_workers > 0), but got num_workers={self.num_workers}")
            if isinstance(context, str):
                valid = torch.multiprocessing.get_all_start_methods()
                if context not in valid:
                    raise ValueError(f"multiprocessing_context option should specify a valid start method "
                                     f"in {valid!r}, but got multiprocessing_context={context!r}")
                context = torch.multiprocessing.get_context(context)
            if not isinstance(context, python_multiprocessing.context.BaseContext):
                raise TypeError("multiprocessing_context option should be a valid context object or a "
                                "string specifying the start method, but got "
                                f"multiprocessing_context={context}")
        self.__multiprocessing_context = context

    def __setattr__(self, attr: str, val: Any) -> None:
        if self.__initialized and attr in _FROZEN_AFTER_INIT:
            raise ValueError(f"{attr} attribute should not be set after {type(self).__name__} is initialized")
        super().__setattr__(attr, val)

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self) -> Iterable:
        return self.batch_sampler if self._auto_collation else self.sampler

    @property
    def start_method(self) -> str:
        """The start method the workers use: the context's, else multiprocessing's default."""
        ctx = self.multiprocessing_context
        if ctx is not None:
            return ctx.get_start_method()
        return (python_multiprocessing.get_start_method(allow_none=True)
                or python_multiprocessing.get_all_start_methods()[0])

    # --- iteration ----------------------------------------------------------------------------------

    def _get_iterator(self) -> Any:
        from .iterators import PoolLoaderIter, SingleLoaderIter

        if self.num_workers == 0:
            return SingleLoaderIter(self)
        self.check_worker_number_rationality()
        return PoolLoaderIter(self)

    def __iter__(self) -> Any:
        if self.persistent_workers and self.num_workers > 0:
            if self._iterator is None or self._iterator.closed:
                self._iterator = self._get_iterator()
            else:
                self._iterator.reset(self)
            return self._iterator
        return self._get_iterator()

    def __len__(self) -> int:
        if self._bf_kind == MAP:
            return len(self._index_sampler)
        length = self._IterableDataset_len_called = len(self.dataset)
        if self.batch_size is not None:
            length = length // self.batch_size if self.drop_last else math.ceil(length / self.batch_size)
        return length

    def close(self) -> None:
        """Stop persistent workers now (they also stop when the loader is garbage-collected)."""
        it = self.__dict__.get("_iterator")
        if it is not None:
            it.shutdown()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_worker_number_rationality(self) -> None:
        """Warn, as torch does, when more workers are asked for than this process has CPUs."""
        if not self.num_workers:
            return
        cpus = _compat.cpu_count()
        if cpus is None or self.num_workers > cpus:
            warnings.warn(
                f"This DataLoader will create {self.num_workers} worker processes in total, more than the "
                f"{cpus} CPUs this process may use; too many workers can make loading slow or freeze it. "
                "Lower num_workers if that happens.", stacklevel=2)
