"""What a task gives back: one tagged type, :class:`Result`, for every outcome of a task.

A worker's task function (:class:`~._fetch.WorkerTask`), the batch sources (:mod:`._sources`) and the pin thread
(:mod:`._pin_memory`) hand the epoch iterator a :class:`Result` whose ``tag`` says what happened:

- ``BATCH``: ``value`` is a batch;
- ``ENDED``: the worker's stream ran out (an iterable dataset, or a worker whose start-up failed);
- ``STOPPED``: a map-style dataset raised ``StopIteration`` (torch ends the epoch there);
- ``FAILED``: ``value`` is the exception the dataset, the collation or the pinning raised, to be raised to
  the user in the batch's place;
- ``STARTED``: a persistent worker started another epoch (the answer to :class:`~._fetch.Reset`);
- ``SKIPPED``: every sample of the task was left out (``on_error="skip"``): no batch.

``skipped`` lists the samples left out of the task under ``on_error="skip"``, as ``(index, error)`` pairs (the
sample's index, or the batch's indices when the task cannot be told apart; the exception as text), or is None.

``state`` is the worker's dataset state right after the task (torchdata's convention, see
:meth:`~._fetch.Fetcher.state`): None when the dataset has none, an exception when reading it failed.

The tags are the members of :class:`Tag`, an :class:`enum.Enum`, also bound at module level (``BATCH``, ...).
Each is one object in every process: a pickled tag is loaded by name as the same member, so the epoch iterator
tells them apart with ``is``.

Example:
    >>> r = Result(BATCH, [1, 2])
    >>> r.tag is BATCH, r.value, r.state
    (True, [1, 2], None)
    >>> import pickle
    >>> pickle.loads(pickle.dumps(r)).tag is BATCH
    True
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["BATCH", "ENDED", "FAILED", "SKIPPED", "STARTED", "STOPPED", "Result", "Tag"]


class Tag(enum.Enum):
    """What a task's :class:`Result` says happened (see the module doc). The values are the tags' numbers on
    the wire: a pickled :class:`Result` carries its tag as that small int."""

    BATCH = 0
    ENDED = 1
    STOPPED = 2
    FAILED = 3
    STARTED = 4
    SKIPPED = 5


BATCH, ENDED, STOPPED = Tag.BATCH, Tag.ENDED, Tag.STOPPED
FAILED, STARTED, SKIPPED = Tag.FAILED, Tag.STARTED, Tag.SKIPPED
_TAGS = tuple(Tag)  # a tag's member by its number: _TAGS[tag._value_] is tag


class Result:
    """A task's outcome: ``tag`` (see the module doc), ``value``, the dataset's ``state`` after it, and the
    samples ``skipped``."""

    __slots__ = ("skipped", "state", "tag", "value")

    def __init__(self, tag: Tag, value: Any = None, state: Any = None, skipped: list | None = None) -> None:
        self.tag = tag
        self.value = value
        self.state = state
        self.skipped = skipped

    def __reduce__(self) -> tuple:
        # The tag travels as its number (``_value_``, a plain attribute): a worker sends a result per batch, and
        # pickling the member itself would look its class up by name on each load.
        if self.skipped is None:
            return (_loaded, (self.tag._value_, self.value, self.state))
        return (_loaded, (self.tag._value_, self.value, self.state, self.skipped))

    def __repr__(self) -> str:
        return f"Result({self.tag.name.lower()}, state={'yes' if self.state is not None else 'none'})"


def _loaded(tag: int, value: Any, state: Any, skipped: list | None = None) -> Result:
    """A pickled :class:`Result` loaded: its tag back from its number."""
    return Result(_TAGS[tag], value, state, skipped)
