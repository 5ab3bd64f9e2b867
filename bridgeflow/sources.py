"""Flows that produce datapoints from Python objects: lists, generators, iterables and fake data."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from .base import DataFlow, RNGDataFlow
from .errors import LengthUnknownError

__all__ = ["DataFromGenerator", "DataFromIterable", "DataFromList", "FakeData"]


class DataFromList(RNGDataFlow):
    """Datapoints from a list (or any sequence), optionally shuffled every epoch.

    Example:
        >>> df = DataFromList([[0, "a"], [1, "b"]], shuffle=False)
        >>> df.reset_state(); list(df)
        [[0, 'a'], [1, 'b']]
    """

    def __init__(self, lst: Sequence, shuffle: bool = True, seed: int | None = None) -> None:
        if not hasattr(lst, "__len__") or not hasattr(lst, "__getitem__"):
            raise TypeError(f"DataFromList needs a sequence, got {type(lst).__name__}; use DataFromIterable")
        self.lst = lst
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lst)

    def __getitem__(self, index: int) -> Any:
        return self.lst[index]

    def __iter__(self) -> Iterator:
        if not self.shuffle:
            yield from self.lst
            return
        lst = self.lst
        for i in self.rng.permutation(len(lst)):
            yield lst[i]


class DataFromGenerator(DataFlow):
    """Datapoints from a generator function, called anew for every epoch.

    A generator *object* can be passed too, but it can be iterated only once (a second epoch raises).
    ``size`` gives ``len()`` when the generator's length is known.
    """

    def __init__(self, gen: Callable[[], Iterable] | Iterator, size: int | None = None) -> None:
        if not callable(gen) and not inspect.isgenerator(gen) and not hasattr(gen, "__next__"):
            raise TypeError(f"DataFromGenerator needs a generator function or generator, got {gen!r}")
        self._gen = gen
        self._size = size
        self._used = False

    def __len__(self) -> int:
        if self._size is None:
            raise LengthUnknownError("DataFromGenerator has no known length; pass size= to give one")
        return self._size

    def __iter__(self) -> Iterator:
        if callable(self._gen):
            yield from self._gen()
            return
        if self._used:
            raise RuntimeError("DataFromGenerator got a generator object, which can be iterated only once; "
                               "pass the generator function instead to iterate several epochs")
        self._used = True
        yield from self._gen


class DataFromIterable(DataFlow):
    """Datapoints from any iterable; ``len()`` is the iterable's when it has one."""

    def __init__(self, iterable: Iterable) -> None:
        if not hasattr(iterable, "__iter__"):
            raise TypeError(f"DataFromIterable needs an iterable, got {type(iterable).__name__}")
        self._itr = iterable

    def __len__(self) -> int:
        try:
            return len(self._itr)  # type: ignore[arg-type]
        except TypeError:
            raise LengthUnknownError(
                f"the {type(self._itr).__name__} given to DataFromIterable has no len()") from None

    def __iter__(self) -> Iterator:
        yield from self._itr


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

    def __init__(self, shapes: Sequence[Sequence[int]], size: int | None = 1000, random: bool = True,
                 dtype: Any = "float32", domain: tuple[float, float] | None = None,
                 seed: int | None = None) -> None:
        if size is not None and size < 0:
            raise ValueError(f"FakeData size must be >= 0 or None, got {size}")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.size = size
        self.random = random
        self.dtypes = _as_dtypes(dtype, len(self.shapes))
        self.domain = domain
        self.seed = seed
        self._fixed: list[np.ndarray] | None = None

    def __len__(self) -> int:
        if self.size is None:
            raise LengthUnknownError("FakeData(size=None) never ends")
        return self.size

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

    def reset_state(self) -> None:
        super().reset_state()
        if not self.random:
            self._fixed = [self._make(s, d) for s, d in zip(self.shapes, self.dtypes)]
            for a in self._fixed:
                a.flags.writeable = False

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        n = 0
        while self.size is None or n < self.size:
            if self._fixed is not None:
                yield list(self._fixed)
            else:
                yield [self._make(s, d) for s, d in zip(self.shapes, self.dtypes)]
            n += 1
