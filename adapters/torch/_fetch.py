"""Turning sampler output into batches: the fetchers, and the task function each worker runs.

A fetcher reads one task's samples from the dataset and collates them, with torch's semantics:

- map-style: the task is a list of indices (``dataset.__getitems__`` is used when the dataset has one)
  or, without auto-batching, one index;
- iterable: the task is a list of placeholders, one per sample to take from the worker's own iterator;
  a short last batch is kept unless ``drop_last``; an empty one ends the worker's stream;
- collate: the task carries the samples themselves (a bridgeflow DataFlow is iterated in the consumer and
  only collation runs in the workers).

A dataset (or the iterator ``iter(dataset)`` returns) with ``state_dict()``/``load_state_dict()`` has its
state read after each batch (:meth:`Fetcher.state`) and sent along with it (:class:`~._result.Result`'s
``state``), and restored when a fetcher is made from a saved state: torchdata's convention.

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

from bridgeflow.engine import collating

from . import _compat, _convert
from ._compat import torch
from ._result import BATCH, ENDED, SKIPPED, STARTED, STOPPED, Result
from ._sample_seeds import SeededTask, Seeder
from ._state import is_stateful

__all__ = [
    "COLLATE",
    "ITERABLE",
    "MAP",
    "Fetcher",
    "FastCollate",
    "Reset",
    "WorkerSpec",
    "WorkerTask",
    "close_source",
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
        self.stateful = is_stateful(dataset) or (self.iterator is not None and is_stateful(self.iterator))
        # A bridgeflow reader (its samples reach the collation untouched), collated as torch's default: it may read
        # a batch's arrays straight into the rows of the batch (the worker's shared memory), taken as they are
        self.rows = (kind == MAP and auto_collation and getattr(type(dataset), "samples_untouched", False)
                     and isinstance(collate_fn, FastCollate))

    def state(self) -> dict | None:
        """The dataset's and its iterator's states (torchdata's convention), None when neither has one."""
        if not self.stateful:
            return None
        it = self.iterator
        own = is_stateful(self.dataset) and (it is None or it is not self.dataset)
        return {"dataset": self.dataset.state_dict() if own else None,
                "iter": it.state_dict() if it is not None and is_stateful(it) else None, "ended": self.ended}

    def fetch(self, task: Any) -> Any:
        return self.collate_fn(self.read(task))

    def read(self, task: Any, seeder: Seeder | None = None) -> Any:
        """The task's samples, not yet collated; ``seeder`` reads each with its seeds (seed_per_sample)."""
        if self.kind == MAP:
            return self._read_map(task) if seeder is None else self._read_map_seeded(task, seeder)
        if self.kind == ITERABLE:
            return self._read_iterable(task, seeder)
        return task

    def _read_map(self, task: Any) -> Any:
        if not self.auto_collation:
            return self.dataset[task]
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:
            return getitems(task)
        return [self.dataset[i] for i in task]

    def _read_map_seeded(self, task: Any, seeder: Seeder) -> Any:
        get = self.dataset.__getitem__
        if not self.auto_collation:
            return seeder(0, get, task)
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:  # one call for the batch: seeded once
            return seeder(0, getitems, task)
        return [seeder(j, get, i) for j, i in enumerate(task)]

    def _read_iterable(self, task: Any, seeder: Seeder | None = None) -> Any:
        if self.ended:
            raise StopIteration
        it = self.iterator
        assert it is not None  # made in __init__ for an ITERABLE fetcher
        if not self.auto_collation:
            return next(it) if seeder is None else seeder(0, next, it)
        samples = []
        for j in range(len(task)):
            try:
                samples.append(next(it) if seeder is None else seeder(j, next, it))
            except StopIteration:
                self.ended = True
                break
        if not samples or (self.drop_last and len(samples) < len(task)):
            raise StopIteration
        return samples


def close_source(fetcher: Fetcher | None) -> None:
    """End the iteration a fetcher holds (a DataFlow's generator releases the flow for its next reader)."""
    close = getattr(getattr(fetcher, "iterator", None), "close", None)
    if close is not None:
        close()


def make_fetcher(kind: str, dataset: Any, auto_collation: bool, collate_fn: Callable, drop_last: bool,
                 saved: dict | None = None) -> Fetcher:
    """A fetcher; ``saved`` (from :meth:`Fetcher.state`) restores the dataset before ``iter(dataset)`` and
    the iterator after, as torchdata does."""
    if saved is not None and saved.get("dataset") is not None:
        dataset.load_state_dict(saved["dataset"])
    fetcher = Fetcher(kind, dataset, auto_collation, collate_fn, drop_last)
    if saved is not None and saved.get("iter") is not None:
        if fetcher.iterator is None:
            raise ValueError(f"a saved dataset state holds an iterator's state, but this {kind} dataset is not "
                             "read through an iterator")
        fetcher.iterator.load_state_dict(saved["iter"])
    if saved is not None and saved.get("ended"):  # the stream ran out while the last batch was read
        fetcher.ended = True
    return fetcher


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
    shared_seed: int | None = None  # a DataPipe's shuffle seed for this epoch
    world_size: int = 1  # torch.distributed settings, for DataPipe sharding
    rank: int = 0
    saved: list | None = None  # per worker, the dataset state to resume from (Fetcher.state)
    skip: bool = False  # on_error="skip": a sample whose __getitem__ raises is left out of its batch

    def __getstate__(self) -> dict:  # to a spawn or forkserver worker: a DataPipe travels as torch's loader sends it
        return dict(self.__dict__, dataset=_compat.pipe_for_workers(self.dataset))

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, dataset=_compat.pipe_from_parent(state["dataset"]))


class Reset:
    """Task that restarts a persistent worker's fetcher for a new epoch (a fresh ``iter(dataset)``); its
    result (``STARTED``) holds the worker's dataset state at the start of that epoch."""

    __slots__ = ("shared_seed",)

    def __init__(self, shared_seed: int | None = None) -> None:
        self.shared_seed = shared_seed

    def __reduce__(self):
        return (Reset, (self.shared_seed,))


class FastCollate:
    """torch's ``default_collate``, same output, faster (see ``_compat.fast_default_collate``).

    In a worker it stacks into ``alloc(shape, dtype)``: the shared-memory slab the batch is sent in (see
    :meth:`~bridgeflow.parallel._transport.shm.SlabWriter.alloc`), as torch's workers stack into shared memory. It
    runs with the worker info hidden, or torch's collate would make a shared-memory segment of its own.
    """

    def __init__(self, in_worker: bool, alloc: Callable | None = None) -> None:
        self.in_worker = in_worker
        self.alloc = alloc

    def __call__(self, data: Any) -> Any:
        if not self.in_worker:
            return _compat.fast_default_collate(data)
        with _compat.worker_info_suspended():
            return _compat.fast_default_collate(data, self.alloc)


def resolve_collate(fn: Callable, in_worker: bool, alloc: Callable | None = None) -> Callable:
    """The function that really collates: :class:`FastCollate` stands in for torch's default collate."""
    return FastCollate(in_worker, alloc) if fn is _compat.default_collate else fn


class WorkerTask:
    """The task function of one worker (``in_worker``), or of the in-process reader of ``num_workers=0``
    (no ``worker_init_fn``, collation as outside workers, batches returned as they are): holds its fetcher
    and a pending start-up error. In a worker, ``writer`` is its result writer: batches are collated into
    the shared memory they are sent in, and tensors are sent out of band (:func:`._convert.install`)."""

    def __init__(self, spec: WorkerSpec, worker_id: int, dataset: Any, in_worker: bool = True,
                 writer: Any = None) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.dataset = dataset
        self.in_worker = in_worker
        self.error: BaseException | None = None
        self.fetcher: Fetcher | None = None
        self.failed: BaseException | None = None  # the start-up error, once reported
        if writer is not None:
            _convert.install(writer)
        self.collate_fn = resolve_collate(spec.collate_fn, in_worker, None if writer is None else writer.alloc)
        # torch's own collation of map-style samples: a value it cannot take is named by its sample's index
        self._names_samples = spec.kind == MAP and (isinstance(self.collate_fn, FastCollate)
                                                    or not spec.auto_collation)
        try:
            if isinstance(dataset, (_compat.IterDataPipe, _compat.MapDataPipe)):
                # torch shards a DataPipe over every worker of every rank before worker_init_fn runs
                _compat.apply_sharding(dataset, spec.num_workers * spec.world_size,
                                       worker_id * spec.world_size + spec.rank)
            if spec.worker_init_fn is not None and in_worker:
                spec.worker_init_fn(worker_id)
            self.fetcher = self._new_fetcher(None if spec.saved is None else spec.saved[worker_id])
        except Exception as exc:
            self.error = exc

    def _new_fetcher(self, saved: dict | None = None) -> Fetcher:
        s = self.spec
        return make_fetcher(s.kind, self.dataset, s.auto_collation, self.collate_fn, s.drop_last, saved)

    def __call__(self, task: Any) -> Result:
        if isinstance(task, Reset):  # a new epoch of persistent workers: a fresh iter(dataset), as torch
            if task.shared_seed is not None and isinstance(self.dataset, _compat.IterDataPipe):
                self.dataset = _compat.apply_random_seed(self.dataset, _generator(task.shared_seed))
            try:
                self.fetcher = self._new_fetcher()
            except Exception as exc:  # reported by this worker's first batch, as at start-up
                self.fetcher = None
                self.error = self.error or exc
                return Result(STARTED)
            return Result(STARTED, state=self._state())
        if self.error is not None:
            error, self.error = self.error, None
            self.failed = error
            raise error
        if self.fetcher is None:
            if self.spec.kind == ITERABLE:  # its stream ended with that error: the worker is exhausted
                return Result(ENDED)
            raise RuntimeError(
                f"DataLoader worker {self.worker_id} cannot load data: its start-up failed earlier with "
                f"{self.failed!r} (raised with its first batch)") from self.failed
        seeder, task = self._unseed(task)
        if self.spec.skip:
            return self._read_marked(task, None, None, seeder)
        try:
            data = self._fetch(self.fetcher, task, seeder)
        except StopIteration:
            return Result(ENDED if self.spec.kind == ITERABLE else STOPPED, state=self._state())
        return Result(BATCH, data, self._state())

    def careful(self, task: Any, mark: Callable[[int], None], avoid: dict[int, str]) -> Result:
        """A task a dead worker held, run again (see ``bridgeflow.parallel._transport.supervision``): a map-style
        batch is read one sample at a time, each marked as it starts, and those in ``avoid`` (they killed
        workers) are left out; anything else is marked as a whole."""
        if self.spec.kind != MAP or self.error is not None or self.fetcher is None or isinstance(task, Reset):
            mark(-1)
            return self(task)
        seeder, task = self._unseed(task)
        return self._read_marked(task, mark, avoid, seeder)

    def _unseed(self, task: Any) -> tuple[Seeder | None, Any]:
        """The seeder of a ``SeededTask`` (seed_per_sample) and the task it carries; (None, task) for others."""
        if type(task) is SeededTask:
            return Seeder(task.seed, restore=not self.in_worker), task.task
        return None, task

    def _read_marked(self, task: Any, mark: Callable[[int], None] | None, avoid: dict[int, str] | None,
                     seeder: Seeder | None = None) -> Result:
        """A map-style task with ``on_error="skip"`` or run again after a death: read as a batch (as without
        either), then, if that fails or with ``mark`` or ``avoid``, sample by sample: a sample that raises is
        left out under ``on_error="skip"`` (listed in ``skipped``; a batch left empty is ``SKIPPED``), as are
        those in ``avoid``; ``mark(i)`` runs before sample ``i`` (and ``mark(-1)`` before the collation).
        With ``seeder`` each sample is read with the seeds of its place in the batch, as ``Fetcher.read`` does
        (a dataset's ``__getitems__``, seeded once per batch there, is seeded per sample here)."""
        fetcher = self.fetcher
        assert fetcher is not None  # a failed start-up is raised by __call__ first
        catch = Exception if self.spec.skip else ()
        skipped: list = []
        if not self.spec.auto_collation:  # the task is one index
            if mark is not None:
                mark(-1)
            try:
                sample = fetcher.read(task, seeder)
            except StopIteration:
                return Result(STOPPED, state=self._state())
            except catch as exc:
                return Result(SKIPPED, state=self._state(), skipped=[(task, f"{type(exc).__name__}: {exc}")])
            return Result(BATCH, self._collate(fetcher, task, sample), self._state())
        if mark is None and not avoid:  # the batch read as without on_error; sample by sample if it fails
            try:
                samples = fetcher.read(task, seeder)
            except StopIteration:
                return Result(STOPPED, state=self._state())
            except catch:
                pass
            else:
                return Result(BATCH, self._collate(fetcher, task, samples), self._state())
        getitems = getattr(fetcher.dataset, "__getitems__", None)
        read_one = (lambda index: getitems([index])[0]) if getitems else fetcher.dataset.__getitem__
        kept, samples = [], []
        for i, index in enumerate(task):
            if mark is not None:
                mark(i)
            if avoid and i in avoid:
                skipped.append((index, avoid[i]))
                continue
            try:
                samples.append(read_one(index) if seeder is None else seeder(i, read_one, index))
            except StopIteration:
                return Result(STOPPED, state=self._state())
            except catch as exc:
                skipped.append((index, f"{type(exc).__name__}: {exc}"))
                continue
            kept.append(index)
        if mark is not None:
            mark(-1)
        if not samples:
            return Result(SKIPPED, state=self._state(), skipped=skipped)
        return Result(BATCH, self._collate(fetcher, kept, samples), self._state(), skipped or None)

    def _state(self) -> Any:
        """The dataset's state now (None without one; the exception if reading it failed)."""
        fetcher = self.fetcher
        if fetcher is None or not fetcher.stateful:
            return None
        try:
            return fetcher.state()
        except Exception as exc:
            return exc

    def _fetch(self, fetcher: Fetcher, task: Any, seeder: Seeder | None = None) -> Any:
        """Read the task's samples and collate them: nothing more per sample than torch does. When torch's
        collation fails on a value that could not be sent either, the error names that value's sample."""
        if fetcher.rows:  # the samples may be read into the rows of the batch (see Fetcher)
            assert isinstance(fetcher.collate_fn, FastCollate)
            with collating(fetcher.collate_fn.alloc):
                return self._collate(fetcher, task, fetcher.read(task, seeder))
        return self._collate(fetcher, task, fetcher.read(task, seeder))

    def _collate(self, fetcher: Fetcher, task: Any, samples: Any) -> Any:
        try:
            return fetcher.collate_fn(samples)
        except Exception as exc:
            if self.in_worker and self._names_samples and self.spec.auto_collation:
                for i, sample in zip(task, samples):
                    error = self._unsendable_error(sample, f"the sample at index {i!r}")
                    if error is not None:
                        raise error from exc
            raise

    def explain_unsendable(self, task: Any, result: Any, exc: BaseException) -> BaseException | None:
        """The worker loop could not send ``result`` (``exc``): a ``TypeError`` naming the value that cannot
        be sent, its type, and the sample (by index) or batch it came from; None when none is found."""
        if isinstance(task, Reset):
            return None
        if type(task) is SeededTask:
            task = task.task
        if self._names_samples and not self.spec.auto_collation:
            what = f"the sample at index {task!r}"
        elif self.spec.kind == MAP:
            what = f"the batch of indices {task!r}"
        else:
            what = "a batch of its stream"
        return self._unsendable_error(result.value, what)

    def _unsendable_error(self, value: Any, what: str) -> TypeError | None:
        found = _convert.unsendable(value)
        if found is None:
            return None
        leaf, exc = found
        return TypeError(f"DataLoader worker {self.worker_id}: {what} holds a {type(leaf).__module__}."
                         f"{type(leaf).__qualname__} ({exc}), which cannot be sent to the main process; return "
                         "tensors, arrays, numbers, strings or containers of them from the dataset")


def _generator(seed: int) -> Any:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


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
    dataset = spec.dataset
    if spec.shared_seed is not None and isinstance(dataset, _compat.IterDataPipe):
        dataset = _compat.apply_random_seed(dataset, _generator(spec.shared_seed))
    _compat.set_worker_info(ctx.worker_id, spec.num_workers, seed, dataset)
    return WorkerTask(spec, ctx.worker_id, dataset, writer=ctx.writer)
