"""A map stage's cursor, and how it plans a resume.

:class:`MapCursor` is where a map stage stands in its source's stream: the stream itself, its ledger, the
runs received before a resume, what was pulled over an unordered stage, the fused plans and a group
delivered in part. The stage owns one and hands it to the fused batching
(:class:`~bridgeflow.parallel._fused.WorkerBatching`) and to the functions here, which say what a resumed
source is, from a loaded state or from the cursor's own ledger when its carried stream goes back (an epoch
of batches left early): where it is loaded, what is replayed and skipped, what is held first (over an
unordered stage), how far the saved run had read ahead (a strict stage) and what its pool had learned (see
``_MapStage._own_state``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._state import StateError, StateMismatchError, child_state, unpack_held
from ._common import forever
from ._progress import SNAPSHOT_EVERY, SourceLedger
from ._transport.pool import WorkerPool

if TYPE_CHECKING:
    from .._base import DataFlow
    from ._fused import BatchPlan, WorkerBatching

__all__ = ["HeldFirst", "MapCursor", "close_stream", "drop_in_flight", "most_in_flight", "read_ahead",
           "resume_source"]

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


@dataclasses.dataclass(slots=True, eq=False)
class MapCursor:
    """Where a map stage stands in its source's stream (one per stage, changed in place).

    ``loose`` (an argument of some methods): the stage reads over an unordered stage, whose state holds the
    datapoints in flight, so the datapoints pulled are kept until received and the source's state is taken
    when asked, not noted as it goes.
    """

    carry: Iterator | None = None  # the endless stream of source datapoints that non-strict epochs share
    ledger: SourceLedger | None = None  # the source stream's positions (None: no stream)
    taken: int = 0  # results taken in the (unbatched) epoch in progress
    skips: collections.deque = dataclasses.field(default_factory=collections.deque)  # after an unordered
    # resume: runs received already, (first pull index, length)
    index_of: dict[int, int] = dataclasses.field(default_factory=dict)  # unordered: task id -> pull index
    pulls: collections.deque = dataclasses.field(default_factory=collections.deque)  # over an unordered
    # stage: datapoints pulled from
    pulls_from: int = 0  # this pull index on, while not received (the state holds those in flight)
    ended: bool = False  # the (strict) source's epoch ended: the stream gives no more
    held_first: HeldFirst | None = None  # after a resume over an unordered stage: the held datapoints
    partial: tuple[int, int, int] | None = None  # a fused group delivered in part before a resume (or before
    # the stream went back): (first pull index, mapped datapoints delivered, batch size)
    align: int = 0  # fused: where in an epoch of the source the next plan's first group starts
    batched: BatchPlan | None = None  # fused batching: groups in flight into the next epoch
    plan: BatchPlan | None = None  # the fused plan of the epoch in progress
    batching: WorkerBatching | None = None  # set while WorkerBatching begins an epoch of batches
    fused_size: int = 0  # fused: the batch size of the last plan (0: none)
    began_strict: bool = False  # the epoch in progress began strict (its source's length unknown then: a
    # CacheData filling knows it once filled, and the rest of that epoch stays strict)

    def new_ledger(self, ds: DataFlow, loose: bool) -> SourceLedger:
        """Positions of a new stream of the source, starting where the source is now."""
        self.skips.clear()
        self.partial = None
        self.align = 0
        self.index_of.clear()
        self.pulls.clear()
        self.pulls_from = 0
        self.ended = False
        first = self.held_first
        if first is not None and first.items:  # a resumed stream goes on without the runs received before the
            # state (its ledger is new): the held datapoints still come first, less the received ones (None)
            first.items = collections.deque(dp for dp in first.items if dp is not None)
        self.held_first = first if first is not None and first.items else None
        self.ledger = SourceLedger(ds, every=float("inf") if loose else SNAPSHOT_EVERY)
        return self.ledger

    def stream(self, source: Iterator, loose: bool) -> Iterator:
        """``source`` as the stage pulls it: over an unordered stage, each datapoint is kept until received,
        and the end of the source's epoch noted (the source's state then starts its next epoch)."""
        return self._kept(source) if loose else source

    def _kept(self, source: Iterator) -> Iterator:
        try:
            for dp in source:
                ledger, pulls = self.ledger, self.pulls
                if ledger is not None:  # let go of those received
                    while self.pulls_from < ledger.low and pulls:
                        pulls.popleft()
                        self.pulls_from += 1
                pulls.append(dp)
                yield dp
        finally:
            close_stream(source)

    def next_of(self, source: Iterator) -> Any:
        """The next datapoint of ``source``, not counted."""
        try:
            return next(source)
        except StopIteration:
            raise
        except BaseException:
            # The source raised, so its generator is finished: the next epoch must start a new pass (a
            # finished generator would raise StopIteration, or end every later epoch at once).
            if self.carry is source:
                self.carry = self.ledger = None
            raise

    def pull(self, source: Iterator) -> Any:
        """The next source datapoint, counted (and the source's state noted every so often)."""
        ledger = self.ledger
        assert ledger is not None  # a stream is pulled only while its ledger counts it (new_ledger)
        skips = self.skips
        while skips and skips[0][0] == ledger.pulled:  # received before the state was saved
            _, length = skips.popleft()
            for _ in range(length):
                self.next_of(source)
            ledger.pulled += length
        if ledger.pulled >= ledger.next_snap:
            ledger.snapshot()
        dp = self.next_of(source)
        ledger.pulled += 1
        return dp

    def took(self, pool: WorkerPool, ordered: bool) -> None:
        """Bookkeeping for one result taken from the pool (the consumer receives it, or it was dropped)."""
        self.taken += 1
        ledger = self.ledger
        assert ledger is not None  # results are taken only from a stream's epoch, which has a ledger
        if ordered:
            ledger.low += 1
        else:
            ledger.received(self.index_of.pop(pool.last_task_id), 1)

    def skipped(self, start: int) -> None:
        """A fused group received before a resume was pulled again and not sent."""
        for i, (s, _) in enumerate(self.skips):
            if s == start:
                del self.skips[i]
                return

    def in_flight(self, ledger: SourceLedger) -> list:
        """The datapoints pulled from the source and not received, by pull index from ``ledger.low`` (None
        where received already: the state's 'skip' runs)."""
        pulls, start = self.pulls, ledger.low - self.pulls_from
        items = [pulls[i] for i in range(start, min(len(pulls), ledger.pulled - self.pulls_from))]
        for s, n in ledger.done.items():
            items[s - ledger.low:s - ledger.low + n] = [None] * n
        if self.held_first is not None:  # held by the loaded state and not pulled again yet: still in flight
            items += self.held_first.left()
        return items

    def drop(self) -> None:
        """Close the carried source stream and the fused plans: the source's iteration they hold ends now (a
        dropped generator caught in a reference cycle would hold the source until a collection, and the
        source would refuse its next iteration)."""
        for plan in {id(p): p for p in (self.batched, self.plan) if p is not None}.values():
            plan.close()
        if self.held_first is not None:
            self.held_first.close()
        carry = self.carry
        self.batched = self.plan = self.carry = self.ledger = self.held_first = None
        if carry is not None:
            close_stream(carry)

    def detached(self) -> MapCursor:
        """A copy without this process's iteration (its generators and positions), for a copy of the stage."""
        return dataclasses.replace(self, carry=None, batched=None, plan=None, ledger=None, held_first=None,
                                   skips=collections.deque(), index_of={}, pulls=collections.deque())


def drop_in_flight(cursor: MapCursor, ds: DataFlow, pool: WorkerPool, plan: BatchPlan | None, *, size: int | None,
                   loose: bool, ordered: bool, name: str) -> None:
    """Drop the work in flight (an epoch of batches was left early, or the next epoch is batched otherwise).
    An ordered stage's carried stream goes back to the oldest datapoint not received, so the dropped work
    is read again, as it is by a stage resumed from a state saved there (it went on after it, so the next
    epochs were other than a resumed run's). An unordered stage's epochs are its timing's, and its stream
    (or one that cannot go back) goes on after the dropped work. ``plan``: the fused plan of the epoch
    left, whose holder may have delivered a group in part; ``size``: the stage's epoch (None: strict)."""
    batched, cursor.batched = cursor.batched, None
    if batched is not None:
        batched.close()
    plan = plan or batched
    ledger = cursor.ledger
    if cursor.carry is not None and ledger is not None and size is not None and ledger.pulled > ledger.low \
            and ordered:
        try:
            if not loose:
                source, replay, skip = ledger.position()
                held: list = []
            else:
                source, replay, skip = child_state(ds), 0, sorted([s - ledger.low, n]
                                                                 for s, n in ledger.done.items())
                held = cursor.in_flight(ledger)
            partial, align = None, cursor.align
            if plan is not None and plan.ledger is ledger:
                align = (ledger.low - plan.block_base) % size
                if plan.held and plan.held[0][3]:
                    partial = [plan.held[0][0] - ledger.low, plan.held[0][3], plan.batch_size]
            if partial is None and cursor.partial is not None:
                partial = [cursor.partial[0] - ledger.low, *cursor.partial[1:]]
            carry, cursor.carry = cursor.carry, None
            close_stream(carry)
            ds.load_state_dict(source)
        except StateError:
            log.debug("%s: the source cannot go back; the dropped work is lost", name, exc_info=True)
        else:
            resume_source(cursor, ds, pool, {"replay": replay, "skip": skip, "partial": partial, "align": align},
                          size, loose=loose, name=name, held=held)
            return
    if pool.outstanding:
        pool.discard_outstanding()
        if cursor.carry is not None:
            cursor.new_ledger(ds, loose)


def resume_source(cursor: MapCursor, ds: DataFlow, pool: WorkerPool, resume: dict, size: int | None, *,
                  loose: bool, name: str, held: list | None = None) -> Iterator:
    """Take a loaded state: the source (loaded already) is at a snapshot; pull and discard the datapoints
    received after it; the runs received above are skipped when they come. Returns the source stream.
    Over an unordered stage the source is where the state was saved and the state holds the datapoints in
    flight (or ``held``), which come first."""
    plan, cursor.batched = cursor.batched, None
    if plan is not None:
        plan.close()
    if pool.outstanding:
        pool.discard_outstanding()
    if resume.get("costs") is not None:
        pool.assume_costs(resume["costs"])
    if held is None:
        held = unpack_held(resume["held"], gaps=True) if resume.get("held") is not None else []
    ended = bool(resume.get("ended"))
    first = None
    source: Iterator
    if ended and loose:  # over an unordered stage, the source's epoch had ended: only the held are left
        source = first = HeldFirst(held, None)
    else:  # the datapoints in flight over an unordered stage come first
        source = iter(ds) if size is None else forever(ds, name, resumed=True)
        if held:
            source = first = HeldFirst(held, source)
    source = cursor.stream(source, loose)
    if size is not None:
        if cursor.carry is not None:
            close_stream(cursor.carry)
        cursor.carry = source
    ledger = cursor.new_ledger(ds, loose)
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
        source = first = read_ahead(source, ahead, ended)
    cursor.ended, cursor.held_first = ended, first
    for offset, length in resume["skip"]:
        ledger.done[replay + offset] = length
        cursor.skips.append((replay + offset, length))
    partial = resume.get("partial")
    batch = resume.get("batch")
    if partial is None and batch is not None and batch["partial"] is not None:
        partial = [*batch["partial"], batch["size"]]
    cursor.partial = (replay + partial[0], partial[1], partial[2]) if partial is not None else None
    cursor.align = resume.get("align", batch["offset"] if batch is not None else 0)
    return source


def read_ahead(source: Iterator, ahead: int, ended: bool) -> HeldFirst:
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


def most_in_flight(batch: dict | None, buffer_size: int, num_workers: int) -> int:
    """The most source datapoints a stage can have pulled and neither received nor dropped: ``buffer_size``
    tasks in flight; with batches made in the workers (``batch``), groups of ``size`` datapoints, as many as
    the stage sends (``max(2 * num_workers, ceil(buffer_size / size))``) and fewer than ``size`` more whose
    mapped datapoints wait for a batch in the holder. An unordered stage has also pulled the runs its consumer
    received above its position (the state's ``skip``, each of one task), however many a slow task let pass."""
    if batch is None:
        return buffer_size + 1
    size = max(1, batch["size"])
    return (max(2 * num_workers, -(-buffer_size // size)) + size) * size
