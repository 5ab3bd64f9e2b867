"""How the DataLoader reads a bridgeflow DataFlow given as its dataset.

- **By index** (:class:`FlowItems`): a random-access flow, one with ``len()`` and ``flow[i]`` (the LMDB, HDF5
  and npz datasets, ``DataFromList``, a ``MapData``/``MapDataComponent`` over one, your own flow with
  ``__len__`` and ``__getitem__``), is a map-style dataset: the sampler, ``shuffle=True``, a
  ``DistributedSampler``, ``generator`` and ``state_dict()`` work as with any ``Dataset``, and each worker
  reads and maps its own indices. The flow's own order (its ``shuffle``, ``seed``, ``set_epoch``) is not used:
  a flow that shuffles itself is read in a random order drawn from the loader's ``generator``
  (``RandomSampler``), with its ``shuffle`` unset or ``True`` (then said once, :class:`DoubleShuffleWarning`,
  as torch's loader would run it too). A ``MapData``
  function that drops a datapoint (returns None) makes its batch one shorter.
- **Split across the workers** (:class:`FlowShards`): a length-free flow whose structure allows it, datapoint
  transforms (``MapData``, ``MapDataComponent``, ``FilterData``, ``SelectComponent``, the ``AugmentImage*``
  flows, ``LocallyShuffleData``) over one random-access source, is an iterable dataset: each worker reads
  the whole flow over its own piece of the source's epoch (:meth:`~bridgeflow._order.IndexedSource.split`),
  so the workers read every datapoint of an epoch once between them, in their own order. The flow's
  position is saved per worker (``state_dict()`` resumes it), and the epochs follow the flow's own.
- **As one stream** (any other length-free flow): read in this process, one batch of samples per task
  (:class:`StreamReads`), and only collation runs in the workers. With ``num_workers > 0`` the loader says so once
  (:class:`UnsplitFlowWarning`, naming the flow), unless the flow is parallel already (it has a parallel
  stage) or is fed from outside (``RemoteDataZMQ``, ``DataFromQueue``).

A flow is reset (``reset_state()``) once in each process that reads it; a worker's copy under the
worker's seed (``worker_seed_scope``), so random flows draw other numbers in each worker.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from inspect import getattr_static
from typing import Any, Protocol, TypeGuard, cast

from bridgeflow import (
    AugmentImageComponent,
    AugmentImageComponents,
    DataFlow,
    FilterData,
    LengthUnknownError,
    LocallyShuffleData,
    MapData,
    MapDataComponent,
    SelectComponent,
    worker_seed_scope,
)
from bridgeflow.engine import IndexedSource, ParallelStage, reset_once
from bridgeflow.pipeline import iter_flows

from ._compat import Dataset, IterableDataset, get_worker_info
from ._fetch import ITERABLE, close_source, make_fetcher
from ._state import EpochRecord, flow_state

__all__ = ["DoubleShuffleWarning", "FlowItems", "FlowShards", "StreamReads", "UnsplitFlowWarning", "indexable",
           "split_source", "warn_double_shuffle", "warn_unsplit"]

_NOT_PULLED = object()

_MAPS = (MapData, MapDataComponent)
_PER_DATAPOINT = (MapData, MapDataComponent, FilterData, SelectComponent, AugmentImageComponent,
                  AugmentImageComponents, LocallyShuffleData)


class UnsplitFlowWarning(UserWarning):
    """A DataFlow dataset read as one stream in the main process, with ``num_workers > 0``: the workers only
    collate. Make it random-access (a source with ``len()`` and ``flow[i]``, ``MapData`` over it) to read it
    in the workers, or put a parallel stage in it; silence with
    ``warnings.simplefilter("ignore", UnsplitFlowWarning)``."""


def _maps_by_index(flow: Any) -> TypeGuard[MapData | MapDataComponent]:
    """A MapData/MapDataComponent (or a subclass that iterates as it does), whose ``flow[i]`` maps its child's."""
    # The methods as the classes hold them: read off a class, DataFlow's public methods are descriptors that
    # make a new callable for each read (bridgeflow._tensorpack_style.Public), so only what is stored compares.
    cls = type(flow)
    return any(isinstance(flow, m) and getattr_static(cls, "__iter__") is getattr_static(m, "__iter__")
               and getattr_static(cls, "__getitem__") is getattr_static(m, "__getitem__") for m in _MAPS)


def indexable(flow: DataFlow) -> bool:
    """Whether ``flow`` has a length and ``flow[i]``, down to its source."""
    try:
        len(flow)
    except (LengthUnknownError, TypeError, NotImplementedError):
        return False
    while _maps_by_index(flow):
        flow = flow.ds
    return callable(getattr(type(flow), "__getitem__", None))


def split_source(flow: DataFlow) -> IndexedSource | None:
    """The random-access source a length-free flow can be split over (see the module doc), or None."""
    while isinstance(flow, _PER_DATAPOINT):
        flow = flow.ds
    return flow if isinstance(flow, IndexedSource) else None


def _shuffling_flows(flow: DataFlow) -> list[str]:
    return [path for path, f in iter_flows(flow)
            if getattr(f, "shuffle", False) is True or isinstance(f, LocallyShuffleData)]


def shuffles_itself(flow: DataFlow) -> bool:
    """Whether a flow in the pipeline shuffles (``shuffle=True``, ``LocallyShuffleData``)."""
    return bool(_shuffling_flows(flow))


class DoubleShuffleWarning(UserWarning):
    """``shuffle=True`` on a random-access DataFlow that shuffles itself: its own order is not used."""


def warn_double_shuffle(flow: DataFlow) -> None:
    """``shuffle=True`` on a random-access flow that shuffles itself: runs as torch's loader does (the order
    is the loader's), saying so once, and what to pass."""
    where = ", ".join(_shuffling_flows(flow))
    warnings.warn(
        f"DataLoader: the dataset shuffles itself ({where} has shuffle=True), but the DataLoader reads it by "
        "index, so its own order is not used: the batches come in the order shuffle=True draws from the "
        "loader's generator. Pass shuffle=False to the flow's source (e.g. LMDBSerializer.load(path, "
        "shuffle=False)) to say so, or leave the DataLoader's shuffle unset (it then shuffles as well)",
        DoubleShuffleWarning, stacklevel=4)


def warn_unsplit(flow: DataFlow, num_workers: int) -> bool:
    """Warn once (the caller keeps the once) that a length-free flow is read in this process; returns
    whether it warned."""
    flows = list(iter_flows(flow))
    parallel = any(isinstance(f, ParallelStage) or getattr(f, "_fed_from_outside", False)
                   or type(f).__module__.startswith("bridgeflow.remote") for _, f in flows)
    if num_workers <= 0 or parallel:
        return False
    path = max((p for p, _ in flows), key=lambda p: p.count("/"))
    warnings.warn(
        f"DataLoader: the dataset {path} has no len() and flow[i], so it is read as one stream in this process "
        f"and the {num_workers} workers only collate; make it random-access (a source with len() and df[i], "
        "MapData over it) to read it in the workers, or put a parallel stage in it (MultiProcessMapData)",
        UnsplitFlowWarning, stacklevel=4)
    return True


class _RandomAccess(Protocol):
    def __getitem__(self, index: int) -> Any: ...


class FlowItems(Dataset):
    """A random-access flow as a map-style dataset: ``flow[i]``, the flow reset once in each process.

    ``samples_untouched``: what ``__getitems__`` returns goes to the collation as it is, held by no one else, so
    a file reader may read it into the rows of the batch (:func:`bridgeflow.engine.collating`)."""

    samples_untouched = True

    def __init__(self, flow: DataFlow) -> None:
        self.flow = flow
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.flow)

    def _ready(self) -> _RandomAccess:
        """The flow, reset in this process; random-access (:func:`indexable` chose this dataset for it)."""
        if self._pid != os.getpid():
            info = get_worker_info()
            if info is not None:  # a worker's copy: its own random streams
                with worker_seed_scope(info.seed):
                    self.flow.reset_state()
            else:
                reset_once(self.flow)
            self._pid = os.getpid()
        return cast(_RandomAccess, self.flow)

    def __getitem__(self, index: int) -> Any:
        dp = self._ready()[index]
        if dp is None:
            raise ValueError(f"DataLoader: the map function of {type(self.flow).__name__} dropped datapoint "
                             f"{index} (returned None); with batch_size=None there is no batch to leave it out of")
        return dp

    def __getitems__(self, indices: list) -> list:
        flow = self._ready()
        batch = getattr(flow, "__getitems__", None)  # a file reader reads a batch at once (LMDBDataset)
        return [dp for dp in (batch(indices) if batch else (flow[i] for i in indices)) if dp is not None]


class _Stream:
    """A worker's iteration of its copy of the flow, with the flow's state (its position in the piece)."""

    def __init__(self, flow: DataFlow) -> None:
        self.flow = flow
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        if self._it is None:  # opened at the first datapoint: a loaded state is taken up by this iter()
            self._it = iter(self.flow)
        return next(self._it)

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()

    def state_dict(self) -> dict:
        return self.flow.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.flow.load_state_dict(state)


class FlowShards(IterableDataset):
    """A splittable length-free flow as an iterable dataset: worker ``k`` of ``n`` reads the flow over piece
    ``k`` of its source's epoch; without workers, the whole flow. ``epoch`` (the epoch the next fresh
    iteration's workers read, saved in the loader's state) follows the flow's own epochs."""

    def __init__(self, flow: DataFlow) -> None:
        source = split_source(flow)
        if source is None:
            raise ValueError(f"FlowShards: {type(flow).__name__} cannot be split across workers (see split_source)")
        self.flow = flow
        self.source = source
        self.epoch: int | None = None  # the next fresh epoch
        self.reading = 0  # the epoch this iteration's workers read
        self._pid: int | None = None

    def start(self, resumed: bool) -> None:
        """In this process, before workers start: which epoch they read (a resumed one is in their states)."""
        reset_once(self.flow)  # the permutations every worker's piece comes from
        if self.epoch is None:  # the epoch the flow would read next
            self.epoch = self.source.state_dict()["epoch"]
        if not resumed:
            self.reading, self.epoch = self.epoch, self.epoch + 1

    def __iter__(self) -> _Stream:
        info = get_worker_info()
        if info is not None and self._pid != os.getpid():  # this worker's copy, first epoch
            self._pid = os.getpid()
            self.source.split(info.id, info.num_workers)
            with worker_seed_scope(info.seed):
                self.flow.reset_state()
            self.source.set_epoch(self.reading)
        return _Stream(self.flow)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


def _keep_samples(samples: Any) -> Any:
    return samples


class StreamReads:
    """A DataFlow read as one stream in this process, one batch of samples per task, with the flow's position
    before each batch: a state resumes at the first batch not yet delivered. Positions are read only while
    the epoch's ``record`` can still be exported (a flow without a working ``state_dict()`` stops that)."""

    def __init__(self, flow: DataFlow, auto_collation: bool, drop_last: bool, record: EpochRecord,
                 first_task: int, resumed: bool) -> None:
        self.flow = flow
        if not resumed:
            record.flow, record.problem = flow_state(flow)  # where this epoch starts
        self._fetcher = make_fetcher(ITERABLE, flow, auto_collation, _keep_samples, drop_last)
        self._fetcher.ended = record.flow_ended
        self._pulled = first_task
        self._before: dict[int, Any] = {first_task: record.flow}  # the flow's position before task n

    def pull(self, indices: Any, record: EpochRecord) -> Any:
        """The next batch of samples (``indices``: placeholders, one per sample)."""
        if record.problem is None and self._pulled not in self._before:
            self._before[self._pulled], record.problem = flow_state(self.flow)
        samples = self._fetcher.fetch(indices)
        self._pulled += 1
        return samples

    def delivered(self, record: EpochRecord) -> None:
        """A batch was handed out (``record.yielded`` counts it): the position to resume from is the flow's
        before it gave the next batch's samples."""
        record.flow_ended = self._fetcher.ended and record.yielded == self._pulled
        if record.problem is None:
            before_next = self._before.pop(record.yielded, _NOT_PULLED)
            for n in [n for n in self._before if n < record.yielded]:
                del self._before[n]
            if before_next is _NOT_PULLED:  # nothing pulled since: the flow is there now
                before_next, record.problem = flow_state(self.flow)
            record.flow = before_next

    def end(self, record: EpochRecord) -> None:
        """The epoch ran out: the flow's position now."""
        record.flow_ended = self._fetcher.ended
        if record.problem is None:
            record.flow, record.problem = flow_state(self.flow)

    def close(self) -> None:
        """Let the flow go (its generator releases it for its next reader)."""
        close_source(self._fetcher)
