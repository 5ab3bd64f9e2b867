"""Per-datapoint transforms: map, filter, select, repeat, cache, resize an epoch, print.

Every transform accepts list/tuple datapoints (components addressed by position) and dict datapoints
(components addressed by key), and keeps the datapoint's type: a tuple stays a tuple.

State: a transform that holds nothing between two datapoints (map, filter, select, print) saves only
its child's state; the others add their own position (repeats done, datapoints into the epoch, the
cache's epoch), and over an unordered stage what they hold of it (the datapoint being repeated, the
cache; see :mod:`bridgeflow._base`). Each ``_begin_epoch`` opens its child's iterator at once, so a loaded
state is taken up by the ``iter()`` call itself, even if the iterator is dropped before its first
datapoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import numpy as np

from ._base import DataFlow, epoch_live, pending_state, unordered_stage
from ._errors import DatapointError, LengthUnknownError
from ._order import EpochOrder
from ._proxy import ProxyDataFlow
from ._rng import RNGDataFlow
from ._state import (
    StateMismatchError,
    child_state,
    held_then,
    pack_held,
    read_first,
    rng_state,
    set_rng_state,
    state_or_error,
    unless_error,
    unpack_held,
)
from ._state_schema import Child, Count, Flag, Held, Rng, Same, Value, check_fields

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
    items = list(dp)
    items[index] = value  # type: ignore[call-overload]  # a list's or tuple's component: an int index
    return tuple(items) if isinstance(dp, tuple) else items


def _short(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MapData(ProxyDataFlow):
    """Apply ``func`` to every datapoint; a ``None`` result drops the datapoint.

    ``len()`` is the wrapped flow's, which overcounts when ``func`` drops datapoints (as in tensorpack).
    Over a random-access flow, ``df[i]`` is ``func(ds[i])`` (None when it drops it).
    """

    def __init__(self, ds: DataFlow, func: Callable[[Any], Any]) -> None:
        super().__init__(ds)
        if not callable(func):
            raise TypeError(f"MapData needs a callable, got {func!r}")
        self.func = func

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        return self._map(iter(self.ds))

    def __getitem__(self, index: int) -> Any:
        return next(self._map(iter((self.ds[index],))), None)

    def _map(self, source: Iterator) -> Iterator:
        func = self.func
        types = _DATAPOINT_TYPES
        for dp in source:
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

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        return self._map(iter(self.ds))

    def __getitem__(self, index: int) -> Any:
        """``ds[index]`` mapped, over a random-access flow (None when ``func`` drops it)."""
        return next(self._map(iter((self.ds[index],))), None)

    def _map(self, source: Iterator) -> Iterator:
        func, index = self.func, self.index
        for dp in source:
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

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        return self._filter(iter(self.ds))

    def _filter(self, source: Iterator) -> Iterator:
        pred = self.predicate
        for dp in source:
            if pred(dp):
                yield dp


class SelectComponent(ProxyDataFlow):
    """Keep the components in ``idxs``, in that order; the datapoint keeps its type (list, tuple, dict)."""

    def __init__(self, ds: DataFlow, idxs: Sequence[Hashable]) -> None:
        super().__init__(ds)
        if isinstance(idxs, (str, bytes)) or not isinstance(idxs, Sequence):
            raise TypeError(f"SelectComponent needs a sequence of indices or keys, got {idxs!r}")
        self.idxs = list(idxs)

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        return self._select(iter(self.ds))

    def _select(self, source: Iterator) -> Iterator:
        idxs: list[Any] = self.idxs  # keys of a dict, int indices of a list or tuple
        for dp in source:
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

    state_fields = (Same("num", "num", "the state is for num={saved}, this flow repeats num={have}"),
                    Count("done", lambda f: None if f.num == -1 else f.num, lambda f: f"num={f.num} passes"), Child())

    def __init__(self, ds: DataFlow, num: int) -> None:
        super().__init__(ds)
        if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < -1:
            raise ValueError(f"RepeatedData num must be a count >= 0 or -1 (forever), got {num!r}")
        self.num = int(num)
        self._done = 0  # passes over ds completed in this epoch

    def __len__(self) -> int:
        if self.num == -1:
            raise LengthUnknownError("RepeatedData(num=-1) repeats forever")
        return len(self.ds) * self.num

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        self._done = resume["done"] if resume is not None else 0
        first = iter(self.ds) if self.num == -1 or self._done < self.num else None
        return self._repeat(first, resume is not None)

    def _repeat(self, it: Iterator | None, resumed: bool) -> Iterator:
        while self.num == -1 or self._done < self.num:
            empty = True
            for dp in it if it is not None else self.ds:
                empty = False
                yield dp
            it = None
            if empty and self.num == -1 and not resumed:  # a resumed pass may have nothing left
                raise DatapointError("RepeatedData(num=-1) wraps a flow that yielded nothing; it would spin")
            resumed = False
            self._done += 1

    def _own_state(self) -> dict:
        return {"num": self.num, "done": self._done if epoch_live(self) else 0, "child": child_state(self.ds)}



class RepeatedDataPoint(ProxyDataFlow):
    """Yield every datapoint ``num`` times in a row (the same object each time).

    Its state is its child's state before the current datapoint plus the repeats done, so it asks its
    child for a state once per datapoint read; once the current datapoint's repeats are all done, it is the
    child's state after it. Over an unordered stage, whose next datapoint on a resume would be another one,
    a state part-way through a datapoint's repeats is the child's state after it plus the datapoint
    (``held``).
    """

    state_fields = (Same("num", "num", "the state is for num={saved}, this flow repeats num={have}"),
                    Count("rep", lambda f: f.num, lambda f: f"num={f.num} repeats"), Held(count=1),
                    Child())

    def __init__(self, ds: DataFlow, num: int) -> None:
        super().__init__(ds)
        if isinstance(num, bool) or not isinstance(num, (int, np.integer)) or num < 1:
            raise ValueError(f"RepeatedDataPoint num must be a positive count, got {num!r}")
        self.num = int(num)
        self._before: Any = None  # the child's state before the current datapoint (or the StateError)
        self._rep = 0
        self._dp: Any = None  # the datapoint being repeated
        self._loose: str | None = None  # the unordered stage under this flow, if any

    def __len__(self) -> int:
        return len(self.ds) * self.num

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        self._loose = unordered_stage(self)
        self._rep = resume["rep"] if resume is not None else 0
        held = resume.get("held") if resume is not None else None
        if self._loose is None:
            self._before = state_or_error(child_state, self.ds)  # before iter(): the loaded state, if any
        source = iter(self.ds)
        self._dp = None
        if held is not None:
            items = unpack_held(held)
            self._dp = items[0]
            source = held_then(items, source)
        elif self._rep:  # the datapoint being repeated, read again now
            source = read_first(source)
        return self._repeat(source, self._rep)

    def _repeat(self, source: Iterator, skip: int) -> Iterator:
        num, ds = self.num, self.ds
        exact = self._loose is None
        first = True
        while True:
            if not first:
                if exact:
                    self._before = state_or_error(child_state, ds)
                self._rep = 0
                self._dp = None
            first = False
            try:
                dp = next(source)
            except StopIteration:
                return
            self._dp = dp
            for i in range(skip, num):
                self._rep = i + 1
                yield dp
            skip = 0

    def _own_state(self) -> dict:
        if epoch_live(self) and self._rep < self.num:  # part-way through a datapoint's repeats (or before it)
            if self._loose is None:
                return {"num": self.num, "rep": self._rep, "held": None, "child": unless_error(self._before)}
            if self._dp is not None:
                held = pack_held([self._dp], self._loose)
                return {"num": self.num, "rep": self._rep, "held": held, "child": child_state(self.ds)}
        return {"num": self.num, "rep": 0, "held": None, "child": child_state(self.ds)}


class FixedSizeData(ProxyDataFlow):
    """Exactly ``size`` datapoints per epoch, restarting the wrapped flow when it runs out.

    With ``keep_state=True`` the next epoch continues where the last one stopped.
    """

    state_fields = (Same("size", "_size", "the state is for size={saved}, this flow has size={have}"),
                    Same("keep_state", "keep_state"), Count("pos", lambda f: f._size, "size"), Flag("carried"),
                    Child())

    def __init__(self, ds: DataFlow, size: int, keep_state: bool = True) -> None:
        super().__init__(ds)
        if size <= 0:
            raise ValueError(f"FixedSizeData size must be positive, got {size}")
        self._size = int(size)
        self.keep_state = keep_state
        self._itr: Iterator | None = None
        self._n = 0

    def __len__(self) -> int:
        return self._size

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        self._n = resume["pos"] if resume is not None else 0
        if resume is not None or self._itr is None or not self.keep_state:
            old, self._itr = self._itr, None
            if old is not None and hasattr(old, "close"):  # an epoch left before its end: let the child go
                old.close()
            self._itr = iter(self.ds)  # after a load: continues the child's saved epoch, if it was carried
        return self._fixed()

    def _fixed(self) -> Iterator:
        assert self._itr is not None, "FixedSizeData: _begin_epoch sets the child's iterator"
        try:
            while self._n < self._size:
                try:
                    dp = next(self._itr)
                except StopIteration:
                    self._itr = iter(self.ds)
                    try:
                        dp = next(self._itr)
                    except StopIteration:
                        raise DatapointError("FixedSizeData wraps a flow that yielded nothing") from None
                self._n += 1
                yield dp
        finally:
            if not self.keep_state:  # the child's iteration ends with the epoch, however the epoch ends, so
                itr, self._itr = self._itr, None  # the child's state says so (a resume starts it afresh)
                if itr is not None and hasattr(itr, "close"):
                    itr.close()

    def _own_state(self) -> dict:
        live = epoch_live(self)
        # between epochs the child's iteration is carried only with keep_state
        carried = self._itr is not None and (live or self.keep_state) and _alive(self._itr)
        return {"size": self._size, "keep_state": self.keep_state, "pos": self._n if live else 0,
                "carried": carried, "child": child_state(self.ds)}


    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_itr"] = None  # a copy starts from the beginning (and a generator cannot be pickled)
        return state

    def close(self) -> None:
        itr, self._itr = self._itr, None
        if itr is not None and hasattr(itr, "close"):
            itr.close()
        super().close()


def _alive(it: Any) -> bool:
    """Whether an iterator (a generator) can still yield: not exhausted or closed."""
    frame = getattr(it, "gi_frame", False)
    return frame is not None


def _check_order(flow: Any, order: dict) -> None:
    """A filled cache's order: an EpochOrder's state over a cache of 'n' datapoints."""
    fields = (Count("n"), Same("shuffle", lambda f: bool(f.shuffle)), Same("shard", lambda f: None),
              Count("base", (1 << 64) - 1, "a seed of 64 bits", none=True), Count("epoch", (1 << 63) - 1),
              Count("pos", lambda f: order.get("n") if isinstance(order.get("n"), int) else 0, "the cache's length"))
    try:
        check_fields(flow, order, fields, reserved=())
    except StateMismatchError as exc:
        raise StateMismatchError(exc.reason.replace("field '", "field 'order.", 1)) from None


class CacheData(ProxyDataFlow, RNGDataFlow):
    """Remember the first epoch in memory and replay it afterwards, optionally reshuffled.

    An epoch interrupted before its end is not cached; the next epoch reads the wrapped flow again.
    Its state is the wrapped flow's state when the cached epoch began plus the position: resuming reads
    that epoch again to rebuild the cache. Over an unordered stage, which would give the epoch in another
    order (and a filling epoch's first datapoints would be others), the state holds the cache itself
    (``held``, the datapoints read so far while filling) and the wrapped flow's state after them.
    """

    state_fields = (Flag("filled"), Count("pos"), Held(), Child(), Value("order", dict, _check_order, none=True),
                    Rng("rng"))

    def __init__(self, ds: DataFlow, shuffle: bool = False, seed: int | None = None) -> None:
        ProxyDataFlow.__init__(self, ds)
        self.shuffle = shuffle
        self.seed = seed
        self._cache: list | None = None
        self._held: str | None = None  # the cache as a state holds it, once asked for (over an unordered stage)
        self._buffer: list = []
        self._start: Any = None  # the child's state when the (filling) epoch began
        self._order: EpochOrder | None = None
        self._loose: str | None = None  # the unordered stage under this flow, if any

    def __len__(self) -> int:
        if self._cache is not None:
            return len(self._cache)
        pending = pending_state(self)
        if pending is not None and pending["filled"]:  # a loaded state of a filled cache: its length, not the
            return pending["order"]["n"]  # wrapped flow's (a map that drops datapoints overstates that)
        return len(self.ds)

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        self._loose = unordered_stage(self)
        if resume is not None:
            self._cache = None
            self._start = resume["child"]
            if resume["rng"] is not None:
                set_rng_state(self.rng, resume["rng"])
            held = resume.get("held")
            if resume["filled"]:  # rebuild the cache (from the state, or the child's saved epoch), resume in it
                if held is not None:
                    self._set_cache(unpack_held(held))
                else:
                    self._fill_silently(iter(self.ds), None)
                order = self._cached()[1]
                order.check(resume["order"])
                return self._replay(*order.begin(resume["order"]))
            source = iter(self.ds)
            self._buffer = unpack_held(held) if held is not None else self._fill_silently(source, resume["pos"])
            return self._fill(source, self._buffer)
        if self._cache is not None:
            return self._replay(*self._cached()[1].begin())
        self._start = state_or_error(child_state, self.ds) if self._loose is None else None
        self._buffer = []
        return self._fill(iter(self.ds), self._buffer)

    def _fill_silently(self, source: Iterator, count: int | None) -> list:
        """Read ``count`` datapoints (or the whole epoch, which then becomes the cache) without yielding."""
        buffer: list = []
        end = object()
        while count is None or len(buffer) < count:
            dp = next(source, end)
            if dp is end:
                break
            buffer.append(dp)
        if count is not None and len(buffer) < count:
            raise StateMismatchError(f"rebuilding the cache read {len(buffer)} datapoints of the wrapped flow, "
                                     f"the state says {count} were delivered")
        if count is None:
            self._set_cache(buffer)
        return buffer

    def _set_cache(self, buffer: list) -> None:
        self._cache = buffer
        self._held = None
        self._order = EpochOrder(len(buffer), self.shuffle, None, "CacheData")
        self._order.reset(self.rng)

    def _fill(self, source: Iterator, buffer: list) -> Iterator:
        for dp in source:
            buffer.append(dp)
            yield dp
        self._set_cache(buffer)

    def _cached(self) -> tuple[list, EpochOrder]:
        """The filled cache and its order, which :meth:`_set_cache` sets together."""
        assert self._cache is not None and self._order is not None, "CacheData: the cache is not filled"
        return self._cache, self._order

    def _replay(self, runs: list, pos: int) -> Iterator:
        cache, order = self._cached()
        for it, _, _ in order.iters(runs, pos):
            yield from map(cache.__getitem__, it)

    def _own_state(self) -> dict:
        live = epoch_live(self)
        loose = self._loose if live else unordered_stage(self)
        if self._cache is not None:
            cache, order = self._cached()
            if loose is None:
                return {"filled": True, "child": unless_error(self._start), "pos": 0, "held": None,
                        "order": order.state(live), "rng": None}
            if self._held is None:  # the cache does not change once filled: packed once
                self._held = pack_held(cache, loose)
            return {"filled": True, "child": child_state(self.ds), "pos": 0, "held": self._held,
                    "order": order.state(live), "rng": None}
        rng = rng_state(getattr(self, "rng", None))  # the cache's shuffle will be drawn from it
        if not live:
            return {"filled": False, "child": child_state(self.ds), "pos": 0, "held": None, "order": None, "rng": rng}
        if loose is None:  # filling: the child's epoch from its start, of which len(buffer) datapoints were read
            return {"filled": False, "child": unless_error(self._start), "pos": len(self._buffer), "held": None,
                    "order": None, "rng": rng}
        return {"filled": False, "child": child_state(self.ds), "pos": len(self._buffer),
                "held": pack_held(self._buffer, loose), "order": None, "rng": rng}

    def _take_state(self, state: dict) -> None:
        if state["filled"] and state["order"] is None:
            raise StateMismatchError("the state says the cache was filled but holds no cache order")
        if state.get("held") is not None:
            want = state["order"]["n"] if state["filled"] else state["pos"]
            if len(unpack_held(state["held"])) != want:
                raise StateMismatchError(f"the state holds other than the {want} datapoints it says were read")



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

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        return self._print(iter(self.ds))

    def _print(self, source: Iterator) -> Iterator:
        for i, dp in enumerate(source):
            if i < self.num:
                log.log(self.level, "PrintData %s, datapoint %d:\n%s", self.name, i,
                        describe_datapoint(dp, self.max_depth, self.max_list))
            yield dp
