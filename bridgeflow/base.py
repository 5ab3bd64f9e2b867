"""The DataFlow contract: a length-free, resettable, closable iterable of datapoints.

A *datapoint* is a list/tuple of components or a dict of named components. A flow is any object with
``__iter__`` yielding datapoints; this module gives the lifecycle around it:

- ``reset_state()`` is called once, in the process (and thread) that will iterate, before the first
  ``__iter__``. RNGs are seeded there and parallel flows start their workers there. If a consumer forgets,
  the first ``__iter__`` calls it.
- ``__len__`` is optional. A flow that cannot know its length raises :class:`LengthUnknownError`, a
  ``TypeError``, so ``list(df)`` still works.
- ``close()`` releases whatever the flow holds (threads, processes, shared memory, files). It is
  idempotent, recurses through wrapped flows, and runs on ``with`` exit.
- One flow may not be iterated by two consumers at once: the second ``iter()`` raises
  :class:`DataFlowReentrantError` until the first iterator is exhausted, closed or garbage-collected.

Example:
    >>> from bridgeflow import DataFromList, MapData
    >>> with MapData(DataFromList([[1], [2]], shuffle=False), lambda dp: [dp[0] * 10]) as df:
    ...     df.reset_state()
    ...     [dp for dp in df]
    [[10], [20]]
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .errors import DataFlowReentrantError, LengthUnknownError

__all__ = [
    "DataFlow", "ProxyDataFlow", "RNGDataFlow", "as_dataflow", "get_rng", "iter_flows", "worker_seed_scope",
]

log = logging.getLogger(__name__)

Datapoint = Any  # list | tuple | dict of components


def _guard_iter(original):
    """Wrap a subclass's ``__iter__`` with auto-reset and the one-consumer-at-a-time guard.

    The guard acts only for the ``__iter__`` that ``iter(obj)`` resolves to; a subclass calling
    ``super().__iter__()`` reaches the parent's original generator unguarded.
    """

    @functools.wraps(original)
    def __iter__(self):
        if type(self).__iter__ is not __iter__:  # a super() call from a subclass
            return original(self)
        if not self._bf_reset_done:
            log.debug("%s iterated before reset_state(); resetting it now", type(self).__name__)
            self.reset_state()
        if self._bf_iterating is not None:
            raise _reentrant(self)
        return _guarded(self, original(self))

    __iter__._bf_guarded = True
    return __iter__


def _reentrant(flow: DataFlow) -> DataFlowReentrantError:
    return DataFlowReentrantError(
        f"{type(flow).__name__} is already being iterated by another consumer; finish, close() or "
        "drop the first iterator before starting a second one (wrap the flow twice to read it twice)"
    )


_claim_lock = threading.Lock()


def _guarded(flow: DataFlow, it: Iterator) -> Iterator:
    # The flow counts as iterated from this iterator's first next() until it ends, is closed or is
    # collected. The check is repeated here because two iterators may both be created before either
    # starts: the second to start is refused. A never-started iterator holds nothing (its finally
    # would never run), so it cannot block the flow forever.
    token = object()
    try:
        with _claim_lock:  # check-and-set as one step (free-threaded Python switches anywhere)
            if flow._bf_iterating is not None:
                raise _reentrant(flow)
            flow._bf_iterating = token
        yield from it
    finally:
        if flow._bf_iterating is token:
            flow._bf_iterating = None
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _mark_reset(original):
    @functools.wraps(original)
    def reset_state(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        self._bf_reset_done = True
        return result

    reset_state._bf_marks_reset = True
    return reset_state


class DataFlow:
    """Base class of every flow. Subclasses implement ``__iter__`` and, when they can, ``__len__``."""

    _bf_reset_done = False
    _bf_iterating: object | None = None  # the token of the running guarded iterator, if any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        it = cls.__dict__.get("__iter__")
        if it is not None and not getattr(it, "_bf_guarded", False):
            cls.__iter__ = _guard_iter(it)
        rs = cls.__dict__.get("reset_state")
        if rs is not None and not getattr(rs, "_bf_marks_reset", False):
            cls.reset_state = _mark_reset(rs)

    def __iter__(self) -> Iterator[Datapoint]:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")

    def __len__(self) -> int:
        raise LengthUnknownError(f"{type(self).__name__} has no known length; iterate it to count")

    def reset_state(self) -> None:
        """Prepare to iterate in this process: seed RNGs, open files, start workers. Called once."""
        self._bf_reset_done = True

    def close(self) -> None:
        """Release threads, processes, shared memory and files. Idempotent; recursive through children."""
        seen: set[int] = set()
        for child in self.children():
            if id(child) in seen:  # the same flow read twice (ConcatData([a, a])) is closed once
                continue
            seen.add(id(child))
            close = getattr(child, "close", None)  # a duck-typed (tensorpack-style) flow may have none
            if close is not None:
                close()

    def children(self) -> list[DataFlow]:
        """The flows this one reads from (used by ``close()``, ``stats`` collection and ``PrintData``)."""
        return []

    def stats(self) -> dict[str, float]:
        """Counters that help find the bottleneck (queue fill, wait times). Empty for plain flows."""
        return {}

    def get_data(self) -> Iterator[Datapoint]:
        """tensorpack's older spelling of ``iter(df)``."""
        return iter(self)

    def size(self) -> int:
        """tensorpack's older spelling of ``len(df)``."""
        return len(self)

    def __enter__(self) -> DataFlow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # A copy (sent to a worker) starts fresh: not reset, not being iterated.
        state = self.__dict__.copy()
        state.pop("_bf_reset_done", None)
        state.pop("_bf_iterating", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def as_dataflow(ds: Any, who: str = "DataFlow") -> DataFlow:
    """``ds`` itself if it is a flow (a DataFlow, or any object with ``__iter__`` and ``reset_state``);
    a plain iterable (a list, a generator) wrapped in ``DataFromIterable``; else a ``TypeError``."""
    if isinstance(ds, DataFlow) or (hasattr(ds, "__iter__") and hasattr(ds, "reset_state")):
        return ds
    if not hasattr(ds, "__iter__"):
        raise TypeError(f"{who} wraps a DataFlow or iterable, got {type(ds).__name__}")
    from .sources import DataFromIterable  # sources imports this module

    return DataFromIterable(ds)


class ProxyDataFlow(DataFlow):
    """A flow that wraps one other flow, ``self.ds``; by default it forwards everything to it."""

    def __init__(self, ds: DataFlow) -> None:
        self.ds = as_dataflow(ds, type(self).__name__)

    def reset_state(self) -> None:
        self.ds.reset_state()

    def __len__(self) -> int:
        return len(self.ds)

    def __iter__(self) -> Iterator[Datapoint]:
        return iter(self.ds)

    def children(self) -> list[DataFlow]:
        return [self.ds]


# --- random number generators -------------------------------------------------------------------

_seed_local = threading.local()


class worker_seed_scope:
    """Within this scope, ``get_rng`` derives generators from ``seed`` (used by parallel workers).

    Parallel stages enter it in each worker, with a distinct seed, around ``reset_state()`` of the
    worker's copy of the flow, so two workers never draw the same random stream.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def __enter__(self) -> worker_seed_scope:
        self._prev = getattr(_seed_local, "seed", None)
        _seed_local.seed = self.seed
        return self

    def __exit__(self, *exc: object) -> None:
        _seed_local.seed = self._prev


def get_rng(obj: object = None, seed: int | None = None) -> np.random.RandomState:
    """A ``RandomState`` for ``obj``: reproducible when ``seed`` is given, distinct per worker.

    With ``seed=None`` outside a worker the generator is seeded from OS entropy. Inside a worker scope
    the worker's seed is mixed in, so copies of one flow in different workers draw different streams
    while staying reproducible for a fixed ``seed``.
    """
    worker = getattr(_seed_local, "seed", None)
    if seed is None and worker is None:
        return np.random.RandomState(int(np.random.SeedSequence().generate_state(1)[0]))
    entropy = 0 if seed is None else int(seed) & 0xFFFFFFFFFFFFFFFF
    # The worker goes into the spawn key, not the entropy list: SeedSequence pads entropy with zeros,
    # so [seed, 0] would equal [seed] and worker 0 would repeat the consumer's stream.
    spawn_key = () if worker is None else (int(worker) & 0xFFFFFFFFFFFFFFFF, int(seed is None))
    state = np.random.SeedSequence(entropy, spawn_key=spawn_key).generate_state(1)[0]
    return np.random.RandomState(int(state))


class RNGDataFlow(DataFlow):
    """A flow with ``self.rng``, a ``numpy.random.RandomState`` seeded in ``reset_state()``.

    Set ``self.seed`` (subclasses take a ``seed=`` argument) for reproducible output.
    """

    seed: int | None = None
    rng: np.random.RandomState

    def reset_state(self) -> None:
        self.rng = get_rng(self, self.seed)


def iter_flows(df: DataFlow, prefix: str = "") -> Iterator[tuple[str, DataFlow]]:
    """Walk a pipeline depth-first, yielding ``(path, flow)``; the path reads like ``Batch/Map/List``."""
    seen: set[int] = set()

    def walk(node: Any, path: str) -> Iterator[tuple[str, DataFlow]]:
        if id(node) in seen:
            return
        seen.add(id(node))
        name = f"{path}/{type(node).__name__}" if path else type(node).__name__
        yield name, node
        children = node.children() if isinstance(node, DataFlow) else []
        for child in children:
            yield from walk(child, name)

    yield from walk(df, prefix)
