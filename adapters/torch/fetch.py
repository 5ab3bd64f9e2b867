"""Turning sampler output into batches: the fetchers, and the task function each worker runs.

A fetcher reads one task's samples from the dataset and collates them, with torch's semantics:

- map-style: the task is a list of indices (``dataset.__getitems__`` is used when the dataset has one)
  or, without auto-batching, one index;
- iterable: the task is a list of placeholders, one per sample to take from the worker's own iterator;
  a short last batch is kept unless ``drop_last``; an empty one ends the worker's stream;
- collate: the task carries the samples themselves (a bridgeflow DataFlow is iterated in the consumer and
  only collation runs in the workers).

:func:`init_worker` is the pool's ``init_fn``: it seeds ``random``, ``torch`` and ``numpy`` and sets
``torch.utils.data.get_worker_info()`` as torch's worker loop does, runs ``worker_init_fn``, and returns the
task function. An error in ``worker_init_fn`` or in ``iter(dataset)`` is raised by that worker's first task,
which is where torch reports it too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _compat
from ._compat import torch
from .convert import pack

__all__ = [
    "COLLATE",
    "ITERABLE",
    "MAP",
    "Fetcher",
    "FastCollate",
    "Reset",
    "StopFromDataset",
    "WorkerSpec",
    "init_worker",
    "make_fetcher",
    "resolve_collate",
]

MAP, ITERABLE, COLLATE = "map", "iterable", "collate"


class Fetcher:
    """Reads and collates the samples of one task."""

    def __init__(self, kind: str, dataset: Any, auto_collation: bool, collate_fn: Callable,
                 drop_last: bool) -> None:
        self.kind = kind
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.ended = False
        self.iterator = iter(dataset) if kind == ITERABLE else None

    def fetch(self, task: Any) -> Any:
        if self.kind == MAP:
            data = self._read_map(task)
        elif self.kind == ITERABLE:
            data = self._read_iterable(task)
        else:
            data = task
        return self.collate_fn(data)

    def _read_map(self, task: Any) -> Any:
        if not self.auto_collation:
            return self.dataset[task]
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:
            return getitems(task)
        return [self.dataset[i] for i in task]

    def _read_iterable(self, task: Any) -> Any:
        if self.ended:
            raise StopIteration
        if not self.auto_collation:
            return next(self.iterator)
        samples = []
        for _ in task:
            try:
                samples.append(next(self.iterator))
            except StopIteration:
                self.ended = True
                break
        if not samples or (self.drop_last and len(samples) < len(task)):
            raise StopIteration
        return samples


def make_fetcher(kind: str, dataset: Any, auto_collation: bool, collate_fn: Callable,
                 drop_last: bool) -> Fetcher:
    return Fetcher(kind, dataset, auto_collation, collate_fn, drop_last)


@dataclass
class WorkerSpec:
    """Everything a worker needs; pickled once per worker under spawn/forkserver."""

    kind: str
    dataset: Any
    auto_collation: bool
    collate_fn: Callable
    drop_last: bool
    base_seed: int
    num_workers: int
    worker_init_fn: Callable[[int], None] | None = None


class Reset:
    """Task that restarts a persistent worker's fetcher for a new epoch (a fresh ``iter(dataset)``)."""

    __slots__ = ()

    def __reduce__(self):
        return (Reset, ())


class StopFromDataset:
    """Result standing for a ``StopIteration`` raised by a map-style dataset (torch re-raises it)."""

    __slots__ = ()

    def __reduce__(self):
        return (StopFromDataset, ())


class FastCollate:
    """torch's ``default_collate``, same output, faster (see ``_compat.fast_default_collate``).

    In a worker it also runs with the worker info hidden: there torch's collate would stack into a fresh
    torch shared-memory segment per batch, while bridgeflow's transport already moves the batch through
    reused shared memory.
    """

    def __init__(self, in_worker: bool) -> None:
        self.in_worker = in_worker

    def __call__(self, data: Any) -> Any:
        if not self.in_worker:
            return _compat.fast_default_collate(data)
        with _compat.worker_info_suspended():
            return _compat.fast_default_collate(data)


def resolve_collate(fn: Callable, in_worker: bool) -> Callable:
    """The function that really collates: :class:`FastCollate` stands in for torch's default collate."""
    return FastCollate(in_worker) if fn is _compat.default_collate else fn


class _WorkerTask:
    """The task function of one worker: holds its fetcher and a pending start-up error."""

    def __init__(self, spec: WorkerSpec, worker_id: int) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.error: BaseException | None = None
        self.fetcher: Fetcher | None = None
        self.failed: BaseException | None = None  # the start-up error, once reported
        self.collate_fn = resolve_collate(spec.collate_fn, in_worker=True)
        try:
            if spec.worker_init_fn is not None:
                spec.worker_init_fn(worker_id)
            self.fetcher = self._new_fetcher()
        except Exception as exc:
            self.error = exc

    def _new_fetcher(self) -> Fetcher:
        s = self.spec
        return make_fetcher(s.kind, s.dataset, s.auto_collation, self.collate_fn, s.drop_last)

    def __call__(self, task: Any) -> Any:
        if isinstance(task, Reset):  # a new epoch of persistent workers: a fresh iter(dataset), as torch
            try:
                self.fetcher = self._new_fetcher()
            except Exception as exc:  # reported by this worker's first batch, as at start-up
                self.fetcher = None
                self.error = self.error or exc
            return None
        if self.error is not None:
            error, self.error = self.error, None
            self.failed = error
            raise error
        if self.fetcher is None:
            if self.spec.kind == ITERABLE:  # its stream ended with that error: the worker is exhausted
                raise StopIteration
            raise RuntimeError(
                f"DataLoader worker {self.worker_id} cannot load data: its start-up failed earlier with "
                f"{self.failed!r} (raised with its first batch)") from self.failed
        try:
            data = self.fetcher.fetch(task)
        except StopIteration:
            if self.spec.kind == ITERABLE:
                raise
            return StopFromDataset()
        return pack(data)


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed ``random``, ``torch`` and ``numpy`` as torch's worker loop does; returns the worker seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_compat.numpy_seed(base_seed, worker_id))
    return seed


def init_worker(spec: WorkerSpec, ctx: Any) -> Callable[[Any], Any]:
    """The pool's ``init_fn``: runs once in each worker and returns its task function.

    Example:
        >>> import functools                                   # doctest: +SKIP
        >>> WorkerPool(functools.partial(init_worker, spec), 2)  # doctest: +SKIP
    """
    torch.set_num_threads(1)
    seed = seed_worker(spec.base_seed, ctx.worker_id)
    _compat.set_worker_info(ctx.worker_id, spec.num_workers, seed, spec.dataset)
    return _WorkerTask(spec, ctx.worker_id)
