"""The one epoch iterator behind :class:`~bridgeflow.adapters.torch.DataLoader`: torch's task discipline over a
batch source.

:class:`EpochIterator` does, in the thread that calls ``next()``, what torch's iterators do there, with one
part for each idea:

- :class:`~._draws.DrawOrder`: the random draws of an epoch's start in torch's order, and the sampler's indices;
- :class:`~._dispatch.Dispatcher`: ``prefetch_factor * num_workers`` tasks in flight, each to the next worker
  whose stream has not ended (the task replacing a batch is sent when that batch is handed out);
- :class:`~._resume.ResumePlan`: for a loaded state, how the epoch goes on;
- :class:`~._flows.StreamReads`: a DataFlow read as one stream here, one batch of samples per task;
- :class:`~._state.EpochRecord`: where the epoch is, for ``loader.state_dict()``;
- :class:`EpochStats`: the figures of ``loader.stats()``, kept by the loader after the iterator is gone.

What turns a task into a batch is a *batch source* (:mod:`._sources`): :class:`~._sources.LocalSource` reads in
this process (``num_workers=0``), :class:`~._sources.PoolSource` in worker processes, and
:class:`~._pin_memory.PinThread` wraps the pool source when batches are pinned: its thread receives and pins
batches while this iterator keeps drawing the tasks, so the sampler and a DataFlow are read exactly as far as
without the thread, and the record changes only in this thread. Every task's outcome is a
:class:`~._result.Result`.

These iterators are ``_BaseDataLoaderIter`` subclasses (frameworks recognise DataLoader iterators by class;
torch's private names are :class:`~._compat.TorchIteratorNames`'s), but none of torch's iterator code runs.
"""

from __future__ import annotations

import logging
import operator
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from bridgeflow import BridgeflowError

from . import _compat
from ._dispatch import Dispatcher
from ._draws import DrawOrder
from ._fetch import COLLATE, ITERABLE, MAP, WorkerSpec
from ._flows import StreamReads
from ._pin_memory import PinThread, loader_pinner, pins, update_pinner
from ._result import ENDED, FAILED, SKIPPED, STOPPED
from ._resume import ResumePlan
from ._sample_seeds import SeededTask, task_seed
from ._sources import LocalSource, PoolSource
from ._state import EpochRecord

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = ["EpochIterator", "EpochStats", "LoaderStateError"]

log = logging.getLogger(__name__)

_LOGGED = 20  # skipped samples logged as warnings per epoch; the later ones at debug level (stats() counts them)


class LoaderStateError(BridgeflowError, ValueError, AssertionError):
    """Options that torch accepts at construction but refuses when iteration starts (with an
    ``AssertionError``; this error is one too, and a ``ValueError``)."""


class EpochStats:
    """One epoch's figures (see ``DataLoader.stats()``): counted by its iterator, kept by the loader. The
    pool's figures are read from ``pool`` while it runs, and kept as they were when it stopped."""

    def __init__(self, workers: int, depth: int, skips: bool = False) -> None:
        self.workers, self.depth, self.skips = workers, depth, skips
        self.restart()

    def restart(self) -> None:
        """Another epoch (persistent workers): its own figures."""
        self.batches = 0
        self.skipped = 0  # samples left out under on_error="skip"
        self.wait_s = 0.0  # time the consumer spent waiting for batches
        self.since: float | None = None  # when the first batch was asked for
        self.until: float | None = None  # when the epoch ended or its iterator stopped
        self.pool: PoolSource | None = None
        self._pool_figures: dict[str, float] = {}

    def started(self, pool: PoolSource | None) -> None:
        self.since = time.perf_counter()
        self.pool = pool
        if pool is not None:
            pool.started()

    def stop(self) -> None:
        """The epoch is over (or left): its figures stay as they are now."""
        if self.since is not None and self.until is None:
            self._pool_figures = self._read_pool()
            self.until = time.perf_counter()
        self.pool = None

    def _read_pool(self) -> dict[str, float]:
        if self.pool is None:
            return {}
        counters = self.pool.counters(self.since)
        return {"buffer_fill": min(1.0, counters.pop("ready_average") / max(self.depth, 1)), **counters}

    def figures(self) -> dict[str, float]:
        if self.since is None:
            return {}
        end = self.until if self.until is not None else time.perf_counter()
        elapsed = max(end - self.since, 1e-9)
        out = {"batches": self.batches, "workers": self.workers, "consumer_wait_s": self.wait_s,
               "consumer_wait_frac": min(1.0, self.wait_s / elapsed)}
        if self.skips:
            out["skipped"] = self.skipped
        out.update(self._pool_figures if self.until is not None else self._read_pool())
        return out


class EpochIterator(_compat.TorchIteratorNames):
    """An epoch of a DataLoader (every epoch, with ``persistent_workers``); ``plan`` resumes an epoch in
    progress (see :mod:`._resume`), None starts a fresh one."""

    def __init__(self, loader: DataLoader, record: EpochRecord, plan: ResumePlan | None = None) -> None:
        workers = loader.num_workers
        if workers == 0 and loader.timeout != 0:
            raise LoaderStateError(f"timeout={loader.timeout} needs num_workers > 0: with num_workers=0 "
                                   "batches are read in this process and cannot time out")
        prefetch = loader.prefetch_factor  # None: torch's default without workers, and num_workers set since
        if workers > 0 and (prefetch is None or prefetch <= 0):
            raise LoaderStateError(f"prefetch_factor={loader.prefetch_factor}: with num_workers > 0 "
                                   "prefetch_factor must be at least 1")
        # torch takes any integer (True is one worker) and fails on a float with this same TypeError
        self._num_workers = operator.index(workers)
        self._loader_ref = weakref.ref(loader)  # weak: a persistent iterator is held by its loader
        bf = loader._bf
        self._kind = bf.kind
        self._persistent = loader.persistent_workers and workers > 0
        _warn_pinning(loader)
        self._pin_inline = pins(loader) and workers == 0  # torch pins in this thread without workers
        self._pinner: Any = None
        self.closed = False
        self._source: Any = None
        self._finalizer: Any = None
        self._stream: StreamReads | None = None
        # in_order=False: map-style results as they are ready (iterables keep order: their workers run dry)
        unordered = not loader.in_order and self._kind == MAP and workers > 0
        depth = prefetch * workers if prefetch and workers else 1
        self.draws = DrawOrder(bf.items, self._kind)
        kept = bf.take_kept()  # a state saved between two epochs of persistent workers
        if plan is None:
            self.draws.start(loader, record, kept.get("base_seed"))
            record.reuse = kept.get("reuse", 0)
        else:
            self.draws.resume(loader, record, plan.state, plan.first_task)
        world_size, rank = _compat.distributed_settings()
        assert self.draws.base_seed is not None  # drawn or kept by start(), the saved one by resume()
        spec = WorkerSpec(
            kind=self._kind, dataset=None if self._kind == COLLATE else self.draws.dataset,
            auto_collation=_compat.auto_collation(loader), collate_fn=loader.collate_fn, drop_last=loader.drop_last,
            base_seed=self.draws.base_seed, num_workers=max(1, workers), worker_init_fn=loader.worker_init_fn,
            shared_seed=self.draws.shared_seed, world_size=world_size, rank=rank,
            saved=plan.worker_states if plan is not None else kept.get("workers"), skip=loader.on_error == "skip")
        self._spec = spec
        self._sampler = _compat.index_sampler(loader)
        self._pool: PoolSource | None = None
        self.stats = bf.show_stats(EpochStats(self._num_workers, depth, skips=loader.on_error == "skip"))
        try:
            if workers == 0:
                self._source = LocalSource(spec)
                if plan is None and self._source.state is not None:  # before its first batch too
                    record.note_worker_state(0, 1, self._source.state)
            else:
                self._source = self._pool = PoolSource(spec, loader, unordered)
                if plan is None:
                    self.draws.redraw_shared_seed(loader)
                if pins(loader):  # pinned in a background thread, as torch's loader does
                    self._source = PinThread(self._pool, loader_pinner(loader), depth=depth + 1)
            self._finalizer = weakref.finalize(self, _close, self._source, self.stats)
            self._dispatch = Dispatcher(self._source, self._num_workers, depth, unordered)
            if kept.get("workers") is not None:  # restored at the saved epoch's end: a fresh epoch on them
                self._note_started(record, self._source.reset(self.draws.shared_seed))
            self._start_epoch(loader, record, plan)
        except BaseException:
            self.shutdown()
            raise

    def _start_epoch(self, loader: DataLoader, record: EpochRecord, plan: ResumePlan | None) -> None:
        self._record = record
        self._len_called = _compat.iterable_length_seen(loader)
        self._pull_error: Exception | None = None  # the flow or sampler failed: raised after what came before
        self._ahead: frozenset[int]  # tasks of a resumed epoch delivered already (in_order=False): skipped
        if plan is None:
            self.yielded, self._seq, self._ahead, self._discard = 0, 0, frozenset(), 0
            record.ahead = set() if self._dispatch.unordered else None
            self._dispatch.start()
        else:
            plan.restore(record)
            self.yielded, self._seq, self._discard = plan.state["yielded"], plan.first_task, plan.discard
            self._ahead = plan.ahead or frozenset()
            if self._dispatch.unordered and record.ahead is None:
                record.ahead = set()
            self._dispatch.start(plan.exhausted, plan.next_worker)
        # seed_per_sample: each task goes with its seed, from the workers' base seed and the epochs run on it
        base = self.draws.base_seed
        self._seeds = (base, record.reuse) if loader.seed_per_sample and self._kind != COLLATE and base is not None \
            else None
        if self._kind == COLLATE:  # the flow is read here, one batch of samples per task
            if self._stream is not None:
                self._stream.close()
            self._stream = StreamReads(self.draws.dataset, self._spec.auto_collation, self._spec.drop_last, record,
                                       self._seq, resumed=plan is not None)
        if self._source.reads_ahead:
            self._fill()

    def _note_started(self, record: EpochRecord, started: list) -> None:
        for worker, state in started:
            if state is not None:
                record.note_worker_state(worker, self._num_workers, state)

    # --- tasks --------------------------------------------------------------------------------------

    def _next_task(self) -> tuple[Any, int]:
        """The next task and its number in the epoch (skipping those a resumed epoch delivered already)."""
        loader = self._loader_ref()
        while True:
            task = self.draws.next_index(loader, self._record)
            seq, self._seq = self._seq, self._seq + 1
            if seq not in self._ahead:
                break
        if self._stream is not None:
            task = self._stream.pull(task, self._record)
        return task, seq

    def _fill(self) -> None:
        """Send tasks while the dispatcher wants them and the sampler (or the flow) has more."""
        dispatch = self._dispatch
        while not self.closed and dispatch.wants:
            try:
                task, seq = self._next_task()
            except StopIteration:
                dispatch.no_more = True
                return
            except Exception as exc:  # the flow failed: raised after the batches read before it
                self._pull_error, dispatch.no_more = exc, True
                return
            if self._seeds is not None:
                task = SeededTask(task_seed(*self._seeds, seq), task)
            dispatch.send(task, seq)

    # --- batches ------------------------------------------------------------------------------------

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return len(self._sampler)

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        stats = self.stats
        if stats.since is None:
            stats.started(self._pool)
        try:
            data = self._next_data()
        finally:  # the time the caller waited for the loader: with num_workers=0, the reading itself
            stats.wait_s += time.perf_counter() - t0
        stats.batches += 1
        self._count_yield()
        if self._pin_inline:
            data = self._pin(data)
        return data

    def _next_data(self) -> Any:
        record, dispatch, n = self._record, self._dispatch, self._num_workers
        while True:
            self._fill()
            if self.closed:
                raise StopIteration
            if dispatch.in_flight == 0:
                if self._pull_error is not None:
                    error, self._pull_error = self._pull_error, None
                    try:
                        raise error
                    finally:
                        del error
                self._end_epoch()
                raise StopIteration
            try:
                worker, seq, result = dispatch.receive()
            except BaseException:  # the source's own failure (a dead worker, a timeout): the epoch is over
                self.shutdown()
                raise
            if result.state is not None and worker is not None:
                record.note_worker_state(worker, max(1, n), result.state)
            if result.tag is ENDED:  # the worker's stream ran out: no more tasks for it this epoch
                assert worker is not None  # only a dataset error (FAILED) comes without its worker
                dispatch.retire(worker)
                record.note_exhausted(worker, max(1, n))
                continue
            if self._discard:  # a fast-forward reads it again: the consumer saw it (or its error) already
                self._discard -= 1
                continue
            if result.tag is STOPPED:  # a map-style dataset raised StopIteration: torch re-raises it
                if self._source.reads_ahead:
                    self._fill()
                else:
                    self._end_epoch()
                raise StopIteration
            if result.skipped:
                self._note_skipped(result.skipped)
            record.deliver(seq, worker)  # an error (or a batch skipped whole) is consumed too: a resume must not
            if self._stream is not None:  # read it again
                self._stream.delivered(record)
            if self._source.reads_ahead:
                self._fill()  # the task replacing it, drawn here as torch does
            if result.tag is SKIPPED:  # no sample of it is left
                continue
            if result.tag is FAILED:
                error = result.value
                try:
                    raise error
                finally:  # no cycle through this frame: the iterator goes when the user drops it
                    del error, result
            return result.value

    def _note_skipped(self, skipped: list) -> None:
        """Samples left out of a batch under ``on_error="skip"``: counted, and logged with their index."""
        stats = self.stats
        for index, error in skipped:
            stats.skipped += 1
            what = "a batch of the DataFlow's samples" if index is None else \
                f"the batch of indices {index!r}" if isinstance(index, list) else f"the sample at index {index!r}"
            log.log(logging.WARNING if stats.skipped <= _LOGGED else logging.DEBUG,
                    "DataLoader: skipped %s: %s (on_error='skip'; %d skipped in this epoch)%s", what, error,
                    stats.skipped, "; further skips are logged at debug level" if stats.skipped == _LOGGED else "")

    def _end_epoch(self) -> None:
        record = self._record
        record.finished = True
        loader = self._loader_ref()
        if loader is not None:
            record.note_epoch_end(loader)
        if self._stream is not None:
            self._stream.end(record)
        self.stats.stop()
        if self._persistent:
            if self._stream is not None:
                self._stream.close()
        else:
            self.shutdown()

    def _count_yield(self) -> None:
        """One more batch handed out; torch's warning when an iterable gives more than its ``len()``."""
        self.yielded += 1
        if self._kind == ITERABLE and self._len_called is not None and self.yielded > self._len_called:
            msg = (f"Length of IterableDataset {self.draws.dataset} was reported to be {self._len_called} (when "
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

    def reset(self, loader: DataLoader, record: EpochRecord | None = None) -> None:
        """Start another epoch on the same workers (``persistent_workers=True``): the previous epoch's
        batches still in flight are dropped."""
        record = EpochRecord(loader) if record is None else record
        self.draws.start(loader, record, first=False)
        record.reuse = self._record.reuse + 1  # the same base seed as the epoch before
        self._note_started(record, self._source.reset(self.draws.shared_seed))
        self.stats.restart()
        loader._bf.show_stats(self.stats)
        self._start_epoch(loader, record, None)

    def shutdown(self) -> None:
        """End the epoch now: the workers stop (persistent ones too), the flow read here is let go."""
        if self.closed:
            return
        self.closed = True
        if self._stream is not None:
            self._stream.close()
        if self._finalizer is not None:
            self._finalizer()
        elif self._source is not None:  # it failed to start before its finalizer was made
            self._source.close()


def _close(source: Any, stats: EpochStats) -> None:
    """An iterator's end (shut down, or collected after a ``break``): its figures stay, its source closes."""
    stats.stop()
    source.close()


def _warn_pinning(loader: DataLoader) -> None:
    """torch's warnings about ``pin_memory``, at the same point."""
    if loader.pin_memory and loader.pin_memory_device:
        warnings.warn("pin_memory_device is deprecated, the current accelerator will be used as the "
                      f"device, ignore pin_memory_device='{loader.pin_memory_device}'.", stacklevel=4)
    if loader.pin_memory and loader._bf.pin_backend is None and not _compat.accelerator_available():
        warnings.warn("'pin_memory' argument is set as true but no accelerator is found, then device "
                      "pinned memory won't be used.", stacklevel=4)
