"""A map stage's faults: a datapoint its ``map_func`` fails on (``on_error``), and one that kills its workers.

``on_error="skip"`` runs ``map_func`` under a guard in the workers (:func:`guarded`): a datapoint it raises an
``Exception`` on is dropped, as when ``map_func`` returns ``None`` (so a fused batch is refilled from the next
datapoints, exactly as ``BatchData`` over the stage refills it, with threads or processes alike), and the
result carries a record of it (:class:`Skipped`), which the consumer counts in ``stats()["skipped"]`` and
logs with the datapoint and the exception (:meth:`SkipLog.note`). A skipped datapoint counts as received
in the stage's state, so a resumed epoch never reads it again. ``"raise"`` (the default) raises the error in
the consumer, as before.

A datapoint that kills every worker it meets (see :mod:`~bridgeflow.parallel._transport.supervision`) falls
under the same policy: :class:`MapFaults` names it for the error, or answers it as skipped.
"""

from __future__ import annotations

import logging
import reprlib
import weakref
from collections.abc import Callable
from typing import Any

from ._fused import BatchTask, map_group
from ._transport.supervision import FaultPolicy

__all__ = ["ON_ERROR", "MapFaults", "SkipLog", "Skipped", "check_on_error", "guarded", "map_task", "short_repr"]

log = logging.getLogger("bridgeflow.parallel._stages")

ON_ERROR = ("raise", "skip")
_LOGGED = 20  # skips logged as warnings per stage; the later ones at debug level (stats() counts them all)

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80


def short_repr(obj: Any) -> str:
    """A datapoint in a few words (a key, a file name, the start of a list) for a log or an error."""
    try:
        return _repr.repr(obj)
    except Exception:  # a repr that fails names the type at least
        return f"<{type(obj).__name__}>"


def check_on_error(value: Any, who: str) -> str:
    if value not in ON_ERROR:
        raise ValueError(f"{who}: on_error must be 'raise' or 'skip', got {value!r}")
    return value


class Skipped:
    """A task's result with datapoints left out: ``value`` is what remains (None for a lone datapoint, the
    mapped datapoints of a group), ``records`` one ``(item, datapoint, error)`` per datapoint left out (its
    place in the group, or None; its :func:`short_repr`; the exception as text)."""

    __slots__ = ("records", "value")

    def __init__(self, value: Any, records: list) -> None:
        self.value, self.records = value, records

    def __reduce__(self) -> tuple:
        return Skipped, (self.value, self.records)


def guarded(map_one: Callable[[Any], Any], records: list) -> Callable[[Any, int | None], Any]:
    """``map_one`` under ``on_error="skip"``: a datapoint it raises an ``Exception`` on gives ``None`` (dropped)
    and a record in ``records``; ``item`` is its place in the task's group."""

    def one(dp: Any, item: int | None) -> Any:
        try:
            return map_one(dp)
        except Exception as exc:
            records.append((item, short_repr(dp), f"{type(exc).__name__}: {exc}"))
            return None

    return one


def map_task(map_one: Callable[[Any], Any], reserve: Callable[[int], Any] | None, skip: bool) -> Callable[[Any], Any]:
    """A map stage worker's task function: ``map_one`` on a datapoint, or on a :class:`~._fused.BatchTask`'s
    group stacked with ``reserve`` (:func:`~._fused.map_group`); under ``on_error="skip"`` (``skip``) guarded,
    and the datapoints left out recorded in a :class:`Skipped`. Its ``careful(payload, mark, avoid)`` runs a
    dead worker's task again (see :mod:`~bridgeflow.parallel._transport.supervision`): each datapoint of a
    group marked as it starts, those in ``avoid`` (they killed workers) left out."""
    records: list = []  # the datapoints of the task in progress left out
    one = guarded(map_one, records) if skip else lambda dp, item: map_one(dp)

    def run_guarded(payload: Any, avoid: dict[int, str] | None = None, mark: Any = None) -> Any:
        if type(payload) is not BatchTask:
            if mark is not None:
                mark(-1)
            out = one(payload, None)
        else:
            items = iter(range(len(payload.items)))

            def each(dp: Any) -> Any:
                i = next(items)
                if mark is not None:
                    mark(i)
                if avoid and i in avoid:
                    records.append((i, short_repr(dp), avoid[i]))
                    return None
                return one(dp, i)

            out = map_group(payload, each, reserve)
        if records:
            out = Skipped(out, records[:])
            records.clear()
        return out

    def run(payload: Any) -> Any:  # the fast path: nothing guarded, nothing marked
        if type(payload) is not BatchTask:
            return map_one(payload)
        return map_group(payload, map_one, reserve)

    careful = lambda payload, mark, avoid: run_guarded(payload, avoid, mark)
    task = run_guarded if skip else run
    task.careful = careful  # type: ignore[attr-defined]
    return task


class MapFaults(FaultPolicy):
    """A map stage's :class:`~bridgeflow.parallel._transport.supervision.FaultPolicy`: a datapoint that kills
    workers is named by its value and place, and skipped under ``on_error="skip"``."""

    hint = "; on_error='skip' skips it and goes on"

    def __init__(self, stage: Any) -> None:
        self._stage = weakref.ref(stage)  # the stage holds the pool that holds this
        self.skip = stage.on_error == "skip"

    def describe(self, task_id: int, payload: Any, item: int | None) -> str:
        dp = payload.items[item] if type(payload) is BatchTask and item is not None else payload
        what = "the group of source datapoints" if type(payload) is BatchTask and item is None else \
            "the source datapoint"
        stage = self._stage()
        where = stage._skip_position(task_id, item, exact=False) if stage is not None else ""
        return f"{what} {short_repr(dp if type(dp) is not BatchTask else dp.items)}{where}"

    def skipped(self, task_id: int, payload: Any, why: str) -> Any:
        if type(payload) is BatchTask:
            return Skipped([], [(i, short_repr(dp), why) for i, dp in enumerate(payload.items)])
        return Skipped(None, [(None, short_repr(payload), why)])


class SkipLog:
    """The consumer's side of skipping: the count for ``stats()`` and the log, a warning per datapoint (the
    first few; then debug)."""

    def __init__(self) -> None:
        self.count = 0

    def note(self, who: str, records: list, where: Callable[[int | None], str]) -> None:
        for item, dp, error in records:
            self.count += 1
            level = logging.WARNING if self.count <= _LOGGED else logging.DEBUG
            log.log(level, "%s: skipped the source datapoint %s%s: %s (on_error='skip'; %d skipped so far)%s", who,
                    dp, where(item), error, self.count,
                    "; further skips are logged at debug level" if self.count == _LOGGED else "")
