"""Flows that produce datapoints from Python objects: lists, generators, iterables and fake data.

All of them can save their position (``state_dict()``): a list by its epoch and position (its shuffle
is rebuilt from two integers), fake data by its random generator, a generator function or a
re-iterable by counting and skipping (those two live in :mod:`bridgeflow._iterables`, with
``as_dataflow``). A generator *object* or a one-shot iterator cannot be replayed: their ``state_dict()``
raises :class:`~bridgeflow._state.NotResumableError` saying what to pass instead.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._base import epoch_live
from ._errors import LengthUnknownError
from ._iterables import DataFromGenerator, DataFromIterable
from ._order import IndexedSource, iterator_position
from ._rng import RNGDataFlow
from ._state import rng_state, set_rng_state
from ._state_schema import Count, Rng, Same

__all__ = ["DataFromGenerator", "DataFromIterable", "DataFromList", "FakeData"]


class DataFromList(IndexedSource):
    """Datapoints from a list (or any sequence), optionally shuffled every epoch.

    ``shard=(rank, world)`` or ``"auto"`` reads only this rank's part (see :mod:`bridgeflow._shard`):
    every rank then needs the same ``seed``; ``set_epoch(n)`` picks epoch ``n``'s order. Its state is
    the epoch and the position in it (see :mod:`bridgeflow._order`).

    Example:
        >>> df = DataFromList([[0, "a"], [1, "b"]], shuffle=False)
        >>> df.reset_state(); list(df)
        [[0, 'a'], [1, 'b']]
    """

    def __init__(self, lst: Sequence, shuffle: bool = True, seed: int | None = None, *,
                 shard: tuple[int, int] | str | None = None, drop_last: bool = False) -> None:
        if not hasattr(lst, "__len__") or not hasattr(lst, "__getitem__"):
            raise TypeError(f"DataFromList needs a sequence, got {type(lst).__name__}; use DataFromIterable")
        self.lst = lst
        self.shuffle = shuffle
        self.seed = seed
        self._init_order(len(lst), shuffle, shard, drop_last)

    def __len__(self) -> int:
        return self._order.length() if self._order.shard is not None else len(self.lst)

    def __getitem__(self, index: int) -> Any:
        if self._order.shard is None:
            return self.lst[index]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"DataFromList index {index} out of range for this rank's {n} datapoints")
        return self.lst[self._order.shard_index(index % n)]

    def _sync_length(self) -> None:
        if len(self.lst) != self._order.n:  # the list grew or shrank since: read it as it is now
            self._order.n = len(self.lst)

    def _read(self, runs: list, pos: int) -> Iterator:
        lst = self.lst
        if not self.shuffle and self._order.shard is None and type(lst) in (list, tuple):
            yield from self._order.items(lst, pos)
            return
        get = lst.__getitem__
        for it, _, _ in self._order.iters(runs, pos):
            yield from map(get, it)


def _as_dtypes(dtype: Any, n: int) -> list[np.dtype]:
    if isinstance(dtype, (list, tuple)):
        if len(dtype) != n:
            raise ValueError(f"FakeData got {len(dtype)} dtypes for {n} shapes")
        return [np.dtype(d) for d in dtype]
    return [np.dtype(dtype)] * n


class FakeData(RNGDataFlow):
    """Random (or constant) arrays of given shapes: a source that costs almost nothing, to time the rest.

    Args:
        shapes: one shape per component, e.g. ``[[3, 224, 224], [1]]``.
        size: datapoints per epoch; ``None`` for a never-ending flow.
        random: new random values for every datapoint; ``False`` repeats one fixed datapoint (the
            arrays are shared and read-only), which isolates the cost of what follows.
        dtype: one dtype, or one per component.
        domain: ``(low, high)`` of the values, inclusive for integers. Default: ``[0, 1)`` for floats,
            the dtype's whole range for integers (0-255 for uint8).
        seed: for reproducible values.
    """

    state_fields = (Same("size", "_size", "the state is for size={saved}, this flow has size={have}"), Rng("rng"),
                    Rng("fixed"), Count("pos", "_size", "the epoch's length"))

    def __init__(self, shapes: Sequence[Sequence[int]], size: int | None = 1000, random: bool = True,
                 dtype: Any = "float32", domain: tuple[float, float] | None = None,
                 seed: int | None = None) -> None:
        if size is not None and size < 0:
            raise ValueError(f"FakeData size must be >= 0 or None, got {size}")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self._size = size  # not ``self.size``: that would hide DataFlow.size(), tensorpack's len(df)
        self.random = random
        self.dtypes = _as_dtypes(dtype, len(self.shapes))
        self.domain = domain
        self.seed = seed
        self._fixed: list[np.ndarray] | None = None
        self._it: Iterator[int] = iter(range(0))
        self._start = 0

    def __len__(self) -> int:
        if self._size is None:
            raise LengthUnknownError("FakeData(size=None) never ends")
        return self._size

    def _make(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            lo, hi = (max(int(self.domain[0]), info.min), min(int(self.domain[1]), info.max)) if self.domain \
                else (max(info.min, -(2**62)), min(info.max, 2**62))
            if dtype == np.uint8 and (lo, hi) == (0, 255):  # random bytes: ~10x faster than randint
                n = int(np.prod(shape, dtype=np.int64))
                return np.frombuffer(bytearray(self.rng.bytes(n)), dtype=np.uint8).reshape(shape)
            return self.rng.randint(lo, hi + 1, size=shape, dtype=dtype)
        if dtype.kind == "b":
            return self.rng.randint(0, 2, size=shape).astype(bool)
        low, high = self.domain or (0.0, 1.0)
        return self.rng.uniform(low, high, size=shape).astype(dtype, copy=False)

    def _seed_random(self) -> None:
        super()._seed_random()
        self._fixed_rng = rng_state(self.rng) if not self.random else None
        self._make_fixed()

    def _make_fixed(self) -> None:
        if not self.random:
            self._fixed = [self._make(s, d) for s, d in zip(self.shapes, self.dtypes)]
            for a in self._fixed:
                a.flags.writeable = False

    def _begin_epoch(self, resume: dict | None) -> Iterator[list[np.ndarray]]:
        start = 0
        if resume is not None:
            if resume["fixed"] is not None:  # the same fixed arrays as the run that saved the state
                set_rng_state(self.rng, resume["fixed"])
                self._fixed_rng = resume["fixed"]
                self._make_fixed()
            if resume["rng"] is not None:
                set_rng_state(self.rng, resume["rng"])
            start = resume["pos"]
        it = iter(range(start, self._size if self._size is not None else sys.maxsize))
        self._it, self._start = it, start
        return self._produce(it)

    def _produce(self, it: Iterator[int]) -> Iterator[list[np.ndarray]]:
        fixed = self._fixed
        if fixed is not None:
            for _ in it:
                yield list(fixed)
            return
        make, specs = self._make, list(zip(self.shapes, self.dtypes))
        for _ in it:
            yield [make(s, d) for s, d in specs]

    def _own_state(self) -> dict:
        """The random generator's state now and the position in the epoch (datapoints are not replayed)."""
        end = self._size if self._size is not None else sys.maxsize
        pos = self._start + iterator_position(self._it, end - self._start) if epoch_live(self) else 0
        return {"size": self._size, "rng": rng_state(getattr(self, "rng", None)),
                "fixed": self.__dict__.get("_fixed_rng"), "pos": pos}
