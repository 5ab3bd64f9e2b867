"""What a task gives back: one tagged type, :class:`Result`, for every outcome of a task.

A worker's task function (:class:`~._fetch.WorkerTask`), the batch sources (:mod:`._sources`) and the pin thread
(:mod:`._pin_memory`) hand the epoch iterator a :class:`Result` whose ``tag`` says what happened:

- ``BATCH``: ``value`` is a batch;
- ``ENDED``: the worker's stream ran out (an iterable dataset, or a worker whose start-up failed);
- ``STOPPED``: a map-style dataset raised ``StopIteration`` (torch ends the epoch there);
- ``FAILED``: ``value`` is the exception the dataset, the collation or the pinning raised, to be raised to
  the user in the batch's place;
- ``STARTED``: a persistent worker started another epoch (the answer to :class:`~._fetch.Reset`).

``state`` is the worker's dataset state right after the task (torchdata's convention, see
:meth:`~._fetch.Fetcher.state`): None when the dataset has none, an exception when reading it failed.

Example:
    >>> r = Result(BATCH, [1, 2])
    >>> r.tag == BATCH, r.value, r.state
    (True, [1, 2], None)
"""

from __future__ import annotations

from typing import Any

__all__ = ["BATCH", "ENDED", "FAILED", "STARTED", "STOPPED", "Result"]

BATCH, ENDED, STOPPED, FAILED, STARTED = "batch", "ended", "stopped", "failed", "started"


class Result:
    """A task's outcome: ``tag`` (see the module doc), ``value`` and the dataset's ``state`` after it."""

    __slots__ = ("state", "tag", "value")

    def __init__(self, tag: str, value: Any = None, state: Any = None) -> None:
        self.tag = tag
        self.value = value
        self.state = state

    def __reduce__(self) -> tuple:
        return (Result, (self.tag, self.value, self.state))

    def __repr__(self) -> str:
        return f"Result({self.tag}, state={'yes' if self.state is not None else 'none'})"
