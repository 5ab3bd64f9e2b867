"""Batch sources: what turns the epoch iterator's tasks into batches.

The protocol, which :class:`~._pin_memory.PinThread` also follows:

- ``put(task, worker, seq)`` queues a task for a worker (``None``: the least busy one, for ``in_order=False``);
  ``seq`` is the task's number in the epoch;
- ``get()`` returns ``(worker, seq, result)`` for the oldest task (or, unordered, the first ready), ``result`` a
  :class:`~._result.Result`; an error of the source itself (a dead worker, a timeout) is raised;
- ``reset(shared_seed)`` starts another epoch on the same workers; ``close()`` ends them;
- ``reads_ahead``: whether tasks are sent ahead of ``next()`` (workers) or one at a time (in-process).

- :class:`LocalSource` (``num_workers=0``) runs the workers' task function in this process, one task at a
  time, so both sources give the same values and markers;
- :class:`PoolSource` sends tasks to a bridgeflow :class:`~bridgeflow.parallel.WorkerPool` of processes
  and receives their batches through shared memory, tensors rebuilt without a copy as they are unpickled
  (:mod:`._convert`). A dead worker or the loader's ``timeout`` ends it with torch's words; a wait in a
  reading thread is cut into short slices (``between`` runs between them) so that stopping never waits for
  a slow worker.
"""

from __future__ import annotations

import collections
import functools
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bridgeflow import WorkerError, WorkerTimeoutError
from bridgeflow.engine import FaultPolicy
from bridgeflow.parallel import EXHAUSTED, WorkerPool

from ._fetch import COLLATE, MAP, Reset, WorkerSpec, WorkerTask, close_source, init_worker
from ._result import ENDED, FAILED, SKIPPED, STARTED, Result

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = ["LoaderFaults", "LocalSource", "PoolSource"]

log = logging.getLogger(__name__)

SLICE_S = 0.1  # a reading thread waits for a result in slices this long, checking whether to stop
SHORT_SLICE_S = 0.005  # ... and this long while the consumer has nothing waiting (a task may come any moment)


class LocalSource:
    """Batches read in this process, when ``get()`` asks for them."""

    reads_ahead = False
    workers: list = []

    def __init__(self, spec: WorkerSpec) -> None:
        self._task = WorkerTask(spec, 0, spec.dataset, in_worker=False)
        if self._task.error is not None:  # iter(dataset) failed: at iter(loader), as torch
            raise self._task.error
        self._tasks: collections.deque = collections.deque()

    @property
    def state(self) -> Any:
        """The dataset's state (and its iterator's) as read here, None when it has none."""
        fetcher = self._task.fetcher
        return fetcher.state() if fetcher is not None and fetcher.stateful else None

    def put(self, task: Any, worker: int | None, seq: int) -> None:
        self._tasks.append((task, seq))

    def get(self, between: Callable[[], None] | None = None) -> tuple[int, int, Result]:
        task, seq = self._tasks.popleft()
        try:
            return 0, seq, self._task(task)
        except Exception as exc:
            return 0, seq, Result(FAILED, exc)

    def set_mapping_hooks(self, hooks: Any) -> None:
        pass

    def close(self) -> None:
        close_source(self._task.fetcher)


def with_torch_wording(err: WorkerError) -> WorkerError:
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


class LoaderFaults(FaultPolicy):
    """The DataLoader's :class:`~bridgeflow.parallel._transport.supervision.FaultPolicy`: a task that kills
    every worker it meets is named by its sample's index (or its batch's), and skipped under
    ``on_error="skip"``."""

    hint = "; on_error='skip' skips it and goes on"

    def __init__(self, spec: WorkerSpec) -> None:
        self.kind, self.auto_collation, self.skip = spec.kind, spec.auto_collation, spec.skip

    def describe(self, task_id: int, payload: Any, item: int | None) -> str:
        if isinstance(payload, Reset):
            return "the start of a persistent worker's epoch"
        if self.kind == COLLATE:
            return "the collation of a batch of the DataFlow's samples"
        if self.kind == MAP and self.auto_collation:
            return f"the batch of indices {payload!r}" if item is None else f"the sample at index {payload[item]!r}"
        return f"the sample at index {payload!r}"

    def skipped(self, task_id: int, payload: Any, why: str) -> Result:
        if isinstance(payload, Reset):
            return Result(STARTED)
        index = payload if self.kind == MAP else None
        return Result(SKIPPED, skipped=[(index, why)])


class PoolSource:
    """Batches made by ``spec.num_workers`` worker processes (see the module doc)."""

    reads_ahead = True

    def __init__(self, spec: WorkerSpec, loader: DataLoader, unordered: bool) -> None:
        self._timeout = loader.timeout
        self._closed = False
        self._busy_before: float | None = None  # the workers' busy seconds when the first batch was asked for
        self._put_error: BaseException | None = None
        self._seqs: dict[int, int] = {}  # the pool's task id -> the task's number in the epoch
        self._pool = WorkerPool(functools.partial(init_worker, spec), spec.num_workers, processes=True,
                                start_method=loader.start_method, name="DataLoader", base_seed=spec.base_seed,
                                mapping_hooks=loader._bf.mapping_hooks, max_restarts=loader.max_restarts,
                                fault_policy=LoaderFaults(spec), ordered=not unordered)
        self._pool.start()

    @property
    def workers(self) -> list:
        """The worker processes' ``multiprocessing.Process`` handles."""
        return self._pool.worker_processes

    def put(self, task: Any, worker: int | None, seq: int) -> None:
        if self._put_error is not None or self._closed:
            return
        try:
            self._seqs[self._pool.put(task, worker=worker)] = seq
        except WorkerError as exc:
            # The worker died with its results sent: the batch just received is handed out first, then
            # this error (the next get()), as when a get finds the death.
            self.close()
            self._put_error = with_torch_wording(exc)

    def get(self, between: Callable[[], None] | None = None) -> tuple[int | None, int, Result]:
        """The next result; ``between()`` runs between short waits (it may raise to stop waiting). The worker
        is None for a dataset's error (the pool raises it without saying which worker)."""
        if self._put_error is not None:
            error, self._put_error = self._put_error, None
            raise error
        timeout = self._timeout if self._timeout > 0 else None
        try:
            if between is None:
                worker, value = self._pool.get(timeout=timeout)
            else:
                worker, value = self._get_in_slices(between, timeout)
        except WorkerTimeoutError as exc:
            raise self._timed_out(exc) from exc
        except WorkerError as exc:
            self.close()
            raise with_torch_wording(exc) from exc.__cause__
        except Exception as exc:  # the dataset's error
            return None, self._seqs.pop(self._pool.last_task_id, -1), Result(FAILED, exc)
        seq = self._seqs.pop(self._pool.last_task_id, -1)
        return worker, seq, Result(ENDED) if value is EXHAUSTED else value

    def _timed_out(self, exc: WorkerTimeoutError) -> RuntimeError:
        """torch's words, then the worker waited on, its pid and what it is doing; the workers are stopped
        first without the grace a clean close gives (they are stuck), so the error comes at the time asked."""
        for proc in self.workers:  # bridgeflow's workers outlive SIGTERM's grace; their segments are swept
            if proc.exitcode is None:
                proc.kill()
        self.close()
        who = f"worker {exc.worker} (pid {exc.pid})" if exc.worker is not None else "the workers"
        doing = str(exc).split("; it is ", 1)[1] if "; it is " in str(exc) else None
        return RuntimeError(f"DataLoader timed out after {self._timeout} seconds waiting for a batch from {who}"
                            + (f", which is {doing}" if doing else ""))

    def _get_in_slices(self, between: Callable[[], Any], timeout: float | None) -> tuple[int, Any]:
        """Short waits (a timed-out one loses nothing) with ``between()`` in between, honouring the loader's
        ``timeout`` and the pool's stall warning. ``between()`` returns whether a task may come any moment
        (then the slices are shorter)."""
        started = time.monotonic()
        warn_at = self._pool.stall_warning
        while True:
            urgent = between()
            if self._put_error is not None:
                error, self._put_error = self._put_error, None
                raise error
            waited = time.monotonic() - started
            left = None if timeout is None else timeout - waited
            slice_s = SHORT_SLICE_S if urgent else SLICE_S
            try:
                return self._pool.get(timeout=slice_s if left is None else max(0.0, min(slice_s, left)))
            except WorkerTimeoutError as exc:
                waited = time.monotonic() - started
                if timeout is not None and waited >= timeout:
                    raise
                if warn_at is not None and waited >= warn_at:
                    log.warning("DataLoader: no batch from the workers for %.0f s: %s", waited, exc)
                    warn_at *= 2

    def reset(self, shared_seed: int | None) -> list[tuple[int, Any]]:
        """Another epoch on the same workers: results of the epoch left early are dropped (errors too), each
        worker starts a fresh ``iter(dataset)``; returns ``(worker, its dataset's state)`` per worker."""
        pool = self._pool
        while pool.outstanding > 0:
            self.get()
        for w in range(pool.num_workers):
            pool.put(Reset(shared_seed), worker=w)
        started = []
        for _ in range(pool.num_workers):
            worker, _, result = self.get()
            assert worker is not None  # a Reset task does not fail: WorkerTask reports its errors later
            started.append((worker, result.state))
        self._seqs.clear()
        return started

    def counters(self, since: float | None) -> dict[str, float]:
        """The pool's figures for :meth:`~bridgeflow.adapters.torch.DataLoader.stats`: the average number
        of batches ready when asked, and the share of the workers' time spent reading and collating since
        ``since`` (a ``time.perf_counter()``)."""
        out = {"ready_average": self._pool.fill_average()}
        if self._pool.max_restarts:
            out["restarts"] = self._pool.restarts
        busy = self._pool.busy_seconds()
        if busy is not None and since is not None and self._busy_before is not None:
            elapsed = max(time.perf_counter() - since, 1e-9)
            out["workers_busy"] = min(1.0, max(0.0, busy - self._busy_before) / (elapsed * self._pool.num_workers))
        return out

    def started(self) -> None:
        """The consumer asks for its first batch: the workers' busy time counts from here."""
        if self._busy_before is None:
            self._busy_before = self._pool.busy_seconds()

    def set_mapping_hooks(self, hooks: Any) -> None:
        self._pool.set_mapping_hooks(hooks)  # closed too: its mappings still held by batches follow

    def close(self) -> None:
        self._closed = True
        self._pool.close()
