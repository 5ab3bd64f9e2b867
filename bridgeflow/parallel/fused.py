"""Fused batching: ``BatchData`` over a map stage sends groups of source datapoints to the workers, which
map them and stack the batch straight into shared memory (see ``_MapStage.iter_batched``).

:class:`BatchPlan` is the consumer's side of it: the groups sent (one epoch ahead at most), which epoch
each result belongs to, and, for the stage's state, which source datapoints the consumer has received.
A group whose ``map_func`` dropped a datapoint comes back as a list and goes through a holder, where
its datapoints may be split across two batches: the plan knows how many of each group were delivered.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import numpy as np

from .pool import WorkerPool
from .progress import SourceLedger

__all__ = ["EPOCH_END", "BatchPlan", "BatchTask", "Stacked", "batch_bytes", "unstack"]

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
        self.pending: collections.deque = collections.deque()
        self.ends = 0  # epoch ends in pending: groups are planned at most one epoch ahead
        self.exhausted = False
        self.tasks: dict[int, tuple[int, int]] = {}
        self.held: collections.deque = collections.deque()
        self.taken = 0
        self.block_base = ledger.pulled
        self.skip_starts: set[int] = set()  # after a resume: groups received already, pulled and not sent
        self.partial: tuple[int, int] | None = None  # after a resume: (group, mapped datapoints delivered)

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

    def state(self, taken: int) -> dict:
        """The fused part of the stage's state (see ``_MapStage.state_dict``)."""
        low = self.ledger.low
        offset = (low - self.block_base) % self.size if self.size else 0
        partial = None
        if self.held and self.held[0][3]:
            partial = [self.held[0][0] - low, self.held[0][3]]
        return {"size": self.batch_size, "offset": offset, "held": len(self.held), "partial": partial,
                "taken": taken}

    def close(self) -> None:
        close = getattr(self.groups, "close", None)
        if close is not None:
            close()
