"""The epoch iterator that reads through worker processes: a bridgeflow
:class:`~bridgeflow.parallel.pool.WorkerPool` driven with torch's task discipline.

At most ``prefetch_factor * num_workers`` tasks are in flight; task ``k`` goes to the next worker in a
round-robin cycle that skips workers whose iterable dataset ran out; results come back in task order (or as
ready with ``in_order=False``, map-style only). With ``persistent_workers`` one iterator serves every epoch.
A DataFlow is read here and only collation runs in the workers; its position is recorded before each batch's
samples are pulled, and the one matching the last delivered batch is what ``loader.state_dict()`` returns.

With ``pin_memory=True`` (and an accelerator) this iterator is driven by a reading thread that runs ahead
of the consumer and pins the batches (:mod:`.reader`): ``_read_step()`` is its step, and waits in that
thread are cut into short slices so that stopping never waits for a slow worker. ``set_mapping_hooks``
reaches the pool (``CUDAPrefetcher`` page-locks its slabs so copies read batches where workers wrote them).
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import logging
import operator
import signal
import threading
import time
import weakref
from typing import Any

from bridgeflow.errors import WorkerError, WorkerTimeoutError

from .convert import unpack
from .fetch import (
    COLLATE,
    ITERABLE,
    MAP,
    Fetcher,
    Reset,
    StopFromDataset,
    StreamEnded,
    WithState,
    WorkerSpec,
    init_worker,
    make_fetcher,
)
from .iterators import LoaderIter, LoaderStateError, close_source
from .reader import DATA, END, ERROR, Step, Stopped, stop_requested
from .state import NOT_TAKEN, EpochRecord, flow_state

__all__ = ["PoolLoaderIter"]

log = logging.getLogger(__name__)

_NOT_PULLED = object()
_DRAW = object()  # a grant: draw the next index in the reading thread (iterables, DataFlows: no sampler RNG)
_NO_MORE = object()  # a grant: the sampler ran out


class _Index:
    """A grant: an index the consumer drew from the sampler."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

_SLICE_S = 0.1  # a reading thread waits for a result in slices this long, checking whether to stop
_GRANT_SLICE_S = 0.005  # ... and this long while the consumer may grant tasks to send


def _supports_unordered(pool_cls: type) -> bool:
    return "ordered" in inspect.signature(pool_cls).parameters


def _keep_samples(samples: Any) -> Any:
    return samples


def _with_torch_wording(err: WorkerError) -> WorkerError:
    """torch's words for a dead worker in front of bridgeflow's, so searches for either find it."""
    if str(err).startswith("DataLoader worker (pid"):  # worded already
        return err
    code = err.exitcode
    if code is not None and code < 0:
        try:
            name = signal.strsignal(-code) or f"signal {-code}"
        except ValueError:
            name = f"signal {-code}"
        lead = f"DataLoader worker (pid {err.pid}) is killed by signal: {name}. "
    else:
        lead = f"DataLoader worker (pid(s) {err.pid}) exited unexpectedly. "
    new = WorkerError(lead + str(err), stage=err.stage, worker=err.worker, pid=err.pid, exitcode=code)
    new.__cause__ = err.__cause__
    return new


class PoolLoaderIter(LoaderIter):
    """Epochs read by a bridgeflow worker pool; kept across epochs with ``persistent_workers``."""

    def __init__(self, loader: Any, record: EpochRecord, resume: dict | None = None) -> None:
        if loader.prefetch_factor <= 0:
            raise LoaderStateError(f"prefetch_factor={loader.prefetch_factor}: with num_workers > 0 "
                                   "prefetch_factor must be at least 1")
        self._pool = None
        self._source: Fetcher | None = None
        self._credits = None  # see read_ahead()
        self._put_error: BaseException | None = None  # a worker found dead when sending it a task
        super().__init__(loader, record, resume)
        # torch takes any integer (True is one worker) and fails on a float with this same TypeError
        self._num_workers = operator.index(self._num_workers)
        from bridgeflow.parallel.pool import EXHAUSTED, WorkerPool

        self._exhausted = EXHAUSTED
        self._max_tasks = loader.prefetch_factor * self._num_workers
        saved = resume.get("workers") if resume else None
        spec = WorkerSpec(
            kind=self._kind, dataset=None if self._kind == COLLATE else self._dataset,
            auto_collation=self._auto_collation, collate_fn=self._collate_fn, drop_last=self._drop_last,
            base_seed=self._base_seed, num_workers=self._num_workers, worker_init_fn=loader.worker_init_fn,
            shared_seed=self._shared_seed, world_size=self._world_size, rank=self._rank, saved=saved)
        options = {}
        # in_order=False: map-style results as they are ready (iterables keep order: their workers run dry)
        self._unordered = not loader.in_order and self._kind == MAP and _supports_unordered(WorkerPool)
        if self._unordered:
            options["ordered"] = False
        self._pool = WorkerPool(functools.partial(init_worker, spec), self._num_workers, processes=True,
                                start_method=loader.start_method, name="DataLoader",
                                base_seed=self._base_seed, mapping_hooks=loader._bf_mapping_hooks, **options)
        self._finalizer = weakref.finalize(self, self._pool.close)
        if self._shared_seed is not None and resume is None:
            # torch's multi-process iterator draws the DataPipe seed a second time for its own copy (its
            # workers keep the first): drawn too, so the generator's later draws stay torch's
            self._new_shared_seed(loader, None)
            self._shared_seed = spec.shared_seed
        try:
            self._pool.start()
            self._start_epoch(resume)
        except BaseException:
            self.shutdown()
            raise

    @property
    def _workers(self) -> list:
        """The worker processes, under the name torch's iterator gives them: code written for torch reads it
        for their pids, or to wait for them to exit after the iterator is dropped."""
        return self._pool.worker_processes if self._pool is not None else []

    def _read_step(self) -> Step:
        """In the reading thread: the next batch, error or end of the epoch, with the record once it is
        delivered (a DataFlow's state is asked for here, in the thread that iterates the flow)."""
        self._step_credit = False
        try:
            kind, value, last = DATA, self._next_data(), False
        except StopIteration:
            kind, value, last = END, None, True
        except Stopped:
            raise
        except BaseException as exc:  # the dataset's error, or the pool's (then the iterator is closed)
            kind, value, last = ERROR, exc, self.closed
        record = self._record
        if self._source is not None and record.flow_now is NOT_TAKEN and (record.finished or record.at_flow_end()):
            record.flow_now = flow_state(self._dataset)[0]
        return Step(kind, value, record.snapshot(), last, self._step_credit)

    def set_mapping_hooks(self, hooks: Any) -> None:
        """The loader's slab-mapping hooks changed: this iterator's pool follows."""
        super().set_mapping_hooks(hooks)
        if self._pool is not None:  # closed too: its mappings still held by batches follow the new hooks
            self._pool.set_mapping_hooks(hooks)

    def _start_epoch(self, resume: dict | None = None) -> None:
        record = self._record
        if self._unordered:
            record.problem = ("with in_order=False and workers, batches arrive as they are ready and the loader "
                              "does not record which ones were delivered")
        self._active = [True] * self._num_workers
        self._cycle = itertools.cycle(range(self._num_workers))
        self._discard = 0  # batches of a fast-forward: read again and dropped
        self._source_error, self._source_failed = None, False
        self._pulled = 0  # DataFlow batches pulled this epoch
        self._flow_before: dict[int, Any] = {}  # DataFlow position before pulling batch n
        self._owners: collections.deque[int] = collections.deque()  # worker of each task in flight, in order
        self._no_more = False  # no task will be sent again this epoch
        self._owed = 0  # reading thread: batches with the consumer whose replacing task is still to come
        if self._credits is not None:
            self._credits.clear()
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
        if self._kind == COLLATE:  # the flow is read here; workers only collate
            close_source(self._source)
            if resume is None:
                record.flow, record.problem = flow_state(self._dataset)  # where this epoch starts
            self._source = make_fetcher(ITERABLE, self._dataset, self._auto_collation, _keep_samples,
                                        self._drop_last)
            self._source.ended = record.flow_ended
            self._flow_before[self._pulled] = record.flow
        for _ in range(self._max_tasks):
            self._try_put()

    def reset(self, loader: Any, record: EpochRecord) -> None:
        """Start another epoch on the same workers (``persistent_workers=True``)."""
        while self._pool.outstanding > 0:  # results of the epoch left early are dropped, errors included
            try:
                self._get()
            except WorkerError:
                raise
            except Exception as exc:
                log.debug("dropping a result of the previous epoch: %r", exc)
        self._start(loader, record, None, first=False)
        for worker in range(self._num_workers):
            self._pool.put(Reset(self._shared_seed), worker=worker)
        for _ in range(self._num_workers):
            worker, state = self._get()
            if state is not None:
                record.note_worker_state(worker, self._num_workers, state)
        self._start_epoch()

    def _get(self) -> tuple[int, Any]:
        timeout = self._timeout if self._timeout > 0 else None
        stop = stop_requested()
        try:
            if stop is None:
                return self._pool.get(timeout=timeout)
            return self._get_in_slices(stop, timeout)
        except TimeoutError as exc:
            self.shutdown()
            raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds") from exc
        except WorkerError as exc:
            self.shutdown()
            raise _with_torch_wording(exc) from exc.__cause__

    def _get_in_slices(self, stop: Any, timeout: float | None) -> tuple[int, Any]:
        """A reading thread's wait: short waits (a timed-out one loses nothing) between checks of ``stop``,
        the loader's ``timeout`` and the pool's stall warning."""
        started = time.monotonic()
        warn_at = self._pool.stall_warning
        while True:
            if stop.is_set():
                raise Stopped
            self._apply_credits()  # tasks granted meanwhile go out now: a worker may be waiting for one
            self._raise_put_error()
            waited = time.monotonic() - started
            left = None if timeout is None else timeout - waited
            # short slices while grants may come (batches are with the consumer), else long ones
            slice_s = _GRANT_SLICE_S if self._owed > 0 else _SLICE_S
            try:
                return self._pool.get(timeout=slice_s if left is None else max(0.0, min(slice_s, left)))
            except WorkerTimeoutError as exc:
                waited = time.monotonic() - started
                if left is not None and waited >= timeout:
                    raise
                if warn_at is not None and waited >= warn_at:
                    log.warning("DataLoader: no batch from the workers for %.0f s: %s", waited, exc)
                    warn_at *= 2

    def _try_put(self, index: Any = None) -> None:
        """Send the next task (``index``: one the consumer drew, see :meth:`grant`); sets ``_no_more`` when
        no task will ever be sent again this epoch (the sampler or the flow ran out, no worker is active)."""
        if self.closed or self._source_failed:
            return
        try:
            task = self._next_index() if index is None else index.value
            if self._source is not None:
                if self._record.problem is None and self._pulled not in self._flow_before:
                    self._flow_before[self._pulled], self._record.problem = flow_state(self._dataset)
                task = self._source.fetch(task)
                self._pulled += 1
        except StopIteration:
            self._no_more = True
            return
        except Exception as exc:  # the DataFlow failed: raise it after the batches read before it
            self._source_error, self._source_failed, self._no_more = exc, True, True
            return
        worker = None  # unordered: the pool picks the least busy worker
        if not self._unordered:
            for _ in range(self._num_workers):
                worker = next(self._cycle)
                if self._active[worker]:
                    break
            else:
                self._no_more = True
                return
        try:
            self._pool.put(task, worker=worker)
        except WorkerError as exc:
            # The worker died with its results sent: the batch just received is handed out first, then
            # this error, as when a get finds the death.
            self.shutdown()
            error = _with_torch_wording(exc)
            error.__cause__ = exc.__cause__
            self._put_error = error
            return
        if not self._unordered:
            self._owners.append(worker)

    # --- driven by a reading thread (pin_memory): tasks are sent when batches are handed out ---------

    def read_ahead(self) -> None:
        """From now on a reading thread calls :meth:`_read_step` and the consumer :meth:`grant`: a task
        replacing a batch is sent only once the consumer has that batch, as torch's loader does, so the
        sampler (and a DataFlow) is read exactly as far as without a reading thread, whatever the timing."""
        self._credits: collections.deque | None = collections.deque()
        self._credit_event = threading.Event()

    def grant(self) -> None:
        """In the consumer's thread, for each batch (or error) of the pool handed out: the task that
        replaces it. Map-style indices are drawn here, where torch draws them."""
        if self.closed:
            return
        if self._kind == MAP:
            try:
                credit: Any = _Index(self._next_index())
            except StopIteration:
                credit = _NO_MORE
        else:
            credit = _DRAW
        self._credits.append(credit)
        self._credit_event.set()

    def _apply_credits(self) -> None:
        """In the reading thread: send the tasks the consumer granted."""
        credits = self._credits
        while credits:
            credit = credits.popleft()
            self._owed -= 1
            if credit is _NO_MORE:
                self._no_more = True
            else:
                self._try_put(None if credit is _DRAW else credit)

    def _raise_put_error(self) -> None:
        if self._put_error is not None:
            error, self._put_error = self._put_error, None
            raise error

    def _owe(self) -> None:
        """A batch (or error) of the pool goes to the consumer: its task comes when it is handed out."""
        self._owed += 1
        self._step_credit = True

    def _wait_for_credit(self) -> None:
        stop = stop_requested()
        while not self._credits:
            if stop is not None and stop.is_set():
                raise Stopped
            self._credit_event.wait(_SLICE_S)
            self._credit_event.clear()

    def _delivered(self, worker: int) -> None:
        record = self._record
        record.yielded += 1
        record.last_worker = worker
        if self._source is not None:
            record.flow_ended = self._source.ended and record.yielded == self._pulled
        if self._source is not None and record.problem is None:
            # the position to resume from is the flow's before it gave the next batch's samples
            before_next = self._flow_before.pop(record.yielded, _NOT_PULLED)
            for n in [n for n in self._flow_before if n < record.yielded]:
                del self._flow_before[n]
            if before_next is _NOT_PULLED:  # nothing pulled since: the flow is there now
                before_next, record.problem = flow_state(self._dataset)
            record.flow = before_next

    def _next_data(self) -> Any:
        reading = self._credits is not None  # driven by a reading thread: tasks are sent on grants
        while True:
            if reading:
                self._apply_credits()
            self._raise_put_error()
            if self.closed:
                raise StopIteration
            if self._pool.outstanding <= 0:
                if reading and self._owed > 0 and not self._no_more:
                    self._wait_for_credit()  # batches are with the consumer; their tasks come back
                    continue
                if self._source_error is not None:
                    error, self._source_error = self._source_error, None
                    raise error
                self._record.finished = True
                if self._source is not None and self._record.problem is None:
                    self._record.flow, self._record.problem = flow_state(self._dataset)
                if not self._persistent_workers:
                    self.shutdown()
                else:
                    close_source(self._source)
                raise StopIteration
            try:
                worker, result = self._get()
            except Exception:  # the dataset's error: keep the pipeline full, as torch does, then raise
                if self.closed:
                    raise
                owner = self._owners.popleft() if self._owners else None
                if not reading:
                    self._try_put()
                if self._discard:  # a fast-forward reads it again: the consumer saw this error already
                    self._discard -= 1
                    if reading:
                        self._try_put()
                    continue
                if reading:
                    self._owe()
                if owner is not None:
                    self._delivered(owner)  # consumed: a resume must not read it again
                raise
            if self._owners:
                self._owners.popleft()
            if type(result) is StreamEnded:  # its state after running out, then as any exhausted worker
                self._record.note_worker_state(worker, self._num_workers, result.state)
                result = self._exhausted
            if result is self._exhausted:
                self._active[worker] = False
                self._record.note_exhausted(worker, self._num_workers)
                self._try_put()
                continue
            if not reading:
                self._try_put()
            if isinstance(result, StopFromDataset):
                raise StopIteration
            if type(result) is WithState:
                self._record.note_worker_state(worker, self._num_workers, result.state)
                result = result.data
            if self._discard:
                self._discard -= 1
                if reading:
                    self._try_put()
                continue
            if reading:
                self._owe()
            self._delivered(worker)
            return unpack(result)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        close_source(self._source)
        if self._pool is not None:
            self._finalizer()
