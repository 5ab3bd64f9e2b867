"""How a map stage plans a resume: from a loaded state, or from its own ledger when its carried stream goes back
(an epoch of batches left early). The functions are the stage's methods (``_MapStage._resume`` is
:func:`resume_source`), kept here so that :mod:`bridgeflow.parallel._stages` holds the stage's iteration and
this module what a resumed source is: where it is loaded, what is replayed and skipped, what is held first
(over an unordered stage), how far the saved run had read ahead (a strict stage) and what its pool had
learned (see ``_MapStage._own_state``).
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Iterator
from typing import Any

from .._state import StateError, StateMismatchError, child_state, unpack_held
from ._common import forever
from ._fused import BatchPlan
from ._transport.pool import WorkerPool

__all__ = ["HeldFirst", "close_stream", "drop_in_flight", "most_in_flight", "read_ahead", "resume_source"]

log = logging.getLogger(__name__)

_NONE = object()


class HeldFirst:
    """Datapoints a resumed stage has already (held by the state over an unordered stage, or read ahead of the
    saved position), then ``rest``'s (None: no more): those not given yet are still in flight, and a state
    taken now counts them again."""

    def __init__(self, items: list, rest: Iterator | None) -> None:
        self.items, self.rest = collections.deque(items), rest

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        if self.items:
            return self.items.popleft()
        if self.rest is None:
            raise StopIteration
        return next(self.rest)

    def left(self) -> list:
        return list(self.items)

    def close(self) -> None:
        self.items.clear()
        if self.rest is not None:
            close_stream(self.rest)


def close_stream(it: Iterator) -> None:
    """Close a carried stream: a generator; the held datapoints of an ended epoch are a plain iterator."""
    close = getattr(it, "close", None)
    if close is not None:
        close()


def drop_in_flight(self: Any, pool: WorkerPool, plan: BatchPlan | None = None) -> None:
    """Drop the work in flight (an epoch of batches was left early, or the next epoch is batched otherwise).
    An ordered stage's carried stream goes back to the oldest datapoint not received, so the dropped work
    is read again, as it is by a stage resumed from a state saved there (it went on after it, so the next
    epochs were other than a resumed run's). An unordered stage's epochs are its timing's, and its stream
    (or one that cannot go back) goes on after the dropped work. ``plan``: the fused plan of the epoch
    left, whose holder may have delivered a group in part."""
    batched, self._batched = self._batched, None
    if batched is not None:
        batched.close()
    plan = plan or batched
    ledger, size = self._ledger, self._epoch_size()
    if self._carry is not None and ledger is not None and size is not None and ledger.pulled > ledger.low \
            and self.ordered:
        try:
            if self._source_loose() is None:
                source, replay, skip = ledger.position()
                held: list = []
            else:
                source, replay, skip = child_state(self.ds), 0, sorted([s - ledger.low, n]
                                                                      for s, n in ledger.done.items())
                held = self._in_flight(ledger)
            partial, align = None, self._align
            if plan is not None and plan.ledger is ledger:
                align = (ledger.low - plan.block_base) % size
                if plan.held and plan.held[0][3]:
                    partial = [plan.held[0][0] - ledger.low, plan.held[0][3], plan.batch_size]
            if partial is None and self._partial is not None:
                partial = [self._partial[0] - ledger.low, *self._partial[1:]]
            carry, self._carry = self._carry, None
            close_stream(carry)
            self.ds.load_state_dict(source)
        except StateError:
            log.debug("%s: the source cannot go back; the dropped work is lost", type(self).__name__,
                      exc_info=True)
        else:
            self._resume(pool, {"replay": replay, "skip": skip, "partial": partial, "align": align}, size,
                         held=held)
            return
    if pool.outstanding:
        pool.discard_outstanding()
        if self._carry is not None:
            self._new_ledger()

def resume_source(self: Any, pool: WorkerPool, resume: dict, size: int | None, held: list | None = None) -> Iterator:
    """Take a loaded state: the source (loaded already) is at a snapshot; pull and discard the datapoints
    received after it; the runs received above are skipped when they come. Returns the source stream.
    Over an unordered stage the source is where the state was saved and the state holds the datapoints in
    flight (or ``held``), which come first."""
    plan, self._batched = self._batched, None
    if plan is not None:
        plan.close()
    if pool.outstanding:
        pool.discard_outstanding()
    if resume.get("costs") is not None:
        pool.assume_costs(resume["costs"])
    if held is None:
        held = unpack_held(resume["held"], gaps=True) if resume.get("held") is not None else []
    ended = bool(resume.get("ended"))
    loose = self._source_loose() is not None
    first = None
    source: Iterator
    if ended and loose:  # over an unordered stage, the source's epoch had ended: only the held are left
        source = first = HeldFirst(held, None)
    else:  # the datapoints in flight over an unordered stage come first
        source = iter(self.ds) if size is None else forever(self.ds, type(self).__name__, resumed=True)
        if held:
            source = first = HeldFirst(held, source)
    source = self._stream(source)
    if size is not None:
        if self._carry is not None:
            close_stream(self._carry)
        self._carry = source
    ledger = self._new_ledger()
    if not loose:
        ledger.snapshot()  # the loaded state, as the source gives it back
    replay = resume["replay"]
    for i in range(replay):
        try:
            next(source)
        except StopIteration:
            raise StateMismatchError(f"resuming replays {replay} datapoints of the source after its saved "
                                     f"state, but it ended after {i}") from None
    ledger.pulled = ledger.low = replay
    ahead = resume.get("ahead") or 0
    if (ahead or ended) and not loose:
        source = first = self._read_ahead(source, ahead, ended)
    self._ended, self._held_first = ended, first
    for offset, length in resume["skip"]:
        ledger.done[replay + offset] = length
        self._skips.append((replay + offset, length))
    partial = resume.get("partial")
    batch = resume.get("batch")
    if partial is None and batch is not None and batch["partial"] is not None:
        partial = [*batch["partial"], batch["size"]]
    self._partial = (replay + partial[0], partial[1], partial[2]) if partial is not None else None
    self._align = resume.get("align", batch["offset"] if batch is not None else 0)
    return source

def read_ahead(self: Any, source: Iterator, ahead: int, ended: bool) -> HeldFirst:
    """The source read as far as the saved stage had read it (``ahead`` datapoints past the saved position,
    and to its end when ``ended``), at once: a strict epoch closed before it takes them again (a
    RandomMixData, JoinData or RandomChooseData done with this flow) leaves the source where the saved
    one left it, and the source's next epoch is the same (its generators drew as much). The datapoints
    read are the work in flight, redone from a list."""
    rest = list(itertools.islice(source, ahead))
    if len(rest) < ahead:
        raise StateMismatchError(f"the state says the stage had read {ahead} datapoints past its saved "
                                 f"position, but the source ends after {len(rest)}")
    if not ended:
        return HeldFirst(rest, source)
    extra = next(source, _NONE)
    close_stream(source)
    if extra is not _NONE:
        raise StateMismatchError(f"the state says the source's epoch had ended {ahead} datapoints past its "
                                 "saved position, but the source gives more")
    return HeldFirst(rest, None)

def most_in_flight(self: Any, batch: dict | None) -> int:
    """The most source datapoints a stage can have pulled and neither received nor dropped: ``buffer_size``
    tasks in flight; with batches made in the workers (``batch``), groups of ``size`` datapoints, as many as
    the stage sends (``max(2 * num_workers, ceil(buffer_size / size))``) and fewer than ``size`` more whose
    mapped datapoints wait for a batch in the holder. An unordered stage has also pulled the runs its consumer
    received above its position (the state's ``skip``, each of one task), however many a slow task let pass."""
    if batch is None:
        return self.buffer_size + 1
    size = max(1, batch["size"])
    return (max(2 * self.num_workers, -(-self.buffer_size // size)) + size) * size
