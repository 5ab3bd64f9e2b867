"""A pool of workers (threads or processes) that run tasks and return results in order.

Every parallel stage of bridgeflow, and the torch DataLoader adapter, runs on :class:`WorkerPool`:

- ``init_fn(ctx)`` runs once in each worker and returns that worker's task function;
- ``put(payload, worker=None)`` sends a task to one worker (round robin by default) without waiting
  for the worker to be free (a process worker drains its task pipe on a thread of its own);
- ``get()`` returns ``(worker_id, result)`` in task order (or as ready with ``ordered=False``). A task
  function that raises ``StopIteration`` returns :data:`EXHAUSTED`; any other exception is re-raised in
  the consumer with its type and message, the worker's traceback attached as ``__cause__``.

Both kinds of worker run the same loop, :func:`worker_loop`; only the channels differ
(:mod:`bridgeflow.parallel._transport.channels`), and the pool never asks which it has: it keeps the order of the
results, the chunks, the timeouts, the statistics and the forensics. Process workers send results through
:mod:`bridgeflow.parallel._transport.shm` (array bytes in shared memory) over one pipe each. The consumer waits on
those pipes *and* on the processes' sentinels, so a worker that dies (signal, ``os._exit``, OOM killer)
becomes a :class:`~bridgeflow.WorkerError` at once instead of a hang. Each process worker also watches
its parent and exits when the parent is gone, even if killed with SIGKILL.

Read-ahead is bounded in bytes as well as in tasks. The callers bound the tasks in flight by count
(``buffer_size``, ``prefetch_factor``); a process pool also keeps the bytes they occupy (each task's
message and its result's, shared memory included, learned from the messages as they pass) under
``max_bytes_in_flight`` (default :func:`read_ahead_budget`: a sixteenth of the memory, an eighth of
``/dev/shm``): tasks beyond it stay in the consumer, unsent, until results are taken (:attr:`saturated`
tells a caller to stop pulling from its source); until the first result says what results cost, one task
a worker goes out; tasks or results of more than 1 MiB travel one a message, never a chunk's worth at
once. One task always goes, however large. The shared memory a pool holds stays under about twice the
budget (its slabs are reused, two a worker and direction). A 0.75 GiB datapoint is carried with the
default options, one or two at a time, where chunks of 16 and 200 in flight into the next epochs
OOM-killed a worker at 12.6 GB.

With ``max_restarts=N`` a dead process worker is replaced instead, up to N times over the pool's life: a new
process with the same worker id and seed runs the tasks the dead one held again, so the results are those
of an undisturbed run, and a task that kills every worker it meets is named, or skipped under the owner's
:class:`~bridgeflow.parallel._transport.supervision.FaultPolicy` (see that module).

A worker that is alive but returns nothing (a deadlock, a stuck read, SIGSTOP) is found out too: after
``stall_warning`` seconds without the result it waits for, ``get()`` logs which worker holds the oldest
task, its state and its Python stack (:mod:`bridgeflow.parallel._transport.forensics`), and with ``timeout`` it
raises :class:`~bridgeflow.WorkerTimeoutError` naming that worker.

Example:
    >>> def init(ctx):
    ...     return lambda x: x * 10
    >>> with WorkerPool(init, 2, processes=False) as pool:
    ...     _ = pool.start()
    ...     ids = [pool.put(i) for i in range(3)]
    ...     [pool.get()[1] for _ in ids]
    [0, 10, 20]
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from ..._errors import BridgeflowError, DataFlowTerminated, WorkerError, WorkerTimeoutError
from . import forensics
from .channels import ProcessChannel, ThreadChannel
from .forensics import Wait, check_seconds
from .mapping import MappingHooks, MappingHookSet
from .pickling import describe_unpicklable
from .supervision import FaultPolicy, Supervisor, check_max_restarts
from .wire import FATAL, INIT, LIVENESS_INTERVAL, OK, RAN_OUT
from .worker import (
    EXHAUSTED,
    RemoteError,
    RemoteTraceback,
    WorkerContext,
    pack_exception,
    unpack_exception,
    worker_loop,
)

# The worker's side lives in .worker; its public names stay importable from here.
__all__ = [
    "EXHAUSTED", "MappingHooks", "RemoteError", "RemoteTraceback", "WorkerContext", "WorkerPool", "check_seconds",
    "describe_unpicklable", "pack_exception", "read_ahead_budget", "unpack_exception", "worker_loop",
]

log = logging.getLogger(__name__)

_SOLO_BYTES = 1 << 20  # a task costing more travels alone: a chunk of them would multiply it in the worker
_MIN_BUDGET = 256 << 20


def _memory_bytes() -> int | None:
    """The memory this process may use: the machine's, or its cgroup's limit if lower."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as f:
                limit = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if 0 < limit < (total or limit + 1):
            total = limit
    return total


def read_ahead_budget() -> int:
    """The bytes a process pool's read-ahead may occupy by default: a sixteenth of the memory (the cgroup's
    limit if lower), and an eighth of ``/dev/shm``, where tasks and results travel; at least 256 MiB."""
    budget = [m // 16 for m in (_memory_bytes(),) if m]
    try:
        st = os.statvfs("/dev/shm")
        if st.f_blocks:
            budget.append(st.f_blocks * st.f_frsize // 8)
    except OSError:
        pass
    return max(_MIN_BUDGET, min(budget)) if budget else 1 << 30


def _cost(old: float, nbytes: int, n: int) -> float:
    """A running cost per task: the larger of the newest and a slowly decaying mean."""
    new = nbytes / max(n, 1)
    return max(new, old * 0.875 + new * 0.125)


class WorkerPool:
    """``num_workers`` threads or processes, each running ``init_fn(ctx)``'s task function on its tasks.

    Args:
        init_fn: runs once per worker and returns its task function. With processes started by
            ``spawn`` or ``forkserver`` it must be picklable (a module-level function or a
            ``functools.partial`` of one).
        processes: ``False`` runs the workers as threads in this process (no copies, shared GIL).
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; default: multiprocessing's default.
        name: the stage name used in errors and thread/process names.
        base_seed: worker ``i`` gets seed ``base_seed + i``; random when ``None``.
        ordered: ``get()`` returns results in task order; ``False`` returns them as they are ready.
        chunk_size: tasks travel to a worker in chunks of this many, and their results come back
            together. Chunks amortize the per-message cost for small tasks; a partial chunk is sent as
            soon as the consumer waits for one of its results.
        timeout: seconds ``get()`` waits for a result before raising :class:`~bridgeflow.WorkerTimeoutError`
            naming the worker that holds the oldest task (``None``: wait as long as the workers live).
            The pool stays usable: a later ``get()`` returns that result if it comes.
        stall_warning: after this many seconds without the result ``get()`` waits for, log a warning
            with that worker's pid, state and Python stack, then again at twice the wait, and so on
            (``None``: never).
        mapping_hooks: told when a slab mapping of this pool opens and before it closes; see
            :meth:`set_mapping_hooks`.
        max_bytes_in_flight: process workers: the read-ahead's bytes (tasks sent and results not yet
            returned by ``get()``; see the module doc); ``None``: :func:`read_ahead_budget`.
        max_restarts: process workers: how many dead workers are replaced over the pool's life before a death
            is an error (0: the first is); see :mod:`~bridgeflow.parallel._transport.supervision`.
        fault_policy: names the tasks in errors and logs, and says whether a task (or an item of one) that
            kills every worker it meets is skipped; default: named by number, and raised.
        restart_init: ``restart_init(worker_id)`` returns the init function of a worker that replaces a dead
            one (a runner's worker starts from where its flow's copy was); default: ``init_fn``.
    """

    def __init__(self, init_fn: Callable[[WorkerContext], Callable[[Any], Any]], num_workers: int, *,
                 processes: bool = True, start_method: str | None = None, name: str = "WorkerPool",
                 base_seed: int | None = None, ordered: bool = True, chunk_size: int = 1,
                 timeout: float | None = None, stall_warning: float | None = 60.0,
                 mapping_hooks: MappingHooks | None = None, max_bytes_in_flight: int | None = None,
                 max_restarts: int = 0, fault_policy: FaultPolicy | None = None,
                 restart_init: Callable[[int], Callable[[WorkerContext], Callable[[Any], Any]]] | None = None) -> None:
        if not callable(init_fn):
            raise TypeError(f"{name}: init_fn must be callable, got {init_fn!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers <= 0:
            raise ValueError(f"{name}: the number of workers must be a positive integer, got {num_workers!r}")
        if start_method is not None and start_method not in mp.get_all_start_methods():
            raise ValueError(f"{name}: start_method must be one of {mp.get_all_start_methods()}, "
                             f"got {start_method!r}")
        self.init_fn = init_fn
        self.num_workers = num_workers
        self.processes = processes
        self.start_method = start_method
        self.name = name
        self.base_seed = base_seed
        self.ordered = ordered
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"{name}: chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.timeout = check_seconds(timeout, "timeout", name)
        self.stall_warning = check_seconds(stall_warning, "stall_warning", name)
        if max_bytes_in_flight is None:
            max_bytes_in_flight = read_ahead_budget()
        if isinstance(max_bytes_in_flight, bool) or not isinstance(max_bytes_in_flight, int) or \
                max_bytes_in_flight <= 0:
            raise ValueError(f"{name}: max_bytes_in_flight must be a positive number of bytes, got "
                             f"{max_bytes_in_flight!r}")
        self.max_bytes_in_flight = max_bytes_in_flight
        self.max_restarts = check_max_restarts(max_restarts, name)
        self.fault_policy = fault_policy
        self.restart_init = restart_init
        # threads do not die of a signal: only process workers are supervised
        self._supervisor = Supervisor(name, num_workers, max_restarts, fault_policy) \
            if processes and max_restarts else None
        self._contexts: list[WorkerContext] = []
        self._task_cost = self._result_cost = 0.0  # bytes per task, learned from the messages
        self._learned = not processes  # a result came back: what tasks cost is known (threads copy nothing)
        self._sent_open = 0  # tasks sent whose results get() has not returned (nor dropped)
        self.saturated = False  # the budget keeps tasks back: a caller should pull no more for now
        self._hooks = MappingHookSet(name)
        if mapping_hooks is not None:
            self._hooks.set(mapping_hooks)
        self._channel = ProcessChannel(name, num_workers, start_method, self._hooks) if processes else \
            ThreadChannel(name, num_workers)
        self._finalizer: weakref.finalize | None = None
        self._started = False
        self._closed = False
        self.interrupted = False  # an exception cut a receive short: a result may be lost (see get)
        self.last_task_id = -1  # the task id (put()'s return value) of the result get() returned last
        self._reset_counters()
        # statistics
        self.results_received = 0
        self.wait_time = 0.0
        self._fill_sum = 0
        self._fill_samples = 0

    def _reset_counters(self) -> None:
        self._next_task = 0
        self.results_returned = 0
        self._next_result = 0  # ordered mode: the task id get() returns next
        self._discard_below = 0
        self._rr = 0
        self._owner: dict[int, int] = {}
        self._per_worker = [0] * self.num_workers
        self._ready: dict[int, tuple[int, int, Any]] = {}  # task id -> (worker, kind, value)
        self._pending: list[list[tuple[int, Any]]] = [[] for _ in range(self.num_workers)]  # unsent chunks

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> WorkerPool:
        if self._closed:
            raise BridgeflowError(f"{self.name}: this pool was closed; create a new one")
        if self._started:
            return self
        base = self.base_seed if self.base_seed is not None else int.from_bytes(os.urandom(4), "little")
        contexts = [WorkerContext(w, self.num_workers, base + w, self.name) for w in range(self.num_workers)]
        self._contexts = contexts
        self._finalizer = weakref.finalize(self, self._channel.shutdown)
        self._started = True
        try:
            self._channel.start(contexts, self.init_fn)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every worker and free shared memory. Idempotent; also runs when the pool is collected."""
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer.detach()
        self._channel.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alive(self) -> bool:
        return self._channel.alive()

    @property
    def pids(self) -> list[int]:
        return self._channel.pids

    @property
    def worker_processes(self) -> list:
        """The worker processes' ``multiprocessing.Process`` handles (empty for threads, or before start)."""
        return self._channel.worker_processes

    @property
    def restarts(self) -> int:
        """Dead workers replaced so far (see ``max_restarts``)."""
        return self._supervisor.restarts if self._supervisor is not None else 0

    def ready_from(self, worker: int) -> int:
        """Results of ``worker`` received and not yet returned by ``get()``."""
        return sum(1 for w, _, _ in self._ready.values() if w == worker)

    @property
    def outstanding(self) -> int:
        """Tasks sent whose results have not been returned by ``get()`` (discarded ones excluded)."""
        return self._next_task - self._discard_below - self.results_returned

    # --- tasks ------------------------------------------------------------------------------------

    def put(self, payload: Any, worker: int | None = None, *, flush: bool = False) -> int:
        """Queue ``payload`` for ``worker`` (default: round robin by chunk, or the least busy when unordered).

        Does not wait for the worker to finish its current task: the caller bounds the tasks in flight
        (see :attr:`outstanding`). ``flush=True``
        sends the worker's chunk now, ending it with this task (for tasks that are big on their own).
        """
        if not self._started or self._closed:
            state = "closed" if self._closed else "not started"
            raise BridgeflowError(f"{self.name}: put() on a pool that is {state}")
        if self._channel.forked_from is not None:
            self._raise_forked()
        solo = self._solo()
        if worker is None:
            if self.ordered:
                worker = self._rr
                if flush or solo or len(self._pending[worker]) + 1 >= self.chunk_size:
                    self._rr = (self._rr + 1) % self.num_workers
            else:
                worker = min(range(self.num_workers), key=self._per_worker.__getitem__)
        task_id = self._next_task
        self._next_task += 1
        self._owner[task_id] = worker
        self._per_worker[worker] += 1
        pending = self._pending[worker]
        pending.append((task_id, payload))
        if flush or solo or len(pending) >= self.chunk_size:
            self._flush(worker)
        return task_id

    def costs(self) -> list[float] | None:
        """What a task and its result cost in bytes, as learned from the results (None until one came back,
        and for threads, which copy nothing): a stage's state carries them, so that a pool resumed from it
        reads ahead as far as this one does (see :meth:`assume_costs`)."""
        return [self._task_cost, self._result_cost] if self._learned and self.processes else None

    def assume_costs(self, costs: list[float]) -> None:
        """Start from the costs another pool learned (:meth:`costs`), unless this one learned its own: a fresh
        pool sends one task a worker until a result says what results cost, and so reads its source less far
        ahead than the pool whose state it resumes from."""
        if not self._learned:
            self._task_cost, self._result_cost = float(costs[0]), float(costs[1])
            self._learned = True

    def _solo(self) -> bool:
        """Tasks go one a message: their cost is not known yet, or a chunk of them would be large."""
        return not self._learned or self._task_cost + self._result_cost >= _SOLO_BYTES

    def _room(self, n: int, force: bool) -> int:
        """How many of ``n`` tasks the byte budget lets go now (one at least when ``force`` or none is out).
        Until a result came back, what results cost is not known: one task a worker goes out."""
        cost = self._task_cost + self._result_cost
        if not self._learned:
            k = self.num_workers - self._sent_open
        elif cost <= 0:
            return n
        else:
            k = int((self.max_bytes_in_flight - self._sent_open * cost) // cost)
        if k >= n:
            return n
        return max(k, 1 if force or self._sent_open == 0 else 0)

    def _flush(self, worker: int, force: bool = False) -> None:
        """Send ``worker``'s pending tasks, as far as the byte budget lets (``force``: the first at least)."""
        pending = self._pending[worker]
        while pending:
            n = self._room(1 if self._solo() else len(pending), force)
            if n == 0:
                self.saturated = True
                return
            chunk, pending = pending[:n], pending[n:]
            self._pending[worker] = pending
            self._sent_open += n
            if self._supervisor is not None:
                self._supervisor.sent(worker, chunk)
            if not self._channel.send(worker, chunk):
                self._last_words(worker)  # replaced (the chunk sent again with its other tasks), or raises
            self._task_cost = _cost(self._task_cost, self._channel.sent_bytes, n)
            force = False

    def _release(self) -> None:
        """Send the tasks the budget kept back, oldest first, as far as it lets now."""
        self.saturated = False
        for worker in sorted((w for w in range(self.num_workers) if self._pending[w]),
                             key=lambda w: self._pending[w][0][0]):
            self._flush(worker)
            if self.saturated:
                return

    def discard_outstanding(self) -> None:
        """Forget every task queued so far: unsent ones are dropped, results of sent ones when they arrive."""
        for w, chunk in enumerate(self._pending):
            self._per_worker[w] -= len(chunk)
        self._pending = [[] for _ in range(self.num_workers)]
        self.results_returned = 0
        self._discard_below = self._next_task
        self._next_result = self._next_task
        self._sent_open -= len(self._ready)  # received, never to be returned
        self._ready = {k: v for k, v in self._ready.items() if k >= self._discard_below}
        self._owner = {k: v for k, v in self._owner.items() if k >= self._discard_below}
        self.saturated = False

    def get(self, timeout: float | None = None) -> tuple[int, Any]:
        """The next result as ``(worker_id, value)``; raises the worker's exception for a failed task.

        ``timeout`` (seconds, default the pool's ``timeout``) raises :class:`~bridgeflow.WorkerTimeoutError`
        naming the worker that holds the oldest task; nothing is lost, a later ``get()`` may still
        return it. An exception that interrupts the wait itself (Ctrl-C, or any raised by a signal
        handler) may strike between reading a message and filing its results, so the pool marks itself
        ``interrupted`` and every later ``get()`` raises instead of waiting for a result that may
        never come; the parallel stages then start new workers.
        """
        if self._channel.forked_from is not None:
            self._raise_forked()
        if self.interrupted:
            raise BridgeflowError(f"{self.name}: an earlier get() was interrupted while receiving, so results "
                                  "may be lost; close this pool and start a new one")
        if self.outstanding <= 0:
            raise BridgeflowError(f"{self.name}: get() with no task outstanding")
        t0 = time.perf_counter()
        if not self.results_returned & 7:  # sample the buffer fill on every 8th call: it is only an average
            self._fill_sum += self._ready_count()
            self._fill_samples += 1
        wait = Wait(time.monotonic(), self.timeout if timeout is None else timeout, self.stall_warning)
        if self.ordered:
            want = self._next_result
            if want not in self._ready:
                owner = self._owner[want]
                if self._pending[owner] and self._pending[owner][0][0] <= want:
                    self._flush(owner, force=True)
                while want not in self._ready:
                    self._receive(wait, owner)
            worker, kind, value = self._ready.pop(want)
            self._next_result += 1
        else:
            while not self._ready:
                if sum(self._per_worker) == sum(map(len, self._pending)):
                    self.saturated = False
                    for w in range(self.num_workers):  # nothing in flight but unsent chunks: send them
                        self._flush(w, force=not self._sent_open)
                self._receive(wait)
            want = next(iter(self._ready))
            worker, kind, value = self._ready.pop(want)
        self._owner.pop(want, None)
        self.last_task_id = want
        self.results_returned += 1
        self._sent_open -= 1
        if self.saturated:
            self._release()
        self.wait_time += time.perf_counter() - t0
        if kind == OK:
            return worker, value
        if kind == RAN_OUT:
            return worker, EXHAUSTED
        raise unpack_exception(value, self._channel.where(worker))

    def _ready_count(self) -> int:
        return self._channel.unread(self.results_received) + len(self._ready)

    def _receive(self, wait: Wait, worker: int | None = None) -> None:
        """Wait for one message from any worker and file it; raise if a worker died or time ran out."""
        try:
            self._receive_and_file(wait, worker)
        except (BridgeflowError, TimeoutError):  # raised on purpose, with nothing half-received
            raise
        except BaseException:
            self.interrupted = True
            raise

    def _receive_and_file(self, wait: Wait, worker: int | None) -> None:
        while True:
            wait_for = LIVENESS_INTERVAL
            now = time.monotonic()
            if wait.stall_at is not None and now >= wait.stall_at:
                self._log_stall(now - wait.started)
                wait.stall_at = wait.started + 2 * (now - wait.started)
            if wait.limit is not None:
                left = wait.started + wait.limit - now
                if left <= 0:
                    self._raise_timeout(wait.limit)
                wait_for = min(wait_for, left)
            if self._closed:
                self._raise_dead(0)
            try:
                msg = self._channel.receive(wait_for, worker)
            except WorkerError:  # a message that cannot be read: its results are lost
                self.interrupted = True
                raise
            if msg is not None:
                break
        self._file(*msg)

    def _last_words(self, worker: int) -> None:
        """``worker`` is gone (its task pipe is closed). What it sent before it went may still be waiting,
        the error that made it stop among it: file that (raising the error) before calling it dead."""
        while (results := self._channel.leftover(worker)) is not None:
            self._file(worker, results)
        self._worker_died(worker)

    def _file(self, worker: int, results: list | None) -> None:
        """File one message of ``worker`` (``None``: its end-of-file, a death); raise the error it reports."""
        if results is None:
            self._worker_died(worker)
            return
        self.results_received += len(results)
        if self.processes:
            self._result_cost = _cost(self._result_cost, self._channel.received_bytes, len(results))
            self._learned = True
        ready, discard_below, supervisor = self._ready, self._discard_below, self._supervisor
        for kind, task_id, value in results:
            if task_id == INIT:
                raise unpack_exception(value, self._channel.where(worker) + " while starting")
            if task_id == FATAL:  # the worker cannot go on and exits; its tasks in flight are lost
                self.interrupted = True
                raise WorkerError(f"{self._channel.where(worker)} stopped: {value[2]}", stage=self.name, worker=worker,
                                  pid=self._channel.pid(worker)) from RemoteTraceback(value[3])
            self._per_worker[worker] -= 1
            if supervisor is not None:
                supervisor.answered(worker, task_id)
            if task_id >= discard_below:
                ready[task_id] = (worker, kind, value)
            else:  # discarded: returned never
                self._sent_open -= 1

    # --- hang forensics ---------------------------------------------------------------------------

    def _oldest_task(self) -> tuple[int, int] | None:
        """``(task id, worker)`` of the oldest task whose result has not arrived."""
        if self.ordered:
            want = self._next_result
            return (want, self._owner[want]) if want in self._owner else None
        waiting = [t for t in self._owner if t >= self._discard_below and t not in self._ready]
        return (min(waiting), self._owner[min(waiting)]) if waiting else None

    def _log_stall(self, waited: float) -> None:
        oldest = self._oldest_task()
        if oldest is not None:
            task, worker = oldest
            state, stack = self._channel.inspect(worker)
            log.warning("%s", forensics.stall_text(self.name, waited, worker, self._channel.pid(worker), task, state,
                                                   stack))

    def _raise_timeout(self, limit: float) -> None:
        oldest = self._oldest_task()
        if oldest is None:
            raise WorkerTimeoutError(f"{self.name}: no result from the workers after {limit:g} s", stage=self.name)
        task, worker = oldest
        state, stack = self._channel.inspect(worker, wait=0.5 if limit >= 1 else 0.0)
        frame = forensics.innermost(stack)
        raise WorkerTimeoutError(
            f"{self._channel.where(worker)} has not returned task #{task} after {limit:g} s (timeout); it is {state}"
            + (f", in {frame}" if frame else ""), stage=self.name, worker=worker, pid=self._channel.pid(worker))

    # --- mapping hooks ----------------------------------------------------------------------------

    def set_mapping_hooks(self, hooks: MappingHooks | None) -> None:
        """Tell ``hooks`` about every slab mapping this pool's consumer side opens and closes.

        ``hooks.opened(mapping, address, nbytes)`` is called once after a slab is mapped (at once for
        the mappings already open), ``hooks.closing(mapping, address, nbytes)`` once before it is unmapped,
        never after: when the worker retires the slab, the pool closes, or the hooks are replaced
        (``None`` removes them). The address is stable while the mapping lives. A mapping whose arrays
        the consumer still holds stays mapped after the pool closes and is closed when they go. A hook
        that raises is logged once and dropped; the pipeline goes on. Thread workers use no slabs.
        See :class:`~bridgeflow.parallel.MappingHooks`.

        Example:
            >>> class Pin:   # e.g. page-lock each slab for fast CUDA copies
            ...     def opened(self, mapping, address, nbytes): register(address, nbytes)
            ...     def closing(self, mapping, address, nbytes): unregister(address)
            >>> pool.set_mapping_hooks(Pin())  # doctest: +SKIP
        """
        self._hooks.set(hooks)

    @property
    def mapping_hooks(self) -> MappingHooks | None:
        return self._hooks.hooks

    def _raise_forked(self) -> None:
        raise BridgeflowError(
            f"{self.name}: its workers belong to process {self._channel.forked_from}, and this process "
            f"({os.getpid()}) is a fork of it: a forked child cannot use its parent's workers. Build the pipeline "
            "in the child (or fork before reset_state() starts the workers)")

    def _raise_dead(self, worker: int) -> NoReturn:
        if self._closed:
            raise DataFlowTerminated(f"{self.name} was closed while a consumer was waiting for a result")
        text, code = self._channel.death(worker)
        raise WorkerError(text, stage=self.name, worker=worker, pid=self._channel.pid(worker), exitcode=code)

    # --- supervision (max_restarts; see .supervision) -----------------------------------------------

    def _worker_died(self, worker: int) -> None:
        """``worker`` died, and every message it sent before is filed: replace it within the restart budget,
        sending it the tasks the dead one held (a poison one skipped or raised), or raise its WorkerError."""
        sup = self._supervisor
        if sup is None or self._closed:
            self._raise_dead(worker)
        channel = self._channel
        assert sup is not None and isinstance(channel, ProcessChannel)  # only process pools are supervised
        text, code = channel.death(worker)
        retries, answered, lost = sup.replace(worker, text, code, channel.pid(worker), channel.mark(worker),
                                              self._discard_below)
        self._per_worker[worker] += len(retries) - lost  # in flight: those sent again, no more the others
        self._sent_open += len(retries) + len(answered) - lost
        for task_id, value in answered.items():
            self._ready[task_id] = (worker, OK, value)
        init = self.restart_init(worker) if self.restart_init is not None else self.init_fn
        channel.restart(self._contexts[worker], init)
        for retry in retries:  # a worker that dies at once is found dead by the next receive
            if not channel.send(worker, retry):  # type: ignore[arg-type]  # a Retry is a message too
                break

    # --- statistics -------------------------------------------------------------------------------

    def fill_average(self) -> float:
        """Average number of finished results waiting when the consumer asked for one."""
        return self._fill_sum / self._fill_samples if self._fill_samples else 0.0

    def busy_seconds(self) -> float | None:
        """Seconds the workers spent in their task function, all together (None when not measured)."""
        return self._channel.busy()
