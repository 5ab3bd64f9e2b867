"""Flows that combine several flows, or reorder one: concat, join, random choice and mix, local shuffle."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .base import DataFlow, ProxyDataFlow, RNGDataFlow, as_dataflow
from .errors import DatapointError, LengthUnknownError

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

    def reset_state(self) -> None:
        for df in self.df_lists:
            df.reset_state()

    def children(self) -> list[DataFlow]:
        return list(self.df_lists)


class ConcatData(_MultiFlow):
    """The flows one after another."""

    def __init__(self, df_lists: Sequence[DataFlow]) -> None:
        self.df_lists = _flows(df_lists, "ConcatData")

    def __len__(self) -> int:
        return sum(len(df) for df in self.df_lists)

    def __iter__(self) -> Iterator:
        for df in self.df_lists:
            yield from df


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

    def __init__(self, df_lists: Sequence[DataFlow]) -> None:
        self.df_lists = _flows(df_lists, "JoinData")

    def __len__(self) -> int:
        return min(len(df) for df in self.df_lists)

    def __iter__(self) -> Iterator:
        for parts in zip(*self.df_lists):
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

    def reset_state(self) -> None:
        _MultiFlow.reset_state(self)
        RNGDataFlow.reset_state(self)

    def __len__(self) -> int:
        raise LengthUnknownError("RandomChooseData stops when its first flow runs out; its length is random")

    def __iter__(self) -> Iterator:
        itrs = [iter(df) for df in self.df_lists]
        try:
            while True:
                k = self.rng.choice(len(itrs), p=self.probs)
                try:
                    yield next(itrs[k])
                except StopIteration:
                    return
        finally:
            for it in itrs:
                if hasattr(it, "close"):
                    it.close()


class RandomMixData(_MultiFlow, RNGDataFlow):
    """All datapoints of all flows, interleaved at random; every flow needs a ``len()``."""

    def __init__(self, df_lists: Sequence[DataFlow], seed: int | None = None) -> None:
        self.df_lists = _flows(df_lists, "RandomMixData")
        self.seed = seed

    def reset_state(self) -> None:
        _MultiFlow.reset_state(self)
        RNGDataFlow.reset_state(self)

    def __len__(self) -> int:
        return sum(len(df) for df in self.df_lists)

    def __iter__(self) -> Iterator:
        sizes = [len(df) for df in self.df_lists]
        order = np.repeat(np.arange(len(sizes)), sizes)
        self.rng.shuffle(order)
        itrs = [iter(df) for df in self.df_lists]
        try:
            for k in order:
                try:
                    yield next(itrs[k])
                except StopIteration:
                    raise DatapointError(
                        f"RandomMixData: flow {k} ({type(self.df_lists[k]).__name__}) yielded fewer "
                        f"datapoints than its len() of {sizes[k]}") from None
        finally:
            for it in itrs:
                if hasattr(it, "close"):
                    it.close()


class LocallyShuffleData(ProxyDataFlow, RNGDataFlow):
    """Shuffle within a sliding buffer: good mixing of a sequential source without reading it all.

    Each incoming datapoint swaps with a random one in a buffer of ``buffer_size``, which is emitted;
    at the end of the epoch the buffer drains in random order. Each datapoint is emitted ``num_reuse``
    times. ``shuffle_interval`` is accepted for tensorpack compatibility and has no effect: this buffer
    reshuffles on every datapoint.
    """

    def __init__(self, ds: DataFlow, buffer_size: int, num_reuse: int = 1, shuffle_interval: Any = None,
                 seed: int | None = None) -> None:
        ProxyDataFlow.__init__(self, ds)
        if buffer_size <= 0:
            raise ValueError(f"LocallyShuffleData buffer_size must be positive, got {buffer_size}")
        if num_reuse <= 0:
            raise ValueError(f"LocallyShuffleData num_reuse must be positive, got {num_reuse}")
        self.buffer_size = int(buffer_size)
        self.num_reuse = int(num_reuse)
        self.seed = seed

    def reset_state(self) -> None:
        ProxyDataFlow.reset_state(self)
        RNGDataFlow.reset_state(self)

    def __len__(self) -> int:
        return len(self.ds) * self.num_reuse

    def __iter__(self) -> Iterator:
        buf: list = []
        size, rng = self.buffer_size, self.rng
        for dp in self.ds:
            for _ in range(self.num_reuse):
                if len(buf) < size:
                    buf.append(dp)
                    continue
                k = rng.randint(size)
                out, buf[k] = buf[k], dp
                yield out
        rng.shuffle(buf)
        yield from buf
