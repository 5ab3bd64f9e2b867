"""Fused batching: ``BatchData`` over a map stage reads :class:`WorkerBatching`, which sends groups of
source datapoints to the stage's workers; they map them and stack each batch straight into shared memory.

The batches are the ones ``BatchData`` would make in the consumer, copied once instead of twice.
:class:`BatchPlan` is the consumer's side of it: the groups sent (one epoch ahead at most), which epoch
each result belongs to, and, for the stage's state, which source datapoints the consumer has received.
A group whose ``map_func`` dropped a datapoint comes back as a list and goes through a holder, where
its datapoints may be split across two batches: the plan knows how many of each group were delivered.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .._batch import _batch_component, batch_datapoints
from .._proxy import ProxyDataFlow
from .._state import StateMismatchError
from ._progress import SourceLedger
from ._transport.pool import WorkerPool

if TYPE_CHECKING:
    from ._resume_plan import MapCursor
    from ._stages import _MapStage

__all__ = ["EPOCH_END", "BatchPlan", "BatchTask", "Stacked", "WorkerBatching", "batch_bytes", "map_group", "unstack"]

EPOCH_END = object()


class BatchTask:
    """A group of source datapoints that a worker maps and, if none is dropped, stacks into one batch."""

    __slots__ = ("items", "pad_value", "size", "use_list")

    def __init__(self, items: list, size: int, use_list: Any, pad_value: Any) -> None:
        self.items, self.size, self.use_list, self.pad_value = items, size, use_list, pad_value

    def __reduce__(self) -> tuple:
        return BatchTask, (self.items, self.size, self.use_list, self.pad_value)


class Stacked:
    """A batch stacked in a worker (as opposed to a list of mapped datapoints)."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __reduce__(self) -> tuple:
        return Stacked, (self.batch,)


def batch_bytes(dps: list) -> int:
    """Bytes the stacked arrays of a batch will take, judged from its first datapoint."""
    first = dps[0]
    values = first.values() if isinstance(first, dict) else first
    return sum(v.nbytes for v in values if isinstance(v, np.ndarray)) * len(dps)


def map_group(task: BatchTask, map_one: Callable[[Any], Any], reserve: Callable[[int], Any] | None) -> Any:
    """A worker's side of a :class:`BatchTask`: map its datapoints and return the batch as :class:`Stacked`,
    or the list of mapped datapoints when ``map_one`` dropped one (returned ``None``).

    Each array is copied into its row of the batch as soon as it is mapped, and dropped: the worker holds
    one datapoint at a time, not a batch of them. Holding a batch of fresh arrays and freeing them
    together after the stack lets glibc's malloc give the heap back to the system after every batch (its
    trim threshold follows the largest block it has *unmapped*, and a worker that stacks into shared memory
    never frees one as large as a batch, unlike a consumer that stacks into ``malloc``'d memory), and the
    next batch faults every page back in: 37 page faults per 150 KB sample, 3x slower on 2 cores. A copy
    made while the array is still in the CPU's cache is also cheaper than one a batch later.
    ``reserve(nbytes)`` (process workers) returns an allocator carving arrays out of shared memory.
    Anything the rows cannot take (a datapoint of another structure, shape or dtype) goes the general
    way, :func:`~bridgeflow._batch.batch_datapoints` over the whole group, with the same result and errors.
    """
    items, size = task.items, task.size
    it = iter(items)
    first = map_one(next(it)) if items else None
    mapped = [] if first is None else [first]
    rows = _Rows.start(first, size, task.use_list, reserve) if first is not None and len(items) == size else None
    if rows is not None:
        for dp in it:
            out = map_one(dp)
            if out is None or not rows.add(out):
                mapped = rows.datapoints()  # views of the rows filled so far: no copy
                if out is not None:
                    mapped.append(out)
                rows = None
                break
    if rows is not None:
        return Stacked(rows.finish(task.pad_value))
    for dp in it:
        out = map_one(dp)
        if out is not None:
            mapped.append(out)
    if len(mapped) != size:
        return mapped
    alloc = None if reserve is None else reserve(batch_bytes(mapped) + 4096)
    return Stacked(batch_datapoints(mapped, task.use_list, task.pad_value, alloc))


class _Rows:
    """A batch being filled datapoint by datapoint: the arrays of each component go into their row of a
    stacked array at once, the other components (numbers, strings, lists) are kept for the end."""

    __slots__ = ("arrays", "as_dict", "count", "keys", "kinds", "length", "others", "use_list")

    def __init__(self, first: Any, size: int, use_list: Any, alloc: Any) -> None:
        self.as_dict = isinstance(first, dict)
        self.kinds = type(first)
        self.keys = list(first) if self.as_dict else range(len(first))
        self.length = len(first)
        self.use_list = use_list
        self.arrays: dict = {}  # key -> the stacked array its rows go into
        self.others: dict = {}  # key -> the values of a component batched at the end
        for k in self.keys:
            v = first[k]
            listed = use_list is True or (bool(use_list) and k in use_list)
            if type(v) is np.ndarray and not listed and not v.dtype.hasobject:
                out = alloc((size, *v.shape), v.dtype) if alloc is not None else np.empty((size, *v.shape), v.dtype)
                out[0] = v
                self.arrays[k] = out
            else:
                self.others[k] = [v]
        self.count = 1

    @classmethod
    def start(cls, first: Any, size: int, use_list: Any, reserve: Callable[[int], Any] | None) -> _Rows | None:
        if type(first) not in (list, tuple, dict):
            return None
        alloc = None if reserve is None else reserve(batch_bytes([first]) * size + 4096)
        return cls(first, size, use_list, alloc)

    def add(self, dp: Any) -> bool:
        """Put ``dp`` in the next row; False (and nothing written) when it does not fit the rows."""
        if type(dp) is not self.kinds or len(dp) != self.length:
            return False
        i = self.count
        if self.as_dict:
            try:
                values = {k: dp[k] for k in self.keys}
            except KeyError:
                return False
        else:
            values = dp
        for k, out in self.arrays.items():
            v = values[k]
            if type(v) is not np.ndarray or v.shape != out.shape[1:] or v.dtype != out.dtype:
                return False
        for k, out in self.arrays.items():
            out[i] = values[k]
        for k, col in self.others.items():
            col.append(values[k])
        self.count = i + 1
        return True

    def datapoints(self) -> list:
        """The datapoints added so far, their arrays as views of the rows."""
        out: list = []
        for i in range(self.count):
            values = {k: a[i, ...] for k, a in self.arrays.items()}  # arrays, 0-d ones too
            values.update((k, col[i]) for k, col in self.others.items())
            if self.as_dict:
                out.append({k: values[k] for k in self.keys})
            else:
                dp = [values[k] for k in self.keys]
                out.append(tuple(dp) if self.kinds is tuple else dp)
        return out

    def finish(self, pad_value: Any) -> Any:
        """The batch, as :func:`~bridgeflow._batch.batch_datapoints` makes it of the same datapoints."""
        use_list = self.use_list
        batched = {}
        for k in self.keys:
            if k in self.arrays:
                batched[k] = self.arrays[k]
            elif use_list is True or (bool(use_list) and k in use_list):
                batched[k] = self.others[k]
            else:
                batched[k] = _batch_component(self.others[k], repr(k) if self.as_dict else str(k), pad_value)
        if self.as_dict:
            return batched
        out = [batched[k] for k in self.keys]
        return tuple(out) if self.kinds is tuple else out


def unstack(batch: Any) -> list:
    if isinstance(batch, dict):
        n = len(next(iter(batch.values())))
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]
    n = len(batch[0])
    return [[c[i] for c in batch] for i in range(n)]


class BatchPlan:
    """The groups sent to the workers for fused batching, and how many are in flight per epoch.

    ``groups`` yields ``(first pull index, datapoints)`` per group and :data:`EPOCH_END` where an epoch
    ends. ``pending`` holds ``True`` per group sent (in order) and ``None`` where an epoch ends, so an
    epoch knows how many results are its own even when groups of the next one are in flight already.

    For the state: ``tasks`` maps a task id to its group's ``(first pull index, length)``; ``held`` lists
    the groups whose mapped datapoints wait in the holder, as ``[first pull index, length, mapped,
    delivered]``; ``taken`` counts the results taken this epoch; ``block_base`` is a pull index where an
    epoch's groups begin (groups are aligned on epochs of the source's length).
    """

    def __init__(self, pool: WorkerPool, batch_size: int, size: int | None, use_list: Any, pad_value: Any,
                 ledger: SourceLedger) -> None:
        self.pool, self.batch_size, self.size = pool, batch_size, size
        self.use_list, self.pad_value = use_list, pad_value
        self.ledger = ledger
        self.groups: Iterator = iter(())
        self.source: Any = None  # the source stream the groups are read from
        self.pending: collections.deque = collections.deque()
        self.ends = 0  # epoch ends in pending: groups are planned at most one epoch ahead
        self.exhausted = False
        self.tasks: dict[int, tuple[int, int]] = {}
        self.held: collections.deque = collections.deque()
        self.taken = 0
        self.block_base = ledger.pulled
        self.skip_starts: set[int] = set()  # after a resume: groups received already, pulled and not sent

    def continues(self, pool: WorkerPool, batch_size: int, size: int | None, use_list: Any, pad_value: Any) -> bool:
        return (pool is self.pool and batch_size == self.batch_size and size == self.size
                and use_list is self.use_list and pad_value is self.pad_value)

    def next_result(self, in_flight: int) -> bool:
        """Send groups until ``in_flight`` are out; True while this epoch has a result still to get."""
        pool = self.pool
        while not self.exhausted and pool.outstanding < in_flight and self.ends < 2 and not pool.saturated:
            group = next(self.groups, None)
            if group is None:  # a strict epoch's groups are all sent
                self.exhausted = True
            elif group is EPOCH_END:
                self.pending.append(None)
                self.ends += 1
            else:
                start, items = group
                task = pool.put(BatchTask(items, self.batch_size, self.use_list, self.pad_value), flush=True)
                self.tasks[task] = (start, len(items))
                self.pending.append(True)
        if not self.pending:
            return False
        if self.pending.popleft() is None:
            self.ends -= 1
            return False
        return True

    def hold(self, start: int, length: int, mapped: int, delivered: int = 0) -> None:
        """A group's mapped datapoints (less ``delivered`` of them) went into the holder."""
        if mapped - delivered <= 0:
            self.ledger.received(start, length)
        else:
            self.held.append([start, length, mapped, delivered])

    def deliver(self, count: int) -> None:
        """``count`` datapoints left the holder, oldest first (in a batch, or dropped at an epoch's end)."""
        held, ledger = self.held, self.ledger
        while count > 0 and held:
            group = held[0]
            left = group[2] - group[3]
            if left <= count:
                count -= left
                held.popleft()
                ledger.received(group[0], group[1])
            else:
                group[3] += count
                count = 0

    def state(self, taken: int, pending: tuple[int, int] | None) -> dict:
        """The fused part of the stage's state (see ``_MapStage._own_state``); ``pending``: a group delivered
        in part before a resume, not come back yet."""
        low = self.ledger.low
        offset = (low - self.block_base) % self.size if self.size else 0
        partial = None
        if self.held and self.held[0][3]:
            partial = [self.held[0][0] - low, self.held[0][3]]
        elif pending is not None:
            partial = [pending[0] - low, pending[1]]
        return {"size": self.batch_size, "offset": offset, "held": len(self.held), "partial": partial,
                "taken": taken}

    def close(self) -> None:
        """End the groups, and a strict epoch's iteration of the source (whose generator may not have begun,
        so its own ``finally`` would not run)."""
        close = getattr(self.groups, "close", None)
        if close is not None:
            close()
        if self.size is None:
            close = getattr(self.source, "close", None)
            if close is not None:
                close()


class WorkerBatching(ProxyDataFlow):
    """A map stage's datapoints in batches that its workers stack: what ``BatchData(stage, ...)`` reads.

    ``BatchData`` builds it (with the stage's ``batched()``) and iterates it; it shows in the pipeline's
    paths (``BatchData/WorkerBatching/MultiProcessMapData``) and yields exactly what ``BatchData`` would
    make over the stage. A group in which ``map_func`` dropped a datapoint comes back unstacked and is
    re-batched here. Like the unbatched stage, a non-strict one keeps the workers busy across epochs: the
    groups of the next epoch are already in flight when this one ends, so no worker waits for another's
    last batch.

    An epoch is the stage's own (its liveness, its consumer guard, the state it took): this flow begins
    one by iterating the stage with itself attached, and the stage hands the epoch back to
    :meth:`stage_epoch`. Its position is part of the stage's state, which ``BatchData`` saves.
    """

    ds: _MapStage

    def __init__(self, stage: _MapStage, batch_size: int, remainder: bool, use_list: Any, pad_value: Any) -> None:
        super().__init__(stage)
        self.batch_size, self.remainder, self.use_list, self.pad_value = batch_size, remainder, use_list, pad_value

    def __len__(self) -> int:
        n = len(self.ds)
        return -(-n // self.batch_size) if self.remainder else n // self.batch_size

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        stage = self.ds
        cursor = stage._cursor
        cursor.batching = self
        try:
            return iter(stage)
        finally:
            cursor.batching = None

    def stage_epoch(self, cursor: MapCursor, pool: WorkerPool, resume: dict | None, size: int | None) -> Iterator:
        """The stage's epoch of batches, from ``resume`` (the stage's loaded state) or where ``cursor`` stands;
        ``size``: the stage's epoch (None: strict)."""
        stage = self.ds
        batch_size, use_list, pad_value = self.batch_size, self.use_list, self.pad_value
        cursor.began_strict = size is None
        plan = cursor.batched
        cursor.batched = None  # this epoch owns the groups in flight until it completes
        if cursor.plan is not None and cursor.plan is not plan:  # an epoch left before it began: let its source go
            cursor.plan.close()
        if resume is not None:
            if plan is not None:
                plan.close()
            plan = self._resumed_plan(cursor, pool, resume, size)
        elif plan is None or not plan.continues(pool, batch_size, size, use_list, pad_value):
            if plan is not None:
                plan.close()
            if plan is not None or pool.outstanding:  # left by an unbatched iteration (or another batch size)
                stage._drop_in_flight(pool, plan)
            source = stage._source_stream(size)
            ledger = cursor.ledger
            assert ledger is not None  # the stream's: _source_stream() made it
            plan = BatchPlan(pool, batch_size, size, use_list, pad_value, ledger)
            # after a resume or the stream went back: groups start where they did (so those received before,
            # skipped, are whole groups), and those received are not sent again
            offset = cursor.align if size is not None else 0
            plan.block_base = plan.ledger.pulled - offset
            plan.skip_starts = {start for start, _ in cursor.skips}
            plan.groups, plan.source = self._groups(cursor, plan, source, offset, None), source
        else:
            plan.taken = 0
        cursor.plan = plan
        cursor.fused_size = plan.batch_size
        return self._batches(cursor, pool, plan)

    def _resumed_plan(self, cursor: MapCursor, pool: WorkerPool, resume: dict, size: int | None) -> BatchPlan:
        batch_size, use_list, pad_value = self.batch_size, self.use_list, self.pad_value
        fused = resume["batch"]
        if fused is None and not resume["taken"]:  # between epochs of unbatched ones (or after going back)
            fused = {"size": batch_size, "offset": 0, "held": 0, "partial": None}
        if fused is None or fused["size"] != batch_size:
            saved = "without a BatchData" if fused is None else f"under BatchData({fused['size']})"
            raise StateMismatchError(f"the state was saved {saved}, this stage is iterated by "
                                     f"BatchData({batch_size})", [type(self.ds).__name__])
        source = self.ds._resume(pool, resume, size)
        ledger = cursor.ledger
        assert ledger is not None  # the resumed stream's: _resume() made it
        plan = BatchPlan(pool, batch_size, size, use_list, pad_value, ledger)
        plan.block_base = ledger.pulled - fused["offset"]
        plan.skip_starts = {start for start, _ in cursor.skips}
        plan.taken = max(0, resume["taken"] - fused["held"])  # the held groups are taken again
        quota = None
        if size is not None:
            quota = -(-size // batch_size) - resume["taken"] + fused["held"]
        plan.groups, plan.source = self._groups(cursor, plan, source, fused["offset"], quota), source
        return plan

    def _batches(self, cursor: MapCursor, pool: WorkerPool, plan: BatchPlan) -> Iterator:
        stage = self.ds
        remainder = self.remainder
        batch_size, use_list, pad_value = plan.batch_size, plan.use_list, plan.pad_value
        ledger = plan.ledger
        in_flight = max(2 * stage.num_workers, -(-stage.buffer_size // batch_size))
        holder: list = []
        complete = False
        try:
            while plan.next_result(in_flight):
                out = stage._get(pool)
                start, length = plan.tasks.pop(pool.last_task_id)
                plan.taken += 1
                delivered = 0
                if cursor.partial is not None and cursor.partial[0] == start:  # delivered in part before a resume
                    delivered = cursor.partial[1]
                    cursor.partial = None
                if type(out) is Stacked and not holder and not delivered:
                    ledger.received(start, length)
                    stage._stats.datapoints += batch_size
                    yield out.batch
                    continue
                items = unstack(out.batch) if type(out) is Stacked else out
                plan.hold(start, length, len(items), delivered)
                holder.extend(items[delivered:])
                while len(holder) >= batch_size:
                    plan.deliver(batch_size)
                    stage._stats.datapoints += batch_size
                    yield batch_datapoints(holder[:batch_size], use_list, pad_value)
                    del holder[:batch_size]
            if remainder and holder:
                plan.deliver(len(holder))
                stage._stats.datapoints += len(holder)
                yield batch_datapoints(holder, use_list, pad_value)
            plan.deliver(len(holder))  # what is left of an epoch is dropped, as BatchData drops it
            holder.clear()
            complete = True
        finally:
            if complete and plan.size is not None and stage._pool is pool:
                cursor.batched = plan  # the next epoch takes over the groups already in flight
            else:
                plan.close()
                if stage._pool is pool and cursor.ledger is ledger:
                    if plan.size is None:  # a strict epoch is over: the source's own state says where it is
                        if pool.outstanding:
                            pool.discard_outstanding()
                        cursor.ledger = None
                    else:
                        stage._drop_in_flight(pool, plan)

    def _groups(self, cursor: MapCursor, plan: BatchPlan, source: Iterator, offset: int,
                quota: int | None) -> Iterator:
        """The groups of source datapoints to map and stack, ``(first pull index, datapoints)`` each, and
        :data:`EPOCH_END` after each epoch's: one epoch of ``source`` when strict; else epochs of ``size``
        datapoints of the carried stream (the first ``quota`` groups after a resume), forever. Groups start
        ``offset`` datapoints into an epoch of the source; groups received before a resume are skipped."""
        ledger, batch_size, size, skip = plan.ledger, plan.batch_size, plan.size, plan.skip_starts
        if size is None:
            try:
                while True:
                    if ledger.pulled >= ledger.next_snap:
                        ledger.snapshot()
                    start = ledger.pulled
                    group = list(itertools.islice(source, batch_size))
                    ledger.pulled += len(group)
                    if len(group) < batch_size:  # the source's epoch ended (a state says so from now on)
                        cursor.ended = True
                    if start in skip:
                        cursor.skipped(start)
                    elif group:
                        yield start, group
                    if len(group) < batch_size:
                        break
            finally:
                if hasattr(source, "close"):
                    source.close()
            yield EPOCH_END
            return
        per_epoch = -(-size // batch_size)
        quota = per_epoch if quota is None else quota
        sent = 0
        next_of = cursor.next_of
        while True:
            if sent >= quota:
                yield EPOCH_END
                sent, quota = 0, per_epoch
                continue
            for at in range(offset, size, batch_size):
                if ledger.pulled >= ledger.next_snap:
                    ledger.snapshot()
                start = ledger.pulled
                group = [next_of(source) for _ in range(min(batch_size, size - at))]
                ledger.pulled += len(group)
                if start in skip:
                    skip.discard(start)
                    cursor.skipped(start)
                    continue
                yield start, group
                sent += 1
                if sent >= quota:
                    yield EPOCH_END
                    sent, quota = 0, per_epoch
            offset = 0
