"""Per-datapoint transforms: map, filter, select, repeat, cache, resize an epoch, print.

Every transform accepts list/tuple datapoints (components addressed by position) and dict datapoints
(components addressed by key), and keeps the datapoint's type: a tuple stays a tuple.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from .base import DataFlow, ProxyDataFlow, RNGDataFlow
from .errors import DatapointError, LengthUnknownError

__all__ = [
    "CacheData",
    "FilterData",
    "FixedSizeData",
    "MapData",
    "MapDataComponent",
    "PrintData",
    "RepeatedData",
    "RepeatedDataPoint",
    "SelectComponent",
    "describe_datapoint",
    "get_component",
    "replace_component",
]

log = logging.getLogger(__name__)

_DATAPOINT_TYPES = (list, tuple, dict)


def check_datapoint(dp: Any, who: str) -> Any:
    """Return ``dp`` if it is a list, tuple or dict, else raise a :class:`DatapointError` from ``who``."""
    if type(dp) in _DATAPOINT_TYPES or isinstance(dp, _DATAPOINT_TYPES):
        return dp
    raise DatapointError(
        f"{who} produced a {type(dp).__name__} ({_short(dp)}); a datapoint must be a list, tuple or dict "
        "of components (wrap a single value as [value])"
    )


def get_component(dp: Any, index: Hashable, who: str = "datapoint") -> Any:
    """``dp[index]`` with an error that names the missing key or index and what the datapoint has."""
    try:
        return dp[index]
    except (KeyError, IndexError, TypeError):
        if isinstance(dp, dict):
            have = f"keys {sorted(map(str, dp))}"
        elif isinstance(dp, (list, tuple)):
            have = f"{len(dp)} components"
        else:
            have = f"a {type(dp).__name__}"
        raise DatapointError(f"{who}: component {index!r} is missing; the datapoint has {have}") from None


def replace_component(dp: Any, index: Hashable, value: Any) -> Any:
    """A copy of ``dp`` with component ``index`` set to ``value`` (the input is never modified)."""
    if isinstance(dp, dict):
        out = dict(dp)
        out[index] = value
        return out
    out = list(dp)
    out[index] = value  # type: ignore[index]
    return tuple(out) if isinstance(dp, tuple) else out


def _short(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MapData(ProxyDataFlow):
    """Apply ``func`` to every datapoint; a ``None`` result drops the datapoint.

    ``len()`` is the wrapped flow's, which overcounts when ``func`` drops datapoints (as in tensorpack).
    """

    def __init__(self, ds: DataFlow, func: Callable[[Any], Any]) -> None:
        super().__init__(ds)
        if not callable(func):
            raise TypeError(f"MapData needs a callable, got {func!r}")
        self.func = func

    def __iter__(self) -> Iterator:
        func = self.func
        types = _DATAPOINT_TYPES
        for dp in self.ds:
            out = func(dp)
            if out is None:
                continue
            if type(out) not in types:
                check_datapoint(out, f"MapData function {getattr(func, '__qualname__', func)!s}")
            yield out


class MapDataComponent(ProxyDataFlow):
    """Apply ``func`` to one component (a position, or a key of dict datapoints); ``None`` drops it."""

    def __init__(self, ds: DataFlow, func: Callable[[Any], Any], index: Hashable = 0) -> None:
        super().__init__(ds)
        if not callable(func):
            raise TypeError(f"MapDataComponent needs a callable, got {func!r}")
        self.func = func
        self.index = index

    def __iter__(self) -> Iterator:
        func, index = self.func, self.index
        for dp in self.ds:
            out = func(get_component(dp, index, "MapDataComponent"))
            if out is None:
                continue
            yield replace_component(dp, index, out)


class FilterData(ProxyDataFlow):
    """Keep the datapoints for which ``predicate(dp)`` is true. Its length is unknown."""

    def __init__(self, ds: DataFlow, predicate: Callable[[Any], bool]) -> None:
        super().__init__(ds)
        self.predicate = predicate

    def __len__(self) -> int:
        raise LengthUnknownError("FilterData cannot know how many datapoints pass its predicate")

    def __iter__(self) -> Iterator:
        pred = self.predicate
        for dp in self.ds:
            if pred(dp):
                yield dp


class SelectComponent(ProxyDataFlow):
    """Keep the components in ``idxs``, in that order; the datapoint keeps its type (list, tuple, dict)."""

    def __init__(self, ds: DataFlow, idxs: Sequence[Hashable]) -> None:
        super().__init__(ds)
        if isinstance(idxs, (str, bytes)) or not isinstance(idxs, Sequence):
            raise TypeError(f"SelectComponent needs a sequence of indices or keys, got {idxs!r}")
        self.idxs = list(idxs)

    def __iter__(self) -> Iterator:
        idxs = self.idxs
        for dp in self.ds:
            try:
                if isinstance(dp, dict):
                    yield {k: dp[k] for k in idxs}
                elif isinstance(dp, tuple):
                    yield tuple([dp[i] for i in idxs])
                else:
                    yield [dp[i] for i in idxs]
            except (KeyError, IndexError, TypeError):
                for i in idxs:
                    get_component(dp, i, "SelectComponent")
                raise


class RepeatedData(ProxyDataFlow):
    """Iterate the wrapped flow ``num`` times per epoch; ``num=-1`` repeats forever."""

    def __init__(self, ds: DataFlow, num: int) -> None:
        super().__init__(ds)
        if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < -1:
            raise ValueError(f"RepeatedData num must be a count >= 0 or -1 (forever), got {num!r}")
        self.num = int(num)

    def __len__(self) -> int:
        if self.num == -1:
            raise LengthUnknownError("RepeatedData(num=-1) repeats forever")
        return len(self.ds) * self.num

    def __iter__(self) -> Iterator:
        done = 0
        while self.num == -1 or done < self.num:
            empty = True
            for dp in self.ds:
                empty = False
                yield dp
            if empty and self.num == -1:
                raise DatapointError("RepeatedData(num=-1) wraps a flow that yielded nothing; it would spin")
            done += 1


class RepeatedDataPoint(ProxyDataFlow):
    """Yield every datapoint ``num`` times in a row (the same object each time)."""

    def __init__(self, ds: DataFlow, num: int) -> None:
        super().__init__(ds)
        if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < 1:
            raise ValueError(f"RepeatedDataPoint num must be a positive count, got {num!r}")
        self.num = int(num)

    def __len__(self) -> int:
        return len(self.ds) * self.num

    def __iter__(self) -> Iterator:
        num = self.num
        for dp in self.ds:
            for _ in range(num):
                yield dp


class FixedSizeData(ProxyDataFlow):
    """Exactly ``size`` datapoints per epoch, restarting the wrapped flow when it runs out.

    With ``keep_state=True`` the next epoch continues where the last one stopped.
    """

    def __init__(self, ds: DataFlow, size: int, keep_state: bool = True) -> None:
        super().__init__(ds)
        if size <= 0:
            raise ValueError(f"FixedSizeData size must be positive, got {size}")
        self._size = int(size)
        self.keep_state = keep_state
        self._itr: Iterator | None = None

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator:
        if self._itr is None or not self.keep_state:
            self._itr = iter(self.ds)
        n = 0
        while n < self._size:
            try:
                dp = next(self._itr)
            except StopIteration:
                self._itr = iter(self.ds)
                try:
                    dp = next(self._itr)
                except StopIteration:
                    raise DatapointError("FixedSizeData wraps a flow that yielded nothing") from None
            n += 1
            yield dp
        if not self.keep_state:
            self._itr = None

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_itr"] = None  # a copy starts from the beginning (and a generator cannot be pickled)
        return state

    def close(self) -> None:
        itr, self._itr = self._itr, None
        if itr is not None and hasattr(itr, "close"):
            itr.close()
        super().close()


class CacheData(ProxyDataFlow, RNGDataFlow):
    """Remember the first epoch in memory and replay it afterwards, optionally reshuffled.

    An epoch interrupted before its end is not cached; the next epoch reads the wrapped flow again.
    """

    def __init__(self, ds: DataFlow, shuffle: bool = False, seed: int | None = None) -> None:
        ProxyDataFlow.__init__(self, ds)
        self.shuffle = shuffle
        self.seed = seed
        self._cache: list | None = None

    def reset_state(self) -> None:
        ProxyDataFlow.reset_state(self)
        RNGDataFlow.reset_state(self)

    def __len__(self) -> int:
        if self._cache is not None:
            return len(self._cache)
        return len(self.ds)

    def __iter__(self) -> Iterator:
        if self._cache is not None:
            order = self.rng.permutation(len(self._cache)) if self.shuffle else range(len(self._cache))
            cache = self._cache
            for i in order:
                yield cache[i]
            return
        buffer = []
        for dp in self.ds:
            buffer.append(dp)
            yield dp
        self._cache = buffer


def describe_datapoint(dp: Any, max_depth: int = 3, max_list: int = 3, _depth: int = 0) -> str:
    """A one-line-per-component description: types, shapes, dtypes and value ranges."""
    pad = "  " * _depth
    if isinstance(dp, np.ndarray):
        rng = f", range [{dp.min()}, {dp.max()}]" if dp.size and dp.dtype.kind in "biuf" else ""
        return f"{pad}ndarray shape={dp.shape} dtype={dp.dtype}{rng}"
    if isinstance(dp, (list, tuple, dict)) and _depth < max_depth:
        items = list(dp.items()) if isinstance(dp, dict) else list(enumerate(dp))
        lines = [f"{pad}{type(dp).__name__} of {len(items)}:"]
        for key, value in items[:max_list]:
            lines.append(f"{pad}  [{key!r}]")
            lines.append(describe_datapoint(value, max_depth, max_list, _depth + 2))
        if len(items) > max_list:
            lines.append(f"{pad}  ... {len(items) - max_list} more")
        return "\n".join(lines)
    if hasattr(dp, "shape") and hasattr(dp, "dtype"):  # tensors of other libraries
        return f"{pad}{type(dp).__name__} shape={tuple(dp.shape)} dtype={dp.dtype}"
    return f"{pad}{type(dp).__name__} {_short(dp)}"


class PrintData(ProxyDataFlow):
    """Log the structure of the first ``num`` datapoints of every epoch (to logger ``bridgeflow``)."""

    def __init__(self, ds: DataFlow, num: int = 1, name: str | None = None, max_depth: int = 3,
                 max_list: int = 3, level: int = logging.INFO) -> None:
        super().__init__(ds)
        self.num = num
        self.name = name or type(ds).__name__
        self.max_depth = max_depth
        self.max_list = max_list
        self.level = level

    def __iter__(self) -> Iterator:
        for i, dp in enumerate(self.ds):
            if i < self.num:
                log.log(self.level, "PrintData %s, datapoint %d:\n%s", self.name, i,
                        describe_datapoint(dp, self.max_depth, self.max_list))
            yield dp
