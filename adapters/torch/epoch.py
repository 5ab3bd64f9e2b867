"""The one epoch iterator behind :class:`~bridgeflow.adapters.torch.DataLoader`: torch's task discipline over a
batch source.

:class:`EpochIterator` does, in the thread that calls ``next()``, everything torch's iterators do there:
draw the workers' base seed and a DataPipe's shuffle seed from the loader's ``generator`` (in torch's
order), draw index batches from the sampler, assign each task to the next worker that is not exhausted
(round robin), keep ``prefetch_factor * num_workers`` tasks in flight (the task replacing a batch is sent
when that batch is handed out), and keep the epoch's :class:`~.state.EpochRecord` up to date for
``loader.state_dict()``. A DataFlow that is read as a stream in this process is pulled here too, one
batch of samples per task. What turns a task into a batch is a *batch source*
(:mod:`~bridgeflow.adapters.torch.sources`):

- ``put(task, worker)`` queues a task for a worker; ``get()`` returns ``(worker, value)`` for the oldest
  one (or, with ``in_order=False``, the first ready), ``value`` being a batch or one of the markers of
  :mod:`.fetch` (a batch with its dataset's state, a worker's stream ending) or :class:`~.sources.Failed`
  (the dataset raised); an error of the source itself (a dead worker, a timeout) is raised;
- ``reset(shared_seed)`` starts another epoch on the same workers; ``close()`` ends them;
- ``reads_ahead``: whether tasks are sent ahead of ``next()`` (workers) or one at a time (in-process).

:class:`~.sources.LocalSource` reads in this process (``num_workers=0``), :class:`~.sources.PoolSource`
in worker processes, and :class:`~.pin_memory.PinThread` wraps the pool source when batches are pinned:
its thread receives and pins batches while this iterator keeps drawing the tasks, so the sampler and a
DataFlow are read exactly as far as without the thread, and the record changes only in this thread.

These iterators are ``_BaseDataLoaderIter`` subclasses (frameworks recognise DataLoader iterators by class;
torch's private names are :class:`~._compat.TorchIteratorNames`'s), but none of torch's iterator code runs.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import time
import warnings
import weakref
from typing import Any

from bridgeflow.errors import BridgeflowError
from bridgeflow.parallel._transport.pool import EXHAUSTED

from . import _compat
from ._compat import torch
from .fetch import (
    COLLATE,
    ITERABLE,
    MAP,
    Fetcher,
    StopFromDataset,
    StreamEnded,
    WithState,
    WorkerSpec,
    close_source,
    make_fetcher,
)
from .pin_memory import PinThread, loader_pinner, pins, update_pinner
from .sources import Failed, LocalSource, PoolSource
from .state import EpochRecord, apply_generators, flow_state, loader_draws, replayed_indices

__all__ = ["EpochIterator", "LoaderStateError"]

log = logging.getLogger(__name__)

_NOT_PULLED = object()


class LoaderStateError(BridgeflowError, ValueError, AssertionError):
    """Options that torch accepts at construction but refuses when iteration starts (with an
    ``AssertionError``; this error is one too, and a ``ValueError``)."""


def _seeded(seed: int) -> Any:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _keep_samples(samples: Any) -> Any:
    return samples


class EpochIterator(_compat.TorchIteratorNames):
    """An epoch of a DataLoader (every epoch, with ``persistent_workers``); ``resume`` is a checked
    ``state_dict`` of an epoch in progress, None starts a fresh one."""

    def __init__(self, loader: Any, record: EpochRecord, resume: dict | None = None) -> None:
        workers = loader.num_workers
        if workers == 0 and loader.timeout != 0:
            raise LoaderStateError(f"timeout={loader.timeout} needs num_workers > 0: with num_workers=0 "
                                   "batches are read in this process and cannot time out")
        if workers > 0 and loader.prefetch_factor <= 0:
            raise LoaderStateError(f"prefetch_factor={loader.prefetch_factor}: with num_workers > 0 "
                                   "prefetch_factor must be at least 1")
        self._loader_ref = weakref.ref(loader)  # weak: a persistent iterator is held by its loader
        self._kind = loader._bf_kind
        self._dataset = loader._bf_items()
        self._auto_collation = loader._auto_collation
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        # torch takes any integer (True is one worker) and fails on a float with this same TypeError
        self._num_workers = operator.index(workers)
        self._persistent_workers = loader.persistent_workers and workers > 0
        self._world_size, self._rank = _compat.distributed_settings()
        if loader.pin_memory and loader.pin_memory_device:
            warnings.warn("pin_memory_device is deprecated, the current accelerator will be used as the "
                          f"device, ignore pin_memory_device='{loader.pin_memory_device}'.", stacklevel=3)
        if (loader.pin_memory and getattr(loader, "_bf_pin_backend", None) is None
                and not _compat.accelerator_available()):
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then device "
                          "pinned memory won't be used.", stacklevel=3)
        self._pin_inline = pins(loader) and workers == 0  # torch pins in this thread without workers
        self._pinner: Any = None
        self.closed = False
        self._source: Any = None
        self._pool_source: PoolSource | None = None
        self._since: float | None = None  # when the first batch was asked for (stats)
        self._wait_s = 0.0  # time spent waiting for the source (stats)
        self._batches = 0
        self._flow_fetcher: Fetcher | None = None  # a DataFlow read as a stream here: its samples
        self._seed_group = _compat.seed_group() if isinstance(self._dataset, _compat.IterDataPipe) else None
        self._start(loader, record, resume)
        # in_order=False: map-style results as they are ready (iterables keep order: their workers run dry)
        self._unordered = not loader.in_order and self._kind == MAP and workers > 0
        self._depth = loader.prefetch_factor * workers if workers else 1
        spec = WorkerSpec(
            kind=self._kind, dataset=None if self._kind == COLLATE else self._dataset,
            auto_collation=self._auto_collation, collate_fn=loader.collate_fn, drop_last=self._drop_last,
            base_seed=self._base_seed, num_workers=max(1, workers), worker_init_fn=loader.worker_init_fn,
            shared_seed=self._shared_seed, world_size=self._world_size, rank=self._rank,
            saved=resume.get("workers") if resume else self._kept_workers)
        try:
            if workers == 0:
                self._source = LocalSource(spec)
                if resume is None and self._source.state is not None:  # before its first batch too
                    record.note_worker_state(0, 1, self._source.state)
            else:
                self._source = self._pool_source = PoolSource(spec, loader, self._unordered)
                if self._shared_seed is not None and resume is None:
                    # torch's multi-process iterator draws the DataPipe seed a second time for its own copy
                    # (its workers keep the first): drawn too, so the generator's later draws stay torch's
                    self._new_shared_seed(loader, None)
                    self._shared_seed = spec.shared_seed
                if pins(loader):  # pinned in a background thread, as torch's loader does
                    self._source = PinThread(self._source, loader_pinner(loader), depth=self._depth + 1)
            self._finalizer = weakref.finalize(self, self._source.close)
            if self._kept_workers is not None:  # restored at the saved epoch's end: now a fresh epoch on them
                for worker, state in self._source.reset(self._shared_seed):
                    if state is not None:
                        record.note_worker_state(worker, self._num_workers, state)
            self._start_epoch(resume)
        except BaseException:
            self.shutdown()
            raise

    # --- what torch draws, in torch's order ---------------------------------------------------------

    def _start(self, loader: Any, record: EpochRecord, resume: dict | None, first: bool = True) -> None:
        """Start an epoch: the first (``first``), or another on the same workers (persistent workers keep
        their seeds, as torch's ``_reset`` does). Draws from the loader's generator in torch's order."""
        self._record = record
        self._len_called = loader._IterableDataset_len_called
        self._kept_workers = None
        if first:
            self._shared_seed = None
            if resume is not None:
                self._new_shared_seed(loader, resume)
        if resume is None:
            self._sampler_iter = iter(self._index_sampler)
            with loader_draws(loader, record):  # torch's draws, in torch's order
                if first:
                    self._new_shared_seed(loader, None)
                    # a state saved between two epochs of persistent workers keeps their seed (torch draws
                    # none then) and their datasets' states
                    kept = loader.__dict__.pop("_bf_kept", None) or {}
                    self._kept_workers = kept.get("workers")
                    self._base_seed = (kept["base_seed"] if kept else torch.empty(
                        (), dtype=torch.int64).random_(generator=loader.generator).item())
                else:
                    self._new_shared_seed(loader, None)
            self._rng_pending = self._kind == MAP
            self.yielded = 0
        else:
            self._base_seed = resume["base_seed"]
            if self._kind == MAP:
                self._sampler_iter = replayed_indices(loader, resume, resume["yielded"])
            else:  # placeholders: nothing to replay; the generators continue from where they were
                apply_generators(loader, resume.get("rng_now"))
                self._sampler_iter = iter(self._index_sampler)
            # a state taken before the epoch's first index was drawn: drawn as an uninterrupted epoch draws it
            self._rng_pending = self._kind == MAP and resume.get("rng_first") is None
            self.yielded = resume["yielded"]
            record.rng_first, record.sampler_epoch = resume.get("rng_first"), resume.get("sampler_epoch")
            record.yielded, record.last_worker = resume["yielded"], resume.get("last_worker")
            record.workers, record.exhausted = resume.get("workers"), resume.get("exhausted")
            record.flow, record.flow_ended = resume.get("flow"), resume.get("flow_ended", False)
            record.rng_next = resume.get("rng_next")
        record.base_seed, record.shared_seed = self._base_seed, self._shared_seed

    def _new_shared_seed(self, loader: Any, resume: dict | None) -> None:
        """A DataPipe's shuffle seed for the epoch, and its graph reshuffled with it (torch's order)."""
        if isinstance(self._dataset, _compat.IterDataPipe):
            self._shared_seed = (resume["shared_seed"] if resume
                                 else _compat.share_seed(loader.generator, self._seed_group))
            self._dataset = _compat.apply_random_seed(self._dataset, _seeded(self._shared_seed))

    def _start_epoch(self, resume: dict | None = None) -> None:
        record = self._record
        if self._unordered:
            record.problem = ("with in_order=False and workers, batches arrive as they are ready and the loader "
                              "does not record which ones were delivered")
        n = max(1, self._num_workers)
        self._active = [True] * n
        self._cycle = itertools.cycle(range(n))
        self._owners: collections.deque = collections.deque()  # worker of each task in flight, in order
        self._in_flight = 0
        self._no_more = False  # no task will be sent again this epoch
        self._discard = 0  # batches of a fast-forward: read again and dropped
        self._pull_error: Exception | None = None  # the flow or sampler failed: raised after what came before
        self._pulled = 0  # DataFlow batches pulled this epoch
        self._flow_before: dict[int, Any] = {}  # DataFlow position before pulling batch n
        if resume is not None:
            if self._kind == ITERABLE and not resume.get("workers"):  # the whole epoch again, from the start
                if resume["yielded"]:
                    log.warning("resuming %s: neither the dataset nor its iterator has state_dict()/"
                                "load_state_dict(), so the %d batches already delivered this epoch are read "
                                "again and dropped", type(self._dataset).__name__, resume["yielded"])
                self._discard = resume["yielded"]
            else:
                if resume.get("exhausted"):
                    self._active = [not e for e in resume["exhausted"]]
                if resume.get("last_worker") is not None:
                    for _ in range(resume["last_worker"] + 1):  # the next batch goes where it went before
                        next(self._cycle)
            self._pulled = resume["yielded"]
        if self._kind == COLLATE:  # the flow is read here, one batch of samples per task
            close_source(self._flow_fetcher)
            if resume is None:
                record.flow, record.problem = flow_state(self._dataset)  # where this epoch starts
            self._flow_fetcher = make_fetcher(ITERABLE, self._dataset, self._auto_collation, _keep_samples,
                                              self._drop_last)
            self._flow_fetcher.ended = record.flow_ended
            self._flow_before[self._pulled] = record.flow
        if self._source.reads_ahead:
            self._fill()

    # --- tasks --------------------------------------------------------------------------------------

    def _next_index(self) -> Any:
        if self._rng_pending:  # the epoch's first index: snapshot what the sampler may draw from
            self._rng_pending = False
            loader = self._loader_ref()
            if loader is not None:
                with loader_draws(loader, self._record):  # the sampler draws its epoch's seed now
                    self._record.snapshot_rngs(loader)
                    return next(self._sampler_iter)
        return next(self._sampler_iter)

    def _next_task(self) -> Any:
        task = self._next_index()
        fetcher = self._flow_fetcher
        if fetcher is not None:
            if self._record.problem is None and self._pulled not in self._flow_before:
                self._flow_before[self._pulled], self._record.problem = flow_state(self._dataset)
            task = fetcher.fetch(task)
            self._pulled += 1
        return task

    def _fill(self) -> None:
        """Send tasks until ``prefetch_factor * num_workers`` are in flight (one without workers), the
        sampler or the flow runs out, or no worker is left whose stream has not ended."""
        while not self._no_more and not self.closed and self._in_flight < self._depth:
            try:
                task = self._next_task()
            except StopIteration:
                self._no_more = True
                return
            except Exception as exc:  # the flow failed: raised after the batches read before it
                self._pull_error, self._no_more = exc, True
                return
            worker = None  # unordered: the pool gives it to the least busy worker
            if not self._unordered:
                for _ in range(len(self._active)):
                    worker = next(self._cycle)
                    if self._active[worker]:
                        break
                else:
                    self._no_more = True
                    return
                self._owners.append(worker)
            self._source.put(task, worker)
            self._in_flight += 1

    # --- batches ------------------------------------------------------------------------------------

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        if self._since is None:
            self._since = t0
            if self._pool_source is not None:
                self._pool_source.started()
        try:
            data = self._next_data()
        finally:  # the time the caller waited for the loader: with num_workers=0, the reading itself
            self._wait_s += time.perf_counter() - t0
        self._count_yield()
        if self._pin_inline:
            data = self._pin(data)
        return data

    def _next_data(self) -> Any:
        record = self._record
        while True:
            self._fill()
            if self.closed:
                raise StopIteration
            if self._in_flight == 0:
                if self._pull_error is not None:
                    error, self._pull_error = self._pull_error, None
                    try:
                        raise error
                    finally:
                        error = None
                self._end_epoch()
                raise StopIteration
            try:
                worker, value = self._source.get()
            except BaseException:  # the source's own failure (a dead worker, a timeout): the epoch is over
                self.shutdown()
                raise
            self._in_flight -= 1
            owner = self._owners.popleft() if self._owners else worker
            kind = type(value)
            if kind is StreamEnded:  # its state after running out, then as any exhausted worker
                record.note_worker_state(worker, len(self._active), value.state)
                value = EXHAUSTED
            if value is EXHAUSTED:
                self._active[worker] = False
                record.note_exhausted(worker, len(self._active))
                continue
            if kind is WithState:
                record.note_worker_state(worker, len(self._active), value.state)
                value = value.data
            if self._discard:  # a fast-forward reads it again: the consumer saw it (or its error) already
                self._discard -= 1
                continue
            if kind is StopFromDataset:  # a map-style dataset raised StopIteration: torch re-raises it
                if self._source.reads_ahead:
                    self._fill()
                else:
                    self._end_epoch()
                raise StopIteration
            if owner is not None:
                self._delivered(owner)  # an error is consumed too: a resume must not read it again
            if self._source.reads_ahead:
                self._fill()  # the task replacing it, drawn here as torch does
            if kind is Failed:
                error = value.error
                try:
                    raise error
                finally:  # no cycle through this frame: the iterator goes when the user drops it
                    error = value = None
            return value

    def _delivered(self, worker: int) -> None:
        record = self._record
        record.yielded += 1
        record.last_worker = worker
        fetcher = self._flow_fetcher
        if fetcher is None:
            return
        record.flow_ended = fetcher.ended and record.yielded == self._pulled
        if record.problem is None:
            # the position to resume from is the flow's before it gave the next batch's samples
            before_next = self._flow_before.pop(record.yielded, _NOT_PULLED)
            for n in [n for n in self._flow_before if n < record.yielded]:
                del self._flow_before[n]
            if before_next is _NOT_PULLED:  # nothing pulled since: the flow is there now
                before_next, record.problem = flow_state(self._dataset)
            record.flow = before_next

    def _end_epoch(self) -> None:
        record = self._record
        record.finished = True
        loader = self._loader_ref()
        if loader is not None:
            record.note_epoch_end(loader)
        if self._flow_fetcher is not None:
            record.flow_ended = self._flow_fetcher.ended
            if record.problem is None:
                record.flow, record.problem = flow_state(self._dataset)
        if loader is not None:
            loader._bf_last_stats = self.stats()  # what stats() shows once this iterator is gone
        if self._persistent_workers:
            close_source(self._flow_fetcher)
        else:
            self.shutdown()

    def stats(self) -> dict[str, float]:
        """This iterator's figures since its first batch was asked for (see ``DataLoader.stats()``)."""
        if self._since is None:
            return {}
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        out = {"batches": self._batches, "workers": self._num_workers, "consumer_wait_s": self._wait_s,
               "consumer_wait_frac": min(1.0, self._wait_s / elapsed)}
        if self._pool_source is not None and not self.closed:
            counters = self._pool_source.counters(self._since)
            out["buffer_fill"] = min(1.0, counters.pop("ready_average") / max(self._depth, 1))
            out.update(counters)
        return out

    def _count_yield(self) -> None:
        """One more batch handed out; torch's warning when an iterable gives more than its ``len()``."""
        self._batches += 1
        self.yielded += 1
        if self._kind == ITERABLE and self._len_called is not None and self.yielded > self._len_called:
            msg = (f"Length of IterableDataset {self._dataset} was reported to be {self._len_called} (when "
                   f"accessing len(dataloader)), but {self.yielded} samples have been fetched. ")
            if self._num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly configuring "
                        "the IterableDataset replica at each worker.")
            warnings.warn(msg, stacklevel=3)

    def _pin(self, data: Any) -> Any:
        if self._pinner is None:
            loader = self._loader_ref()
            if loader is None:
                return data
            self._pinner = loader_pinner(loader, threads=1)  # torch's copy_ only: no helper threads
        return self._pinner(data)

    # --- lifetime -----------------------------------------------------------------------------------

    @property
    def worker_processes(self) -> list:
        """The worker processes (torch's iterators call them ``_workers``)."""
        return self._source.workers if self._source is not None else []

    def set_mapping_hooks(self, hooks: Any) -> None:
        """The loader's slab-mapping hooks changed (see ``DataLoader.set_mapping_hooks``); a closed pool's
        mappings still held by batches follow them too."""
        if self._pinner is not None:
            update_pinner(self._pinner, hooks)
        if self._source is not None:
            self._source.set_mapping_hooks(hooks)

    def reset(self, loader: Any, record: EpochRecord | None = None) -> None:
        """Start another epoch on the same workers (``persistent_workers=True``): the previous epoch's
        batches still in flight are dropped."""
        record = EpochRecord(loader) if record is None else record
        self._start(loader, record, None, first=False)
        for worker, state in self._source.reset(self._shared_seed):
            if state is not None:
                record.note_worker_state(worker, self._num_workers, state)
        self._start_epoch()

    def shutdown(self) -> None:
        """End the epoch now: the workers stop (persistent ones too), the flow read here is let go."""
        if self.closed:
            return
        self.closed = True
        close_source(self._flow_fetcher)
        if self._source is not None:
            self._finalizer()
