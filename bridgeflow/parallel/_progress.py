"""What a parallel stage's consumer has received, in positions of the stage's source: its state.

A map stage reads its source ahead of the consumer (the datapoints in flight), so the source's own
state is too far along: the stage's state is the source's state at the *oldest datapoint the consumer
has not received*. Taking the source's state for every datapoint would cost too much (a map stage runs
~100k datapoints/s), so :class:`SourceLedger` takes it every ``every`` pulls and counts: the state it
gives is the latest such snapshot at or before that datapoint plus how many datapoints to pull and
discard (not map) after it, at most ``every`` plus those in flight. Unordered stages also record which
datapoints above that point were received already, so a resume skips them: every datapoint not received
comes exactly once.

Runners (every worker iterates its own copy of a flow) keep the same bookkeeping per worker, with the
snapshots taken in the worker and sent along with its results (:class:`WorkerLedger`).
"""

from __future__ import annotations

import collections
from typing import Any

from .._state import NotResumableError, StateError, StateMismatchError, child_state
from .._state_schema import Count

__all__ = ["SNAPSHOT_EVERY", "SourceLedger", "WorkerLedger", "WorkerSnapshot", "check_runs", "check_source_position"]

SNAPSHOT_EVERY = 64  # source pulls between two snapshots of its state: at most this many replayed on resume
_NEVER = float("inf")


class SourceLedger:
    """Pull indices of one stream of a stage's source (since the ledger began) and what was received.

    ``pulled``: datapoints pulled so far; ``low``: the oldest one not received; ``done``: runs above
    ``low`` received already (``start -> length``; unordered stages and fused batches). The stage calls
    :meth:`snapshot` when ``pulled >= next_snap``, before pulling.
    """

    __slots__ = ("done", "error", "every", "low", "next_snap", "pulled", "snaps", "source")

    def __init__(self, source: Any, every: float = SNAPSHOT_EVERY) -> None:
        self.source = source
        self.every = every
        self.snaps: collections.deque = collections.deque()  # (pull index, source state), oldest first
        self.pulled = 0
        self.low = 0
        self.done: dict[int, int] = {}
        self.next_snap: float = 0  # _NEVER (inf) once the source cannot give its state
        self.error: StateError | None = None

    def snapshot(self) -> None:
        """Record the source's state at pull index ``pulled`` (the source between two datapoints)."""
        if self.error is None:
            try:
                state = child_state(self.source)
            except StateError as exc:  # raised when a state is asked for; iterating goes on
                self.error = exc
                self.next_snap = _NEVER
                return
            self._prune()
            self.snaps.append((self.pulled, state))
        self.next_snap = self.pulled + self.every

    def _prune(self) -> None:
        snaps, low = self.snaps, self.low
        while len(snaps) > 1 and snaps[1][0] <= low:
            snaps.popleft()

    def received(self, start: int, length: int) -> None:
        """The consumer has received (or the stage dropped on purpose) pulls ``start:start + length``."""
        if start == self.low:
            low = start + length
            done = self.done
            while low in done:
                low += done.pop(low)
            self.low = low
        else:
            self.done[start] = length

    def position(self) -> tuple[dict, int, list[list[int]]]:
        """``(source state, datapoints to replay after it, received runs above as [offset, length])``:
        restoring the state and pulling that many datapoints puts the source at the oldest datapoint not
        received; the runs after it are to be pulled and skipped."""
        if self.error is not None:
            raise type(self.error)(self.error.reason, self.error.path)
        if not self.snaps:  # nothing pulled yet: the source is where the stream begins
            self.snapshot()
            if self.error is not None:
                raise type(self.error)(self.error.reason, self.error.path)
        self._prune()
        at, state = self.snaps[0]
        low = self.low
        return state, low - at, sorted([s - low, n] for s, n in self.done.items())


def check_runs(flow: Any, skip: list) -> None:
    """A state's ``skip`` field: ``[offset, length]`` runs of counts."""
    for run in skip:
        if not (isinstance(run, list) and len(run) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in run)):
            raise StateMismatchError(f"damaged 'skip' entry {run!r} in the state")


def check_source_position(state: dict, most: int | None = None, why: str = "") -> None:
    """The ``replay`` and ``skip`` fields of a stage's state (checked for type already) within ``most``, the
    datapoints a resume may pull before the first new one (``replay``, and the end of every skipped run)."""
    replay = state["replay"]
    Count("replay", most, why).check(None, replay)
    for run in state["skip"]:
        if most is not None and replay + run[0] + run[1] > most:
            raise StateMismatchError(f"the 'skip' entry {run!r} of the state ends past {most} datapoints after "
                                     f"the saved position, the most this flow can save: {why}")


class WorkerSnapshot:
    """A datapoint from a runner's worker, with the state its copy of the flow had just before making it
    (``state``), or why it has none (``error``); ``count`` is the datapoint's index in that worker."""

    __slots__ = ("count", "dp", "error", "state")

    def __init__(self, dp: Any, count: int, state: dict | None, error: str | None) -> None:
        self.dp, self.count, self.state, self.error = dp, count, state, error

    def __reduce__(self) -> tuple:
        return WorkerSnapshot, (self.dp, self.count, self.state, self.error)


class WorkerLedger:
    """Per worker of a runner: the states its copy reported and how many of its datapoints were received."""

    def __init__(self, starts: list[tuple[dict | None, int]]) -> None:
        # per worker: snapshots (count, state, replay after it), oldest first; received count
        self.snaps = [collections.deque([(0, state, replay)]) for state, replay in starts]
        self.received = [0] * len(starts)
        self.error: str | None = None

    def record(self, worker: int, snap: WorkerSnapshot) -> None:
        if snap.error is not None:
            self.error = self.error or snap.error
            return
        snaps, got = self.snaps[worker], self.received[worker]
        while len(snaps) > 1 and snaps[1][0] <= got:
            snaps.popleft()
        snaps.append((snap.count, snap.state, 0))

    def position(self, worker: int, count: int) -> dict | None:
        """Where ``worker``'s copy is after its first ``count`` datapoints (a restarted worker starts there and
        numbers on from ``count``), or None when it cannot say."""
        if self.error is not None:
            return None
        at, state, replay = self.snaps[worker][-1]  # the latest state it reported at or before count
        return {"state": state, "replay": replay + count - at, "count": count}

    def positions(self) -> list[dict]:
        if self.error is not None:
            raise NotResumableError(f"a worker's copy of the flow cannot save its position: {self.error}")
        out = []
        for snaps, got in zip(self.snaps, self.received):
            while len(snaps) > 1 and snaps[1][0] <= got:
                snaps.popleft()
            count, state, replay = snaps[0]
            out.append({"state": state, "replay": replay + got - count})
        return out
