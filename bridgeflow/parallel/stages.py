"""Parallel stages: map a function over a flow in worker threads or processes, or run copies of a flow.

These are DataFlows, composable with batching on either side: ``BatchData`` after a map stage batches
in the consumer; ``BatchData`` inside the flow a runner copies batches in the workers.

- :class:`MultiProcessMapData` / :class:`MultiThreadMapData`: the source is read in the consumer, each
  datapoint goes to a worker, ``map_func`` runs there, results come back in source order
  (``ordered=True``) or as ready. The two differ only in the kind of worker; output is the same.
- :class:`MultiProcessRunner` / :class:`MultiThreadRunner`: every worker iterates its own copy of the
  flow (reset with a distinct seed) and the consumer takes datapoints as they come.

Each worker seeds Python's ``random`` and numpy's global RNG from its own seed, so augmentations that
use them differ between workers (forked workers would otherwise share one RNG state).

``strict`` keeps tensorpack's meaning for the map stages: ``strict=True`` runs exactly one epoch of the
source per iteration and drops anything in flight when an iteration ends early. ``strict=False`` (the
default) keeps the workers busy across epoch boundaries: an iteration yields ``len(ds)`` results and the
next one continues where it stopped (a source without ``len()`` always runs strict).

State (``state_dict()``): a map stage saves its source's state at the oldest datapoint the consumer has
not received (see :mod:`bridgeflow.parallel.progress`), so work in flight is redone on resume, never
lost or repeated. Ordered stages resume exactly; ``ordered=False`` resumes with every datapoint not yet
received exactly once, in an order that may differ. A runner saves each worker's copy's state at the
last datapoint received from it; on resume each worker restores its copy (the interleaving of the
workers may differ). Randomness *inside* ``map_func`` (or a runner worker's use of the global RNGs) is
not restored: resuming is exact for a deterministic ``map_func``, and only in distribution for random
augmentation.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from .._renamed import renamed_keywords
from ..base import DataFlow, epoch_live
from ..errors import LengthUnknownError
from ..state import StateMismatchError, check_count, child_state, field, load_child
from ..transforms import _DATAPOINT_TYPES, check_datapoint
from .common import (
    ParallelStage,
    check_picklable,
    check_positive,
    chunk_size,
    forever,
    seed_worker_globals,
    warn_if_oversubscribed,
)
from .fused import BatchPlan, BatchTask, WorkerBatching, map_group
from .pool import WorkerContext, WorkerPool
from .progress import SNAPSHOT_EVERY, SourceLedger, check_source_position
from .runners import MultiProcessRunner, MultiThreadRunner

__all__ = ["MultiProcessMapData", "MultiProcessRunner", "MultiThreadMapData", "MultiThreadRunner"]

log = logging.getLogger(__name__)


def _map_init(map_func: Callable[[Any], Any], ctx: WorkerContext) -> Callable[[Any], Any]:
    seed_worker_globals(ctx.seed)
    writer = ctx.writer
    who = f"map_func {getattr(map_func, '__qualname__', map_func)!s}"

    def map_one(payload: Any) -> Any:
        out = map_func(payload)
        return out if out is None or type(out) in _DATAPOINT_TYPES else check_datapoint(out, who)

    reserve = None
    if writer is not None:  # stack straight into shared memory: the only copy of the bytes
        def reserve(nbytes: int) -> Any:
            writer.reserve(nbytes)
            return writer.alloc

    def run(payload: Any) -> Any:
        if type(payload) is not BatchTask:
            return map_one(payload)
        return map_group(payload, map_one, reserve)

    return run


class _MapStage(ParallelStage):
    def __init__(self, ds: DataFlow, num_workers: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, start_method: str | None = None,
                 seed: int | None = None, timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        super().__init__(ds)
        who = type(self).__name__
        self._set_waits(timeout, stall_warning)
        self.num_workers = check_positive(num_workers, "the number of workers", who)
        if not callable(map_func):
            raise TypeError(f"{who}: map_func must be callable, got {map_func!r}")
        self.map_func = map_func
        self.buffer_size = check_positive(buffer_size, "buffer_size", who)
        self.strict = strict
        self.ordered = ordered
        self.start_method = start_method
        self.seed = seed
        self._capacity = self.buffer_size
        self._carry: Iterator | None = None
        self._batched: BatchPlan | None = None  # fused batching: groups in flight into the next epoch
        self._plan: BatchPlan | None = None  # the fused plan of the epoch in progress
        self._batching: WorkerBatching | None = None  # set while WorkerBatching begins an epoch of batches
        self._ledger: SourceLedger | None = None  # the source stream's positions (None: no stream)
        self._taken = 0  # results taken in the (unbatched) epoch in progress
        self._skips: collections.deque = collections.deque()  # after an unordered resume: runs received already
        self._index_of: dict[int, int] = {}  # unordered: task id -> pull index

    def _new_pool(self) -> WorkerPool:
        if self._processes and self.start_method not in (None, "fork"):
            check_picklable(self.map_func, "map_func", type(self).__name__, self.start_method)
        self._drop_iteration()  # the last pool's carried stream and plans: a new pool starts anew
        return WorkerPool(functools.partial(_map_init, self.map_func), self.num_workers,
                          processes=self._processes, start_method=self.start_method, name=type(self).__name__,
                          base_seed=self.seed, ordered=self.ordered,
                          chunk_size=chunk_size(self.buffer_size, self.num_workers), **self._pool_options())

    def _on_reset(self) -> None:
        self.ds.reset_state()
        super()._on_reset()

    def _epoch_size(self) -> int | None:
        if self.strict:
            return None
        try:
            return len(self.ds)
        except LengthUnknownError:
            return None

    # --- the source stream --------------------------------------------------------------------------

    def _new_ledger(self) -> SourceLedger:
        """Positions of a new stream of the source, starting where the source is now."""
        self._skips.clear()
        self._index_of.clear()
        self._ledger = SourceLedger(self.ds)
        return self._ledger

    def _carried(self) -> Iterator:
        """The endless stream of source datapoints that non-strict epochs share."""
        if self._carry is None:
            self._carry = forever(self.ds, type(self).__name__)
            self._new_ledger()
        return self._carry

    def _drop_in_flight(self, pool: WorkerPool) -> None:
        """Forget the work in flight (not the carried stream): the stream goes on after it, as a new one."""
        plan, self._batched = self._batched, None
        if plan is not None:
            plan.close()
        if pool.outstanding:
            pool.discard_outstanding()
            if self._carry is not None:
                self._new_ledger()

    def _resume(self, pool: WorkerPool, resume: dict, size: int | None, fused: bool) -> Iterator:
        """Take a loaded state: the source (loaded already) is at a snapshot; pull and discard the datapoints
        received after it; the runs received above are skipped when they come. Returns the source stream."""
        plan, self._batched = self._batched, None
        if plan is not None:
            plan.close()
        if pool.outstanding:
            pool.discard_outstanding()
        if size is None:
            source = iter(self.ds)
        else:
            if self._carry is not None:
                self._carry.close()
            source = self._carry = forever(self.ds, type(self).__name__, resumed=True)
        ledger = self._new_ledger()
        ledger.snapshot()  # the loaded state, as the source gives it back
        replay = resume["replay"]
        for i in range(replay):
            try:
                next(source)
            except StopIteration:
                raise StateMismatchError(f"resuming replays {replay} datapoints of the source after its saved "
                                         f"state, but it ended after {i}") from None
        ledger.pulled = ledger.low = replay
        for offset, length in resume["skip"]:
            ledger.done[replay + offset] = length
            if not fused:
                self._skips.append((replay + offset, length))
        return source

    def _pull(self, source: Iterator) -> Any:
        """The next source datapoint, counted (and the source's state noted every so often)."""
        ledger = self._ledger
        while self._skips and self._skips[0][0] == ledger.pulled:  # received before the state was saved
            _, length = self._skips.popleft()
            for _ in range(length):
                self._next(source)
            ledger.pulled += length
        if ledger.pulled >= ledger.next_snap:
            ledger.snapshot()
        dp = self._next(source)
        ledger.pulled += 1
        return dp

    def _next(self, source: Iterator) -> Any:
        try:
            return next(source)
        except StopIteration:
            raise
        except BaseException:
            # The source raised, so its generator is finished: the next epoch must start a new pass (a
            # finished generator would raise StopIteration, or end every later epoch at once).
            if self._carry is source:
                self._carry = self._ledger = None
            raise

    def _put(self, pool: WorkerPool, source: Iterator) -> None:
        task = pool.put(self._pull(source))
        if not self.ordered:
            self._index_of[task] = self._ledger.pulled - 1

    def _took(self, pool: WorkerPool) -> None:
        """Bookkeeping for one result taken from the pool (the consumer receives it, or it was dropped)."""
        self._taken += 1
        if self.ordered:
            self._ledger.low += 1
        else:
            self._ledger.received(self._index_of.pop(pool.last_task_id), 1)

    # --- iteration ----------------------------------------------------------------------------------

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        pool = self._live_pool()
        batching, self._batching = self._batching, None
        if batching is not None:  # an epoch of batches made in the workers
            return batching.stage_epoch(pool, resume)
        if self._batched is not None:  # groups of a fused BatchData are in flight: not datapoints
            self._drop_in_flight(pool)
        size = self._epoch_size()
        self._taken = 0
        self._plan = None
        if resume is not None:
            fused = resume["batch"]
            if fused is not None and (resume["taken"] or fused["held"]):
                raise StateMismatchError("the state was saved under a BatchData (batches made in the workers), "
                                         "this stage is iterated without one", [type(self).__name__])
            source = self._resume(pool, resume, size, fused=False)
            self._taken = resume["taken"]
        elif size is None:
            source = iter(self.ds)
            self._new_ledger()
        else:
            source = self._carried()
        if size is None:
            return self._strict_epoch(pool, source)
        return self._carried_epoch(pool, size)

    def _strict_epoch(self, pool: WorkerPool, source: Iterator) -> Iterator:
        ledger = self._ledger
        more = True

        def refill() -> None:
            nonlocal more
            while more and pool.outstanding < self.buffer_size and not pool.saturated:  # bytes bound it too
                try:
                    self._put(pool, source)
                except StopIteration:
                    more = False

        try:
            refill()
            while pool.outstanding:  # none only once the source ran out (a saturated pool holds tasks)
                out = self._get(pool)
                self._took(pool)
                refill()
                if out is not None:
                    self._stats.datapoints += 1
                    yield out
        finally:
            if pool.outstanding and self._pool is pool:
                pool.discard_outstanding()
            if hasattr(source, "close"):
                source.close()
            if self._ledger is ledger:  # the source's epoch is over: its own state says where it is
                self._ledger = None

    def _carried_epoch(self, pool: WorkerPool, size: int) -> Iterator:
        carry = self._carry
        buffer_size = self.buffer_size
        while self._taken < size:
            while pool.outstanding < buffer_size and not pool.saturated:  # bytes bound it too
                self._put(pool, carry)
            out = self._get(pool)
            self._took(pool)
            if out is not None:
                self._stats.datapoints += 1
                yield out

    def batched(self, batch_size: int, remainder: bool = False, use_list: Any = False,
                pad_value: Any = None) -> WorkerBatching:
        """The flow of this stage's datapoints in batches stacked in its workers (``BatchData(self, ...)``
        reads it; see :class:`~bridgeflow.parallel.fused.WorkerBatching`)."""
        return WorkerBatching(self, batch_size, remainder, use_list, pad_value)

    # --- state --------------------------------------------------------------------------------------

    def _own_state(self) -> dict:
        """The source's state at the oldest datapoint the consumer has not received, and the stage's place
        in its epoch (see :mod:`bridgeflow.parallel.progress`). Costs a few dict entries: the source's
        state was taken as the stage read it."""
        head = {"strict": self._epoch_size() is None, "ordered": bool(self.ordered)}
        ledger = self._ledger
        if ledger is None:
            return {**head, "source": child_state(self.ds), "replay": 0, "skip": [], "taken": 0, "batch": None}
        source, replay, skip = ledger.position()
        live = epoch_live(self)
        plan = self._plan if live else self._batched
        if plan is not None and plan.ledger is ledger:
            batch = plan.state(plan.taken if live else 0)
            taken = batch.pop("taken")
        else:
            batch, taken = None, self._taken if live else 0
        return {**head, "source": source, "replay": replay, "skip": skip, "taken": taken, "batch": batch}

    def _take_state(self, state: dict) -> None:
        strict = self._epoch_size() is None
        if field(state, "strict", bool) != strict:
            raise StateMismatchError(f"the state is for a {'strict' if state['strict'] else 'carried'} stage, "
                                     f"this one is {'strict' if strict else 'carried'} (strict=, or a source "
                                     "without len())")
        if field(state, "ordered", bool) != bool(self.ordered):
            raise StateMismatchError(f"the state is for ordered={state['ordered']}, this stage has "
                                     f"ordered={self.ordered}")
        batch = field(state, "batch", (dict, type(None)))
        per = 1 if batch is None else max(1, min(check_count(batch, "size"), 1 << 16))
        # in flight: at most buffer_size tasks (of a fused batch's datapoints each), pulled since the last snapshot
        most = SNAPSHOT_EVERY + (self.buffer_size + 1) * per
        if batch is not None:
            why = "the datapoints a stage can have in flight"
            for key in ("offset", "held"):
                check_count(batch, key, most, why)
            partial = field(batch, "partial", (list, type(None)))
            if partial is not None and not (len(partial) == 2
                                            and all(type(v) is int and 0 <= v <= most for v in partial)):
                raise StateMismatchError(f"damaged 'partial' entry {partial!r:.60} in the state")
        _, _, skip = check_source_position(state, most, f"buffer_size={self.buffer_size} in flight and "
                                                        f"{SNAPSHOT_EVERY} pulls between two snapshots")
        if self.ordered and skip:
            raise StateMismatchError("an ordered stage's state lists datapoints received out of order")
        size = self._epoch_size()
        check_count(state, "taken", None if size is None else -(-size // per) if batch is not None else size,
                    "the epoch's length")
        load_child(self.ds, state["source"])

    def _drop_iteration(self) -> None:
        """Close the carried source stream and the fused plans: the source's iteration they hold ends now (a
        dropped generator caught in a reference cycle would hold the source until a collection, and the
        source would refuse its next iteration)."""
        for plan in {id(p): p for p in (self._batched, self._plan) if p is not None}.values():
            plan.close()
        carry = self._carry
        self._batched = self._plan = self._carry = self._ledger = None
        if carry is not None:
            carry.close()

    def close(self) -> None:
        self._drop_iteration()
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        # generators and positions of this process's iteration
        state["_carry"] = state["_batched"] = state["_plan"] = state["_ledger"] = None
        state["_skips"], state["_index_of"] = collections.deque(), {}
        return state


class MultiProcessMapData(_MapStage):
    """Run ``map_func`` on every datapoint in ``num_proc`` worker processes.

    Array bytes in the results travel through shared memory (see :mod:`bridgeflow.parallel.shm`);
    received arrays are writable and valid for as long as you hold them. ``map_func`` returning
    ``None`` drops the datapoint. ``buffer_size`` bounds the datapoints in flight. ``nr_proc=`` (tensorpack's
    older name of ``num_proc=``) is accepted, deprecated.

    ``timeout`` (seconds, like torch's ``DataLoader(timeout=)``; every parallel stage takes it) raises
    :class:`~bridgeflow.WorkerTimeoutError` naming the worker when a result takes longer; after
    ``stall_warning`` seconds of waiting (default 60, ``None`` for never) a warning is logged with the
    worker's pid, state and Python stack.

    Example:
        >>> from bridgeflow import DataFromList, BatchData
        >>> df = BatchData(MultiProcessMapData(DataFromList(list(range(100))), 2, load_image), 64)
        ...  # doctest: +SKIP
    """

    _processes = True

    @renamed_keywords(nr_proc="num_proc")
    def __init__(self, ds: DataFlow, num_proc: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, start_method: str | None = None,
                 seed: int | None = None, timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        super().__init__(ds, num_proc, map_func, buffer_size, strict, ordered, start_method=start_method,
                         seed=seed, timeout=timeout, stall_warning=stall_warning)
        warn_if_oversubscribed(self.num_workers, type(self).__name__, "num_proc")


class MultiThreadMapData(_MapStage):
    """Run ``map_func`` on every datapoint in ``num_thread`` threads: the thread twin of MultiProcessMapData.

    Threads pay off when ``map_func`` releases the GIL (I/O, decoding in C, large numpy operations).
    A thread cannot be killed: a ``map_func`` that never returns keeps its thread alive after ``close()``.
    ``nr_thread=`` (tensorpack's older name of ``num_thread=``) is accepted, deprecated.
    """

    _processes = False

    @renamed_keywords(nr_thread="num_thread")
    def __init__(self, ds: DataFlow, num_thread: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, seed: int | None = None,
                 timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        super().__init__(ds, num_thread, map_func, buffer_size, strict, ordered, seed=seed, timeout=timeout,
                         stall_warning=stall_warning)
