"""The two epoch iterators behind :class:`~bridgeflow.adapters.torch.DataLoader`.

:class:`SingleLoaderIter` reads in this process (``num_workers=0``). :class:`PoolLoaderIter` drives a
bridgeflow :class:`~bridgeflow.parallel.pool.WorkerPool` with torch's task discipline: at most
``prefetch_factor * num_workers`` tasks in flight; task ``k`` goes to the next worker in a round-robin cycle
that skips workers whose iterable dataset ran out; results come back in task order. Both draw the workers'
base seed from the loader's ``generator`` before the sampler runs, exactly where torch draws it, so the
random streams of sampler and workers match torch's.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import operator
import warnings
import weakref
from typing import Any

from bridgeflow.errors import BridgeflowError, WorkerError

from . import _compat
from ._compat import torch
from .convert import map_structure, unpack
from .fetch import (
    COLLATE,
    ITERABLE,
    MAP,
    Fetcher,
    Reset,
    StopFromDataset,
    WorkerSpec,
    init_worker,
    make_fetcher,
    resolve_collate,
)

__all__ = ["LoaderStateError", "PoolLoaderIter", "SingleLoaderIter"]

log = logging.getLogger(__name__)


def _supports_unordered(pool_cls: type) -> bool:
    return "ordered" in inspect.signature(pool_cls).parameters


def _keep_samples(samples: Any) -> Any:
    return samples


def _pin(data: Any) -> Any:
    return map_structure(data, lambda t: t.pin_memory(), (torch.Tensor,))


def _close_source(fetcher: Fetcher | None) -> None:
    close = getattr(getattr(fetcher, "iterator", None), "close", None)
    if close is not None:
        close()


class _LoaderIter:
    """What both iterators share: seeds, pinning, and torch's warning for an over-long iterable."""

    def __init__(self, loader: Any) -> None:
        self._kind = loader._bf_kind
        self._dataset = loader.dataset
        self._auto_collation = loader._auto_collation
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._collate_fn = loader.collate_fn
        self._num_workers = loader.num_workers
        self._timeout = loader.timeout
        self._len_called = loader._IterableDataset_len_called
        if loader.pin_memory and loader.pin_memory_device:
            warnings.warn("pin_memory_device is deprecated, the current accelerator will be used as the "
                          f"device, ignore pin_memory_device='{loader.pin_memory_device}'.", stacklevel=3)
        if loader.pin_memory and not _compat.accelerator_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then device "
                          "pinned memory won't be used.", stacklevel=3)
        self._pin_memory = (loader.pin_memory and _compat.accelerator_available()
                            and _compat.current_accelerator_type() != "mps")
        self._sampler_iter = iter(self._index_sampler)
        # Drawn here, before the sampler's first draw, as torch draws it: the streams then match torch's.
        self._base_seed = torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        self._num_yielded = 0
        self.closed = False

    def __iter__(self) -> _LoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def __next__(self) -> Any:
        data = self._next_data()
        self._num_yielded += 1
        if self._kind == ITERABLE and self._len_called is not None and self._num_yielded > self._len_called:
            msg = (f"Length of IterableDataset {self._dataset} was reported to be {self._len_called} (when "
                   f"accessing len(dataloader)), but {self._num_yielded} samples have been fetched. ")
            if self._num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly configuring "
                        "the IterableDataset replica at each worker.")
            warnings.warn(msg, stacklevel=2)
        if self._pin_memory:
            data = _pin(data)
        return data

    def _next_data(self) -> Any:
        raise NotImplementedError

    def reset(self, loader: Any) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        self.closed = True


class LoaderStateError(BridgeflowError, ValueError, AssertionError):
    """Options that torch accepts at construction but refuses when iteration starts (with an
    ``AssertionError``; this error is one too, and a ``ValueError``)."""


class SingleLoaderIter(_LoaderIter):
    """One epoch read in this process."""

    def __init__(self, loader: Any) -> None:
        if loader.timeout != 0:
            raise LoaderStateError(f"timeout={loader.timeout} needs num_workers > 0: with num_workers=0 "
                                   "batches are read in this process and cannot time out")
        super().__init__(loader)
        kind = ITERABLE if self._kind == COLLATE else self._kind
        self._fetcher = make_fetcher(kind, self._dataset, self._auto_collation,
                                     resolve_collate(self._collate_fn, in_worker=False), self._drop_last)

    def _next_data(self) -> Any:
        try:
            index = next(self._sampler_iter)
            return self._fetcher.fetch(index)
        except StopIteration:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            _close_source(self._fetcher)

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.shutdown()


class PoolLoaderIter(_LoaderIter):
    """Epochs read by a bridgeflow worker pool; kept across epochs with ``persistent_workers``."""

    def __init__(self, loader: Any) -> None:
        if loader.prefetch_factor <= 0:
            raise LoaderStateError(f"prefetch_factor={loader.prefetch_factor}: with num_workers > 0 "
                                   "prefetch_factor must be at least 1")
        super().__init__(loader)
        # torch takes any integer (True is one worker) and fails on a float with this same TypeError
        self._num_workers = operator.index(self._num_workers)
        from bridgeflow.parallel.pool import EXHAUSTED, WorkerPool

        self._exhausted = EXHAUSTED
        self._persistent = loader.persistent_workers
        self._max_tasks = loader.prefetch_factor * self._num_workers
        self._source: Fetcher | None = None
        self._source_error: BaseException | None = None  # the DataFlow raised: raised after earlier batches
        self._source_failed = False
        spec = WorkerSpec(
            kind=self._kind,
            dataset=None if self._kind == COLLATE else self._dataset,
            auto_collation=self._auto_collation, collate_fn=self._collate_fn, drop_last=self._drop_last,
            base_seed=self._base_seed, num_workers=self._num_workers, worker_init_fn=loader.worker_init_fn)
        options = {}
        # in_order=False: map-style results as they are ready (iterables keep order: their workers run dry)
        self._unordered = not loader.in_order and self._kind == MAP and _supports_unordered(WorkerPool)
        if self._unordered:
            options["ordered"] = False
        self._pool = WorkerPool(functools.partial(init_worker, spec), self._num_workers, processes=True,
                                start_method=loader.start_method, name="DataLoader",
                                base_seed=self._base_seed, **options)
        self._finalizer = weakref.finalize(self, self._pool.close)
        try:
            self._pool.start()
            self._start_epoch()
        except BaseException:
            self.shutdown()
            raise

    def _start_epoch(self) -> None:
        self._active = [True] * self._num_workers
        self._cycle = itertools.cycle(range(self._num_workers))
        self._source_error, self._source_failed = None, False
        if self._kind == COLLATE:  # the flow is read here; workers only collate
            _close_source(self._source)
            self._source = make_fetcher(ITERABLE, self._dataset, self._auto_collation, _keep_samples,
                                        self._drop_last)
        for _ in range(self._max_tasks):
            self._try_put()

    def reset(self, loader: Any) -> None:
        """Start another epoch on the same workers (``persistent_workers=True``)."""
        self._sampler_iter = iter(self._index_sampler)
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called
        while self._pool.outstanding > 0:  # results of the epoch left early are dropped, errors included
            try:
                self._get()
            except WorkerError:
                raise
            except Exception as exc:
                log.debug("dropping a result of the previous epoch: %r", exc)
        for worker in range(self._num_workers):
            self._pool.put(Reset(), worker=worker)
        for _ in range(self._num_workers):
            self._get()
        self._start_epoch()

    def _get(self) -> tuple[int, Any]:
        timeout = self._timeout if self._timeout > 0 else None
        try:
            return self._pool.get(timeout=timeout)
        except TimeoutError as exc:
            self.shutdown()
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from exc
        except WorkerError:
            self.shutdown()
            raise

    def _try_put(self) -> None:
        if self.closed or self._source_failed:
            return
        try:
            task = next(self._sampler_iter)
            if self._source is not None:
                task = self._source.fetch(task)
        except StopIteration:
            return
        except Exception as exc:  # the DataFlow failed: raise it after the batches read before it
            self._source_error, self._source_failed = exc, True
            return
        worker = None  # unordered: the pool picks the least busy worker
        if not self._unordered:
            for _ in range(self._num_workers):
                worker = next(self._cycle)
                if self._active[worker]:
                    break
            else:
                return
        self._pool.put(task, worker=worker)

    def _next_data(self) -> Any:
        while True:
            if self.closed:
                raise StopIteration
            if self._pool.outstanding <= 0:
                if self._source_error is not None:
                    error, self._source_error = self._source_error, None
                    raise error
                if not self._persistent:
                    self.shutdown()
                else:
                    _close_source(self._source)
                raise StopIteration
            try:
                worker, result = self._get()
            except Exception:  # the dataset's error: keep the pipeline full, as torch does, then raise
                self._try_put()
                raise
            if result is self._exhausted:
                self._active[worker] = False
                self._try_put()
                continue
            self._try_put()
            if isinstance(result, StopFromDataset):
                raise StopIteration
            return unpack(result)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        _close_source(self._source)
        self._finalizer()
