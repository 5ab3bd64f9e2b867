"""Flows that combine several flows, or reorder one: concat, join, random choice and mix, local shuffle.

State: the children's states in a list under ``"children"``, plus the flow's own position (which child
a concatenation is in, the random generator of a random choice or mix). ``LocallyShuffleData`` lives in
:mod:`bridgeflow._local_shuffle` (its buffer needs a module of its own) and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._base import DataFlow, epoch_live
from ._errors import DatapointError, LengthUnknownError
from ._iterables import as_dataflow
from ._local_shuffle import LocallyShuffleData
from ._order import iterator_position
from ._rng import RNGDataFlow
from ._state import StateMismatchError, child_state, rng_state, set_rng_state
from ._state_schema import Children, Count, Rng

__all__ = ["ConcatData", "JoinData", "LocallyShuffleData", "RandomChooseData", "RandomMixData"]


def _flows(df_lists: Sequence, who: str) -> list[DataFlow]:
    flows = list(df_lists)
    if not flows:
        raise ValueError(f"{who} needs at least one DataFlow")
    for i, df in enumerate(flows):
        if not hasattr(df, "__iter__"):
            raise TypeError(f"{who}: item {i} is a {type(df).__name__}, not a DataFlow")
    return [as_dataflow(df, who) for df in flows]


class _MultiFlow(DataFlow):
    """Shared lifecycle of flows that read from several children."""

    df_lists: list[DataFlow]

    def _on_reset(self) -> None:
        for df in self.df_lists:
            df.reset_state()
        super()._on_reset()

    def children(self) -> list[DataFlow]:
        return list(self.df_lists)

    def _children_state(self) -> list[dict]:
        return [child_state(c, i) for i, c in enumerate(self.df_lists)]

    def _rng_now(self) -> dict | None:
        return rng_state(getattr(self, "rng", None))


def _close_all(itrs: list) -> None:
    for it in itrs:
        if hasattr(it, "close"):
            it.close()


class ConcatData(_MultiFlow):
    """The flows one after another."""

    state_fields = (Count("index", lambda f: len(f.df_lists), "the number of flows"), Children())

    def __init__(self, df_lists: Sequence[DataFlow]) -> None:
        self.df_lists = _flows(df_lists, "ConcatData")
        self._index = 0  # the child being read

    def __len__(self) -> int:
        return sum(len(df) for df in self.df_lists)

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        self._index = min(resume["index"], len(self.df_lists)) if resume is not None else 0
        first = iter(self.df_lists[self._index]) if self._index < len(self.df_lists) else None
        return self._concat(first)

    def _concat(self, it: Iterator | None) -> Iterator:
        flows = self.df_lists
        while self._index < len(flows):
            yield from it if it is not None else flows[self._index]
            it = None
            self._index += 1

    def _own_state(self) -> dict:
        return {"index": self._index if epoch_live(self) else 0, "children": self._children_state()}



class JoinData(_MultiFlow):
    """Zip flows into one: list/tuple datapoints are concatenated, dict datapoints merged.

    The result is a tuple when every joined datapoint is a tuple, else a list.

    Iteration stops with the shortest flow; ``len()`` is the shortest length. A key present in two dict
    datapoints is an error rather than a silent overwrite.

    Example:
        >>> from bridgeflow import DataFromList
        >>> df = JoinData([DataFromList([[1]], shuffle=False), DataFromList([["a"]], shuffle=False)])
        >>> df.reset_state(); list(df)
        [[1, 'a']]
    """

    state_fields = (Children(),)

    def __init__(self, df_lists: Sequence[DataFlow]) -> None:
        self.df_lists = _flows(df_lists, "JoinData")

    def __len__(self) -> int:
        return min(len(df) for df in self.df_lists)

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        return self._join([iter(df) for df in self.df_lists])

    def _own_state(self) -> dict:
        return {"children": self._children_state()}


    def _join(self, itrs: list) -> Iterator:
        try:
            yield from self._zip(itrs)
        finally:
            _close_all(itrs)

    def _zip(self, itrs: list) -> Iterator:
        for parts in zip(*itrs):
            if all(isinstance(p, dict) for p in parts):
                out: dict = {}
                for p in parts:
                    for k, v in p.items():
                        if k in out:
                            raise DatapointError(f"JoinData: key {k!r} comes from two of the joined flows")
                        out[k] = v
                yield out
            elif not any(isinstance(p, dict) for p in parts):
                joined: list = []
                for p in parts:
                    joined.extend(p)
                yield tuple(joined) if all(type(p) is tuple for p in parts) else joined
            else:
                kinds = [type(p).__name__ for p in parts]
                raise DatapointError(f"JoinData cannot join dict and list datapoints together: {kinds}")


class RandomChooseData(_MultiFlow, RNGDataFlow):
    """Each datapoint from one flow picked at random (with probabilities), until any flow runs out.

    ``df_lists`` holds flows, or ``(flow, probability)`` pairs.
    """

    state_fields = (Rng("rng"), Children())

    def __init__(self, df_lists: Sequence[Any], seed: int | None = None) -> None:
        flows, probs = [], []
        for item in df_lists:
            if isinstance(item, tuple):
                flows.append(item[0])
                probs.append(float(item[1]))
            else:
                flows.append(item)
                probs.append(1.0)
        self.df_lists = _flows(flows, "RandomChooseData")
        p = np.asarray(probs, dtype=np.float64)
        if (p < 0).any() or p.sum() <= 0:
            raise ValueError(f"RandomChooseData probabilities must be >= 0 with a positive sum, got {probs}")
        self.probs = p / p.sum()
        self.seed = seed

    def __len__(self) -> int:
        raise LengthUnknownError("RandomChooseData stops when its first flow runs out; its length is random")

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        if resume is not None and resume["rng"] is not None:
            set_rng_state(self.rng, resume["rng"])
        return self._choose([iter(df) for df in self.df_lists])

    def _choose(self, itrs: list) -> Iterator:
        try:
            while True:
                k = self.rng.choice(len(itrs), p=self.probs)
                try:
                    yield next(itrs[k])
                except StopIteration:
                    return
        finally:
            _close_all(itrs)

    def _own_state(self) -> dict:
        return {"rng": self._rng_now(), "children": self._children_state()}



class RandomMixData(_MultiFlow, RNGDataFlow):
    """All datapoints of all flows, interleaved at random; every flow needs a ``len()``."""

    state_fields = (Rng("rng"), Count("pos", lambda f: len(f), "the epoch's length"), Children())

    def __init__(self, df_lists: Sequence[DataFlow], seed: int | None = None) -> None:
        self.df_lists = _flows(df_lists, "RandomMixData")
        self.seed = seed

    def __len__(self) -> int:
        return sum(len(df) for df in self.df_lists)

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        pos = 0
        if resume is not None:
            if resume["rng"] is not None:
                set_rng_state(self.rng, resume["rng"])
            pos = resume["pos"]
        self._epoch_rng = rng_state(self.rng)  # the order of this epoch is drawn from here
        sizes = [len(df) for df in self.df_lists]
        order = np.repeat(np.arange(len(sizes)), sizes)
        self.rng.shuffle(order)
        self._order = order.tolist()
        if pos > len(self._order):
            raise StateMismatchError(f"the state's position {pos} is past the epoch's {len(self._order)} "
                                     "datapoints", ["RandomMixData"])
        self._it = it = iter(self._order)
        if pos:
            it.__setstate__(pos)
        return self._mix([iter(df) for df in self.df_lists], it, sizes, resume is not None)

    def _mix(self, itrs: list, order: Iterator, sizes: list[int], resumed: bool) -> Iterator:
        try:
            for k in order:
                try:
                    yield next(itrs[k])
                except StopIteration:
                    if resumed:  # the state's position and its flows' positions disagree: a damaged state
                        raise StateMismatchError(
                            f"flow {k} ({type(self.df_lists[k]).__name__}) ran out before the state's order did: "
                            "the state's 'pos' does not match its flows' states", ["RandomMixData"]) from None
                    raise DatapointError(
                        f"RandomMixData: flow {k} ({type(self.df_lists[k]).__name__}) yielded fewer "
                        f"datapoints than its len() of {sizes[k]}") from None
        finally:
            _close_all(itrs)

    def _own_state(self) -> dict:
        if epoch_live(self):
            own = {"rng": self._epoch_rng, "pos": iterator_position(self._it, len(self._order))}
        else:
            own = {"rng": self._rng_now(), "pos": 0}
        return {**own, "children": self._children_state()}

