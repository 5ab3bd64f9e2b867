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
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..batch import batch_datapoints
from ..proxy import ProxyDataFlow
from ..state import StateMismatchError
from .pool import WorkerPool
from .progress import SourceLedger

__all__ = ["EPOCH_END", "BatchPlan", "BatchTask", "Stacked", "WorkerBatching", "batch_bytes", "unstack"]

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
        while not self.exhausted and pool.outstanding < in_flight and self.ends < 2:
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

    def __init__(self, stage: Any, batch_size: int, remainder: bool, use_list: Any, pad_value: Any) -> None:
        super().__init__(stage)
        self.batch_size, self.remainder, self.use_list, self.pad_value = batch_size, remainder, use_list, pad_value

    def __len__(self) -> int:
        n = len(self.ds)
        return -(-n // self.batch_size) if self.remainder else n // self.batch_size

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        stage = self.ds
        stage._batching = self
        try:
            return iter(stage)
        finally:
            stage._batching = None

    def stage_epoch(self, pool: WorkerPool, resume: dict | None) -> Iterator:
        """The stage's epoch of batches, from ``resume`` (the stage's loaded state) or where it stands."""
        stage = self.ds
        batch_size, use_list, pad_value = self.batch_size, self.use_list, self.pad_value
        size = stage._epoch_size()
        plan = stage._batched
        stage._batched = None  # this epoch owns the groups in flight until it completes
        if stage._plan is not None and stage._plan is not plan:  # an epoch left before it began: let its source go
            stage._plan.close()
        if resume is not None:
            if plan is not None:
                plan.close()
            plan = self._resumed_plan(stage, pool, resume, size)
        elif plan is None or not plan.continues(pool, batch_size, size, use_list, pad_value):
            if plan is not None:
                plan.close()
            if plan is not None or pool.outstanding:  # left by an unbatched iteration (or another batch size)
                stage._drop_in_flight(pool, plan)
            source = stage._carried() if size is not None else stage._stream(iter(stage.ds))
            if size is None:
                stage._new_ledger()
            plan = BatchPlan(pool, batch_size, size, use_list, pad_value, stage._ledger)
            # after a resume or the stream went back: groups start where they did (so those received before,
            # skipped, are whole groups), and those received are not sent again
            offset = stage._align if size is not None else 0
            plan.block_base = plan.ledger.pulled - offset
            plan.skip_starts = {start for start, _ in stage._skips}
            plan.groups, plan.source = self._groups(stage, plan, source, offset, None), source
        else:
            plan.taken = 0
        stage._plan = plan
        stage._fused_size = plan.batch_size
        return self._batches(stage, pool, plan)

    def _resumed_plan(self, stage: Any, pool: WorkerPool, resume: dict, size: int | None) -> BatchPlan:
        batch_size, use_list, pad_value = self.batch_size, self.use_list, self.pad_value
        fused = resume["batch"]
        if fused is None and not resume["taken"]:  # between epochs of unbatched ones (or after going back)
            fused = {"size": batch_size, "offset": 0, "held": 0, "partial": None}
        if fused is None or fused["size"] != batch_size:
            saved = "without a BatchData" if fused is None else f"under BatchData({fused['size']})"
            raise StateMismatchError(f"the state was saved {saved}, this stage is iterated by "
                                     f"BatchData({batch_size})", [type(stage).__name__])
        source = stage._resume(pool, resume, size)
        ledger = stage._ledger
        plan = BatchPlan(pool, batch_size, size, use_list, pad_value, ledger)
        plan.block_base = ledger.pulled - fused["offset"]
        plan.skip_starts = {start for start, _ in stage._skips}
        plan.taken = max(0, resume["taken"] - fused["held"])  # the held groups are taken again
        quota = None
        if size is not None:
            quota = -(-size // batch_size) - resume["taken"] + fused["held"]
        plan.groups, plan.source = self._groups(stage, plan, source, fused["offset"], quota), source
        return plan

    def _batches(self, stage: Any, pool: WorkerPool, plan: BatchPlan) -> Iterator:
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
                if stage._partial is not None and stage._partial[0] == start:  # delivered in part before a resume
                    delivered = stage._partial[1]
                    stage._partial = None
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
                stage._batched = plan  # the next epoch takes over the groups already in flight
            else:
                plan.close()
                if stage._pool is pool and stage._ledger is ledger:
                    if plan.size is None:  # a strict epoch is over: the source's own state says where it is
                        if pool.outstanding:
                            pool.discard_outstanding()
                        stage._ledger = None
                    else:
                        stage._drop_in_flight(pool, plan)

    def _groups(self, stage: Any, plan: BatchPlan, source: Iterator, offset: int, quota: int | None) -> Iterator:
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
                    if start in skip:
                        stage._skipped(start)
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
        while True:
            if sent >= quota:
                yield EPOCH_END
                sent, quota = 0, per_epoch
                continue
            for at in range(offset, size, batch_size):
                if ledger.pulled >= ledger.next_snap:
                    ledger.snapshot()
                start = ledger.pulled
                group = [stage._next(source) for _ in range(min(batch_size, size - at))]
                ledger.pulled += len(group)
                if start in skip:
                    skip.discard(start)
                    stage._skipped(start)
                    continue
                yield start, group
                sent += 1
                if sent >= quota:
                    yield EPOCH_END
                    sent, quota = 0, per_epoch
            offset = 0

