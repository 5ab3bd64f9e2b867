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
not received (see :mod:`bridgeflow.parallel._progress`), so work in flight is redone on resume, never
lost or repeated. Ordered stages resume exactly; ``ordered=False`` resumes with every datapoint not yet
received exactly once, in an order that may differ. A stage over another, unordered, stage cannot re-read
its source to get the work in flight again (it would get other datapoints): its state is the source's
state now and the source datapoints in flight themselves (``held``). A runner saves each worker's copy's
state at the last datapoint received from it; on resume each worker restores its copy (the interleaving
of the workers may differ). Randomness *inside* ``map_func`` (or a runner worker's use of the global RNGs) is
not restored: resuming is exact for a deterministic ``map_func``, and only in distribution for random
augmentation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from .._base import DataFlow, epoch_live, unordered_stage
from .._errors import LengthUnknownError
from .._renamed import renamed_keywords
from .._state import StateMismatchError, child_state, pack_held, unpack_held
from .._state_schema import Child, Count, Flag, Held, Part, Same, Value
from .._transforms import _DATAPOINT_TYPES, check_datapoint
from ._common import (
    ParallelStage,
    check_picklable,
    check_positive,
    chunk_size,
    forever,
    seed_worker_globals,
    warn_if_oversubscribed,
)
from ._faults import MapFaults, Skipped, check_on_error, map_task
from ._fused import BatchPlan, WorkerBatching
from ._progress import SNAPSHOT_EVERY, check_runs, check_source_position
from ._resume_plan import MapCursor, drop_in_flight, most_in_flight, resume_source
from ._runners import MultiProcessRunner, MultiThreadRunner
from ._transport.pool import WorkerContext, WorkerPool

__all__ = ["MultiProcessMapData", "MultiProcessRunner", "MultiThreadMapData", "MultiThreadRunner"]

log = logging.getLogger(__name__)


def _map_init(map_func: Callable[[Any], Any], ctx: WorkerContext, skip: bool = False) -> Callable[[Any], Any]:
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

    return map_task(map_one, reserve, skip)


def _say_strict(saved: Any, have: Any) -> str:
    return (f"the state is for a {'strict' if saved else 'carried'} stage, this one is "
            f"{'strict' if have else 'carried'} (strict=, or a source without len())")


def _check_costs(flow: Any, costs: list) -> None:
    if not (len(costs) == 2 and all(type(v) in (int, float) and 0 <= v < 1 << 62 for v in costs)):
        raise StateMismatchError(f"damaged 'costs' entry {costs!r:.60} in the state")


def _check_pair(flow: Any, partial: list) -> None:
    if not (len(partial) == 2 and all(type(v) is int and v >= 0 for v in partial)):
        raise StateMismatchError(f"damaged 'partial' entry {partial!r:.60} in the state")


class _MapStage(ParallelStage):
    state_fields = (
        Same("strict", lambda f: f._epoch_size() is None, _say_strict),
        Same("ordered", lambda f: bool(f.ordered), "the state is for ordered={saved}, this stage has ordered={have}"),
        Child("source"), Count("replay"), Value("skip", list, check_runs), Count("taken"),
        Part("batch", (Count("size", 1 << 16, "batches of at most 65536 in the workers"), Count("offset"),
                       Count("held"), Value("partial", list, _check_pair, none=True)), none=True),
        Held(gaps=True), Flag("ended", optional=True), Count("ahead", optional=True),
        Value("costs", list, _check_costs, none=True, optional=True),
    )

    def __init__(self, ds: DataFlow, num_workers: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, start_method: str | None = None,
                 seed: int | None = None, timeout: float | None = None, stall_warning: float | None = 60.0,
                 max_restarts: int = 0, on_error: str = "raise") -> None:
        super().__init__(ds)
        who = type(self).__name__
        self._set_waits(timeout, stall_warning)
        self._set_faults(max_restarts)
        self.on_error = check_on_error(on_error, who)
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
        self._loose: str | None | bool = False  # the unordered stage under this one (False: not looked yet)
        self._cursor = MapCursor()  # where the stage stands in its source's stream

    def _new_pool(self) -> WorkerPool:
        if self._processes and self.start_method not in (None, "fork"):
            check_picklable(self.map_func, "map_func", type(self).__name__, self.start_method)
        self._cursor.drop()  # the last pool's carried stream and plans: a new pool starts anew
        return WorkerPool(functools.partial(_map_init, self.map_func, skip=self.on_error == "skip"), self.num_workers,
                          processes=self._processes, start_method=self.start_method, name=type(self).__name__,
                          base_seed=self.seed, ordered=self.ordered,
                          chunk_size=chunk_size(self.buffer_size, self.num_workers), fault_policy=MapFaults(self),
                          **self._pool_options())

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

    def _unordered(self) -> bool:
        return not self.ordered

    def _source_loose(self) -> str | None:
        """The unordered stage under this one, if any (its state then holds the datapoints in flight)."""
        if self._loose is False:
            self._loose = unordered_stage(self)
        return self._loose  # type: ignore[return-value]  # never False here: looked up just above

    def _source_stream(self, size: int | None) -> Iterator:
        """The source stream an epoch reads (see :meth:`MapCursor.stream`): one epoch of the source when strict
        (``size`` None), on a new ledger; else the endless stream of source datapoints that non-strict epochs
        share."""
        cursor, loose = self._cursor, self._source_loose() is not None
        if size is None:
            source = cursor.stream(iter(self.ds), loose)
            cursor.new_ledger(self.ds, loose)
            return source
        if cursor.carry is None:
            cursor.carry = cursor.stream(forever(self.ds, type(self).__name__), loose)
            cursor.new_ledger(self.ds, loose)
        return cursor.carry

    # the resume planning, in bridgeflow.parallel._resume_plan: where a resumed or gone-back source stands
    def _drop_in_flight(self, pool: WorkerPool, plan: BatchPlan | None = None) -> None:
        drop_in_flight(self._cursor, self.ds, pool, plan, size=self._epoch_size(),
                       loose=self._source_loose() is not None, ordered=bool(self.ordered), name=type(self).__name__)

    def _resume(self, pool: WorkerPool, resume: dict, size: int | None) -> Iterator:
        return resume_source(self._cursor, self.ds, pool, resume, size, loose=self._source_loose() is not None,
                             name=type(self).__name__)

    def _get(self, pool: WorkerPool) -> Any:
        out = super()._get(pool)
        if type(out) is Skipped:  # on_error="skip": datapoints left out, to count and log
            task = pool.last_task_id
            self._stats.skips.note(type(self).__name__, out.records, lambda item: self._skip_position(task, item))
            out = out.value
        return out

    def _skip_position(self, task: int, item: int | None, exact: bool = True) -> str:
        """Where the datapoint ``item`` of ``task`` is in its epoch, in words ('' when unknown): the number of
        a received result in an ordered epoch (``exact``: it is the one received now), or a fused group's."""
        cursor = self._cursor
        plan = cursor.plan
        size = self._epoch_size()
        if plan is not None and task in plan.tasks:
            at = plan.tasks[task][0] + (item or 0) - plan.block_base
            return f" (#{at % size if size else at} of the epoch)"
        if exact and self.ordered and cursor.ledger is not None:
            return f" (#{cursor.taken} of the epoch)"
        return ""

    def _put(self, pool: WorkerPool, source: Iterator) -> None:
        cursor = self._cursor
        task = pool.put(cursor.pull(source))
        if not self.ordered:
            ledger = cursor.ledger
            assert ledger is not None  # pull counted this one in it
            cursor.index_of[task] = ledger.pulled - 1

    # --- iteration ----------------------------------------------------------------------------------

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        cursor = self._cursor
        if cursor.held_first is not None and self._epoch_size() is None:  # a strict epoch's source ends with it,
            cursor.held_first.close()  # begun or not (one closed before its first datapoint never ran its finally)
            cursor.held_first = None
        pool = self._live_pool()
        batching, cursor.batching = cursor.batching, None
        if batching is not None:  # an epoch of batches made in the workers
            return batching.stage_epoch(cursor, pool, resume, self._epoch_size())
        if cursor.batched is not None:  # groups of a fused BatchData are in flight: not datapoints
            self._drop_in_flight(pool)
        size = self._epoch_size()
        cursor.began_strict = size is None
        cursor.taken = 0
        cursor.plan = None
        if resume is not None:
            fused = resume["batch"]
            if fused is not None and (resume["taken"] or fused["held"]):
                raise StateMismatchError("the state was saved under a BatchData (batches made in the workers), "
                                         "this stage is iterated without one", [type(self).__name__])
            source = self._resume(pool, resume, size)
            cursor.taken = resume["taken"]
        else:
            source = self._source_stream(size)
        if size is None:
            return self._strict_epoch(pool, source)
        return self._carried_epoch(pool, size)

    def _strict_epoch(self, pool: WorkerPool, source: Iterator) -> Iterator:
        cursor = self._cursor
        ledger = cursor.ledger
        ordered = bool(self.ordered)
        more = True

        def refill() -> None:
            nonlocal more
            while more and pool.outstanding < self.buffer_size and not pool.saturated:  # bytes bound it too
                try:
                    self._put(pool, source)
                except StopIteration:
                    more = False
                    cursor.ended = True

        try:
            refill()
            while pool.outstanding:  # none only once the source ran out (a saturated pool holds tasks)
                out = self._get(pool)
                cursor.took(pool, ordered)
                refill()
                if out is not None:
                    self._stats.datapoints += 1
                    yield out
        finally:
            if pool.outstanding and self._pool is pool:
                pool.discard_outstanding()
            if hasattr(source, "close"):
                source.close()
            if cursor.ledger is ledger:  # the source's epoch is over: its own state says where it is
                cursor.ledger = None

    def _carried_epoch(self, pool: WorkerPool, size: int) -> Iterator:
        cursor = self._cursor
        carry = cursor.carry
        assert carry is not None  # the carried stream: _source_stream() made it before this epoch began
        buffer_size = self.buffer_size
        ordered = bool(self.ordered)
        while cursor.taken < size:
            while pool.outstanding < buffer_size and not pool.saturated:  # bytes bound it too
                self._put(pool, carry)
            out = self._get(pool)
            cursor.took(pool, ordered)
            if out is not None:
                self._stats.datapoints += 1
                yield out

    def batched(self, batch_size: int, remainder: bool = False, use_list: Any = False,
                pad_value: Any = None) -> WorkerBatching:
        """The flow of this stage's datapoints in batches stacked in its workers (``BatchData(self, ...)``
        reads it; see :class:`~bridgeflow.parallel._fused.WorkerBatching`)."""
        return WorkerBatching(self, batch_size, remainder, use_list, pad_value)

    # --- state --------------------------------------------------------------------------------------

    def _own_state(self) -> dict:
        """The source's state at the oldest datapoint the consumer has not received, and the stage's place
        in its epoch (see :mod:`bridgeflow.parallel._progress`). Costs a few dict entries: the source's
        state was taken as the stage read it."""
        live = epoch_live(self)
        cursor = self._cursor
        strict = cursor.began_strict if live else self._epoch_size() is None
        head = {"strict": strict, "ordered": bool(self.ordered)}
        ledger = cursor.ledger
        if ledger is None:
            return {**head, "source": child_state(self.ds), "replay": 0, "skip": [], "taken": 0, "batch": None,
                    "held": None, "ended": False, "ahead": 0, "costs": None}
        loose = self._source_loose()
        ahead, costs = 0, None
        if loose is None:
            source, replay, skip = ledger.position()
            held = None
            if strict:  # how far the source was read, for a resumed epoch to match
                ahead = ledger.pulled - ledger.low + (len(cursor.held_first.left()) if cursor.held_first else 0)
                # and what the pool learned its tasks cost: a fresh one would read less far ahead until its
                # first result, and leave the source elsewhere if the epoch is closed before it takes more
                costs = self._pool.costs() if self._pool is not None else None
        else:  # the source's state now, and what was pulled from it and not received
            source, replay, skip = child_state(self.ds), 0, sorted([s - ledger.low, n] for s, n in ledger.done.items())
            held = pack_held(cursor.in_flight(ledger), loose)
        plan = cursor.plan if live else cursor.batched
        pending = cursor.partial[:2] if cursor.partial is not None else None
        if plan is not None and plan.ledger is ledger:
            batch = plan.state(plan.taken if live else 0, pending)
            taken = batch.pop("taken")
        else:
            batch, taken = None, cursor.taken if live else 0
            if cursor.fused_size and (pending is not None or cursor.align):  # after going back: where the next
                # plan's groups start, and a group delivered in part (to come again in the next epoch of batches)
                batch = {"size": cursor.fused_size, "offset": cursor.align, "held": 0,
                         "partial": None if pending is None else [pending[0] - ledger.low, pending[1]]}
        return {**head, "source": source, "replay": replay, "skip": skip, "taken": taken, "batch": batch,
                "held": held, "ended": cursor.ended, "ahead": ahead, "costs": costs}

    def _take_state(self, state: dict) -> None:
        """The bounds that depend on the fused batch size (a task holds a batch's datapoints), and order. Each is
        what the stage can hold (see ``most_in_flight``), so a state it saved always passes."""
        batch, size = state["batch"], self._epoch_size()
        per = 1 if batch is None else max(1, batch["size"])
        for run in state["skip"]:  # each run is one task received above the position
            if run[1] > per:
                raise StateMismatchError(f"the 'skip' entry {run!r:.60} of the state is longer than a task ({per})")
        # pulled past the position: the work in flight, and the runs received above it (unordered)
        reach = most_in_flight(batch, self.buffer_size, self.num_workers) + len(state["skip"]) * per
        why = (f"buffer_size={self.buffer_size} in flight, {len(state['skip'])} runs received above the position "
               f"and {SNAPSHOT_EVERY} pulls between two snapshots")
        if batch is not None:
            Count("batch.offset", max(0, size - 1) if size else 0,
                  "groups start inside an epoch of the source").check(self, batch["offset"])
            Count("batch.held", per, "groups wait in the holder for fewer datapoints than a batch").check(
                self, batch["held"])
            if batch["partial"] is not None and (batch["partial"][0] > reach or batch["partial"][1] > per):
                raise StateMismatchError(f"damaged 'partial' entry {batch['partial']!r:.60} in the state")
        check_source_position(state, SNAPSHOT_EVERY + reach, why)
        Count("ahead", reach, why).check(self, state.get("ahead") or 0)
        if state.get("ahead") and (state.get("held") is not None or size is not None):
            raise StateMismatchError("the state says the source was read ahead, which only a strict stage over an "
                                     "ordered flow saves")
        if self.ordered and state["skip"]:
            raise StateMismatchError("an ordered stage's state lists datapoints received out of order")
        if state.get("ended") and size is not None:
            raise StateMismatchError("the state says the source's epoch ended, which a carried stage's stream "
                                     "never does")
        Count("taken", None if size is None else -(-size // per) if batch is not None else size,
              "the epoch's length").check(self, state["taken"])
        if state.get("held") is not None:  # over an unordered stage: what was pulled and not received, held
            held = len(unpack_held(state["held"], gaps=True))
            if state["replay"] or held > reach or any(a + n > held for a, n in state["skip"]):
                raise StateMismatchError(f"the state's {held} held datapoints disagree with its 'replay' "
                                         f"{state['replay']} and 'skip' {state['skip']!r:.60} (at most {reach})")

    def close(self) -> None:
        self._cursor.drop()
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_cursor"] = self._cursor.detached()  # without the generators and positions of this iteration
        return state

    def __setstate__(self, state: dict) -> None:
        if "_cursor" not in state:  # pickled before the cursor: its fields were the stage's own
            fields = [f.name for f in dataclasses.fields(MapCursor)]
            state["_cursor"] = MapCursor(**{f: state.pop("_" + f) for f in fields if "_" + f in state}).detached()
        super().__setstate__(state)


class MultiProcessMapData(_MapStage):
    """Run ``map_func`` on every datapoint of ``ds`` in ``num_proc`` worker processes.

    ``ds`` is read in this process; each datapoint goes to a worker, and its ``map_func`` result comes back
    (arrays through shared memory: received arrays are writable and yours for as long as you hold them).

    Args:
        ds: the flow to read.
        num_proc: the number of worker processes.
        map_func: called with one datapoint, returns the new one (a list, tuple or dict), or ``None`` to
            drop it. Under ``spawn``/``forkserver`` it must be picklable (a module-level function).
        buffer_size: at most this many datapoints are in flight between ``ds`` and you: read ahead and
            being mapped, or mapped and not yet taken. Large ones are bounded in bytes as well (1/16 of the
            memory and 1/8 of /dev/shm by default; see the parallel stages page).
        strict: ``False`` (the default) keeps the workers busy across epochs: an iteration yields
            ``len(ds)`` results, and the read-ahead at its end already belongs to the next one. ``True``
            runs exactly one epoch of ``ds`` per iteration and drops what is in flight when you stop early.
            A ``ds`` without ``len()`` always runs strict.
        ordered: ``True`` (the default) yields results in ``ds``'s order; ``False`` yields each as soon as
            it is ready, so one slow datapoint does not hold up the others.
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; ``None``: multiprocessing's default.
        seed: worker ``i`` seeds Python's and numpy's global generators with ``seed + i`` (random when
            ``None``), so workers never repeat each other's augmentations.
        timeout: seconds to wait for a result before raising :class:`~bridgeflow.WorkerTimeoutError`
            naming the worker (``None``: wait for ever, as torch's ``DataLoader(timeout=0)``).
        stall_warning: after this many seconds of waiting, log a warning with the worker's pid, state and
            Python stack (``None``: never).
        max_restarts: how many dead worker processes (a signal, the OOM killer, an exit) are replaced before
            a death is an error (default 0: the first is, as before). A replacement has the dead worker's id
            and seed and maps the datapoints it held again: the epoch gives the datapoints (and, ordered,
            the order) of an undisturbed run. See the Faults page.
        on_error: ``"raise"`` (the default) raises an exception of ``map_func`` here; ``"skip"`` drops the
            datapoint (as if ``map_func`` returned ``None``), counts it in ``stats()["skipped"]`` and logs
            it with the exception. A datapoint that kills every worker it meets (two deaths) is raised or
            skipped alike.

    ``nr_proc=`` (tensorpack's older name of ``num_proc=``) is accepted, deprecated.

    Example:
        >>> import numpy as np
        >>> from bridgeflow import BatchData, DataFromList, MultiProcessMapData
        >>> def square(dp):
        ...     return [np.float32(dp[0]) ** 2]
        >>> df = BatchData(MultiProcessMapData(DataFromList([[i] for i in range(8)], shuffle=False), 2, square), 4)
        >>> with df:  # doctest: +SKIP
        ...     [b[0].tolist() for b in df]
        [[0.0, 1.0, 4.0, 9.0], [16.0, 25.0, 36.0, 49.0]]
    """

    _processes = True

    @renamed_keywords(nr_proc="num_proc")
    def __init__(self, ds: DataFlow, num_proc: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, start_method: str | None = None,
                 seed: int | None = None, timeout: float | None = None, stall_warning: float | None = 60.0,
                 max_restarts: int = 0, on_error: str = "raise") -> None:
        super().__init__(ds, num_proc, map_func, buffer_size, strict, ordered, start_method=start_method,
                         seed=seed, timeout=timeout, stall_warning=stall_warning, max_restarts=max_restarts,
                         on_error=on_error)
        warn_if_oversubscribed(self.num_workers, type(self).__name__, "num_proc")


class MultiThreadMapData(_MapStage):
    """Run ``map_func`` on every datapoint of ``ds`` in ``num_thread`` threads: the thread twin of
    :class:`MultiProcessMapData`, with the same arguments (``num_thread`` for ``num_proc``, no
    ``start_method``) and the same output.

    Threads pay off when ``map_func`` releases the GIL (I/O, decoding in C, large numpy operations).
    A thread cannot be killed: a ``map_func`` that never returns keeps its thread alive after ``close()``;
    nor does it die alone, so ``max_restarts`` changes nothing here (it is taken, for the same arguments).
    ``nr_thread=`` (tensorpack's older name of ``num_thread=``) is accepted, deprecated.
    """

    _processes = False

    @renamed_keywords(nr_thread="num_thread")
    def __init__(self, ds: DataFlow, num_thread: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, seed: int | None = None,
                 timeout: float | None = None, stall_warning: float | None = 60.0, max_restarts: int = 0,
                 on_error: str = "raise") -> None:
        super().__init__(ds, num_thread, map_func, buffer_size, strict, ordered, seed=seed, timeout=timeout,
                         stall_warning=stall_warning, max_restarts=max_restarts, on_error=on_error)
