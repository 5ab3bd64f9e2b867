"""Contract checks that every DataFlow should pass; use them in your own flows' tests.

Example:
    >>> from bridgeflow import DataFromList
    >>> from bridgeflow.testing import check_dataflow
    >>> check_dataflow(DataFromList([[1], [2]], shuffle=False))
    [[1], [2]]
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ._base import DataFlow
from ._errors import DataFlowReentrantError, LengthUnknownError

__all__ = ["assert_same_datapoints", "check_dataflow", "check_resumable", "datapoint_structure"]


def datapoint_structure(dp: Any, _top: bool = True) -> Any:
    """A hashable summary of a datapoint's structure: container types, keys, array dtypes and ranks.

    The datapoint's own components are summarised one by one; a list or tuple *inside* a component
    (a batch's list of strings, a variable number of boxes) only by its type, since its length may vary.
    """
    if isinstance(dp, dict):
        return ("dict", tuple((k, datapoint_structure(v, False)) for k, v in dp.items()))
    if isinstance(dp, (list, tuple)):
        if not _top:
            return (type(dp).__name__,)
        return (type(dp).__name__, tuple(datapoint_structure(v, False) for v in dp))
    if isinstance(dp, np.ndarray):
        return ("ndarray", dp.dtype.str, dp.ndim)
    return (type(dp).__name__,)


def _key(dp: Any) -> Any:
    """A hashable, value-exact key for comparing datapoints as a multiset."""
    if isinstance(dp, dict):
        return ("d", tuple((k, _key(v)) for k, v in dp.items()))
    if isinstance(dp, (list, tuple)):
        return ("l", tuple(_key(v) for v in dp))
    if isinstance(dp, np.ndarray):
        return ("a", dp.dtype.str, dp.shape, dp.tobytes())
    return ("v", repr(dp))


def assert_same_datapoints(a: list, b: list, ordered: bool = True) -> None:
    """Assert two lists of datapoints are equal (exact array values and dtypes), in order or as multisets."""
    assert len(a) == len(b), f"{len(a)} datapoints != {len(b)}"
    ka, kb = [_key(x) for x in a], [_key(x) for x in b]
    if ordered:
        for i, (x, y) in enumerate(zip(ka, kb)):
            assert x == y, f"datapoint {i} differs: {a[i]!r} != {b[i]!r}"
    else:
        assert Counter(ka) == Counter(kb), "the two flows yield different multisets of datapoints"


def check_dataflow(df: DataFlow, *, epochs: int = 2, deterministic: bool | None = None,
                   max_datapoints: int = 100_000) -> list:
    """Check the DataFlow contract on ``df`` and return the datapoints of its first epoch.

    Checks: ``reset_state()`` then two epochs; every datapoint is a list/tuple/dict with one structure
    throughout; ``len()`` equals the count, or raises ``LengthUnknownError`` (a ``TypeError``); a second
    concurrent ``iter()`` is refused; ``close()`` works twice. ``deterministic=True`` also requires the
    epochs to be equal; ``None`` compares them as multisets when the flow has a length.
    """
    df.reset_state()
    try:
        length: int | None = len(df)
    except LengthUnknownError:
        length = None
    except TypeError as exc:
        raise AssertionError(f"len() raised a TypeError that is not LengthUnknownError: {exc!r}") from exc

    runs = []
    for epoch in range(epochs):
        out: list = []
        structure = None
        for dp in df:
            assert isinstance(dp, (list, tuple, dict)), f"epoch {epoch}: datapoint is a {type(dp).__name__}"
            s = datapoint_structure(dp)
            if structure is None:
                structure = s
            assert s == structure, f"epoch {epoch}, datapoint {len(out)}: structure {s} != first {structure}"
            out.append(dp)
            assert len(out) <= max_datapoints, f"more than {max_datapoints} datapoints: endless flow?"
        if length is not None:
            assert len(out) == length, f"epoch {epoch}: len() is {length} but {len(out)} datapoints came"
        runs.append(out)

    if deterministic:
        for r in runs[1:]:
            assert_same_datapoints(runs[0], r, ordered=True)
    elif deterministic is None and length is not None:
        for r in runs[1:]:
            assert_same_datapoints(runs[0], r, ordered=False)

    first = iter(df)
    try:
        next(first)
        try:
            iter(df)
        except DataFlowReentrantError:
            pass
        else:
            raise AssertionError("a second concurrent iter() was not refused")
    except StopIteration:
        pass
    finally:
        close = getattr(first, "close", None)  # a flow's __iter__ may return a plain iterator
        if close is not None:
            close()
    df.close()
    df.close()
    return runs[0]


def check_resumable(make: Callable[[], DataFlow], *, positions: Iterable[int] | None = None,
                    epochs: int = 2) -> list:
    """Check that flows built by ``make()`` resume exactly; returns the uninterrupted first epoch.

    For every position ``k`` (default: the first, the middle and the last datapoint of the first
    epoch), a flow's ``state_dict()`` taken after ``k`` datapoints, passed through ``json``, is loaded
    into a fresh flow (once before and once after its ``reset_state()``): it must yield the rest of the
    epoch, then ``epochs - 1`` more epochs, exactly as a flow that was never interrupted. A state taken
    between two epochs must start the next one. ``make()`` must build the same flow every time (fixed
    seeds). Flows are closed afterwards.

    Example:
        >>> from bridgeflow import DataFromList
        >>> len(check_resumable(lambda: DataFromList([[i] for i in range(5)], shuffle=True, seed=0)))
        5
    """
    with make() as u:
        u.reset_state()
        runs = [list(u) for _ in range(epochs)]
    n = len(runs[0])
    ks = sorted(set(positions) if positions is not None else {0, n // 2, n})
    for k in ks:
        if not 0 <= k <= n:
            raise ValueError(f"position {k} is outside the first epoch's {n} datapoints")
        for reset_first in (False, True):
            with make() as f:
                f.reset_state()
                it = iter(f)
                got = [next(it) for _ in range(k)]
                state = json.loads(json.dumps(f.state_dict()))
                if hasattr(it, "close"):
                    it.close()
            with make() as g:
                if reset_first:
                    g.reset_state()
                g.load_state_dict(state)
                tail = [list(g) for _ in range(epochs)]
            where = f"resumed after {k} datapoints ({'after' if reset_first else 'before'} reset_state)"
            try:
                assert_same_datapoints(got + tail[0], runs[0])
                for e in range(1, epochs):
                    assert_same_datapoints(tail[e], runs[e])
            except AssertionError as exc:
                raise AssertionError(f"{where}: {exc}") from None
    with make() as f:
        f.reset_state()
        list(f)
        state = json.loads(json.dumps(f.state_dict()))
    with make() as g:
        g.load_state_dict(state)
        for e in range(1, epochs):
            try:
                assert_same_datapoints(list(g), runs[e])
            except AssertionError as exc:
                raise AssertionError(f"resumed between epochs 0 and 1, epoch {e}: {exc}") from None
    return runs[0]
