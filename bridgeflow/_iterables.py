"""Plain Python iterables as flows: ``DataFromGenerator``, ``DataFromIterable``, and :func:`as_dataflow`.

Every wrapper accepts a plain iterable where it takes a flow (``MapData([[1], [2]], f)``): it goes through
:func:`as_dataflow`, which wraps it in :class:`DataFromIterable`. Both flows resume by counting and
skipping (the default state), so they resume exactly when the iterable (or the generator function)
gives the same items each time; a generator *object* or a one-shot iterator cannot be rewound, and
their ``state_dict()`` raises :class:`~bridgeflow._state.NotResumableError` saying what to pass instead.

Example:
    >>> df = as_dataflow([[1], [2]])
    >>> type(df).__name__, list(df)
    ('DataFromIterable', [[1], [2]])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ._base import DataFlow
from ._errors import LengthUnknownError, length_unknown

__all__ = ["DataFromGenerator", "DataFromIterable", "as_dataflow", "not_a_flow"]


def as_dataflow(ds: Any, who: str = "DataFlow") -> Any:
    """``ds`` itself if it is a flow (a DataFlow, or any object with ``__iter__`` and ``reset_state``);
    a plain iterable (a list, a generator) wrapped in ``DataFromIterable``; else a ``TypeError``."""
    if isinstance(ds, DataFlow) or (hasattr(ds, "__iter__") and hasattr(ds, "reset_state")):
        return ds
    if not hasattr(ds, "__iter__"):
        raise not_a_flow(ds, f"{who} wraps a DataFlow or iterable")
    return DataFromIterable(ds)


def not_a_flow(ds: Any, what: str) -> TypeError:
    """The error for ``ds`` given where a flow or iterable is needed (``what`` says by whom); for a dataset read
    by index (``__len__`` and ``__getitem__``, as torch's map-style ``Dataset``), how to make it a flow."""
    message = f"{what}, got {type(ds).__name__}"
    if hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
        message += (", a dataset read by index (as torch's map-style Dataset): make it a flow with "
                    "DataFromList(dataset, shuffle=False), which reads dataset[i] in order (shuffle=True: in a new "
                    "order every epoch)")
    return TypeError(message)


class DataFromGenerator(DataFlow):
    """Datapoints from a generator function, called anew for every epoch.

    A generator *object* can be passed too, but it can be iterated only once (a second epoch raises) and
    cannot be resumed. ``size`` gives ``len()`` when the generator's length is known. Resuming calls the
    function again and skips the datapoints already delivered, so the function must give the same
    datapoints each call.
    """

    def __init__(self, gen: Callable[[], Iterable] | Iterator, size: int | None = None) -> None:
        if not callable(gen) and not inspect.isgenerator(gen) and not hasattr(gen, "__next__"):
            raise TypeError(f"DataFromGenerator needs a generator function or generator, got {gen!r}")
        self._gen = gen
        self._size = size
        self._used = False

    def __len__(self) -> int:
        if self._size is None:
            raise length_unknown("DataFromGenerator has no known length; pass size= to give one")
        return self._size

    def _iter_epoch(self) -> Iterator:
        if callable(self._gen):
            yield from self._gen()
            return
        if self._used:
            raise RuntimeError("DataFromGenerator got a generator object, which can be iterated only once; "
                               "pass the generator function instead to iterate several epochs")
        self._used = True
        yield from self._gen

    def _why_not_resumable(self) -> str | None:
        if not callable(self._gen):
            return ("it was given a generator object, which cannot be rewound to a saved position; pass the "
                    "generator function instead (DataFromGenerator(make) rather than DataFromGenerator(make()))")
        return super()._why_not_resumable()


class DataFromIterable(DataFlow):
    """Datapoints from any iterable; ``len()`` is the iterable's when it has one.

    Resuming iterates it again and skips the datapoints already delivered: an iterable that gives the
    same items each time (a list, a range) resumes exactly; a one-shot iterator cannot be resumed.
    """

    def __init__(self, iterable: Iterable) -> None:
        if not hasattr(iterable, "__iter__"):
            raise TypeError(f"DataFromIterable needs an iterable, got {type(iterable).__name__}")
        self._itr = iterable

    def __len__(self) -> int:
        try:
            return len(self._itr)  # type: ignore[arg-type]  # an unsized one: the TypeError is caught
        except TypeError:
            raise LengthUnknownError(
                f"the {type(self._itr).__name__} given to DataFromIterable has no len()") from None

    def _iter_epoch(self) -> Iterator:
        yield from self._itr

    def _why_not_resumable(self) -> str | None:
        if hasattr(self._itr, "__next__"):
            return (f"it wraps a {type(self._itr).__name__}, a one-shot iterator that cannot be rewound to a "
                    "saved position; pass a list, or a DataFromGenerator of a function that makes the iterator")
        return super()._why_not_resumable()
