"""One part of a flow per rank: each of ``world`` processes reads a disjoint part, all of equal length.

- :class:`ShardData` shards any flow with a length: every rank reads the whole flow and keeps every
  ``world``-th datapoint. Simple, and what a flow without random access needs.
- Random-access sources shard faster, reading only their own part: ``DataFromList(..., shard=)``,
  ``LMDBSerializer.load(path, shard=(rank, world))``, ``HDF5Serializer.load``, ``NumpySerializer.load``
  (see :mod:`bridgeflow._order`).

Every rank yields the same number of datapoints per epoch, since distributed training hangs when one
rank runs out first: ``drop_last=False`` (the default) pads the short ranks with a repeated datapoint,
``drop_last=True`` drops the remainder. ``"auto"`` (or no rank and world) reads them from
``torch.distributed`` when it is initialised, else from the ``RANK`` and ``WORLD_SIZE`` environment
variables (set by ``torchrun``), else runs unsharded (rank 0 of 1). Every rank must build its flow with
the same seeds, so that shuffles agree; ``df.set_epoch(n)`` (on any flow: it reaches the sources) makes them
agree on a new order per epoch.

Example:
    >>> from bridgeflow import DataFromList
    >>> df = ShardData(DataFromList([[i] for i in range(10)], shuffle=True, seed=0), rank=1, world=4)
    >>> len(df)  # ceil(10 / 4): a short rank repeats a datapoint
    3
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from ._base import DataFlow, epoch_live, unordered_stage
from ._errors import LengthUnknownError
from ._proxy import ProxyDataFlow
from ._rng import RNGDataFlow
from ._state import child_state
from ._state_schema import Child, Count, Flag, Same
from .pipeline import iter_flows

__all__ = ["ShardData", "UnshardedWarning", "rank_and_world", "resolve_shard", "warn_if_unsharded"]

log = logging.getLogger(__name__)


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: ``torch.distributed`` when initialised (torch is never
    imported here; only an already imported one is asked), else ``RANK``/``WORLD_SIZE``, else ``(0, 1)``."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None:
        try:
            return int(rank), int(world)
        except ValueError:
            raise ValueError(f"RANK={rank!r} and WORLD_SIZE={world!r} must be integers") from None
    return 0, 1


def _check_rank_world(rank: Any, world: Any, who: str) -> tuple[int, int]:
    for name, value in (("rank", rank), ("world", world)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{who}: {name} must be an integer, got {value!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"{who}: needs 0 <= rank < world, got rank={rank}, world={world}")
    return rank, world


def resolve_shard(shard: Any, drop_last: bool, who: str) -> tuple[int, int, bool] | None:
    """``None``, ``(rank, world)`` or ``"auto"`` as ``(rank, world, drop_last)``, or ``None`` (unsharded)."""
    if shard is None:
        return None
    if isinstance(shard, str):
        if shard != "auto":
            raise ValueError(f"{who}: shard must be (rank, world), 'auto' or None, got {shard!r}")
        rank, world = rank_and_world()
        log.debug("%s: shard %d of %d", who, rank, world)
    else:
        try:
            rank, world = shard
        except (TypeError, ValueError):
            raise ValueError(f"{who}: shard must be (rank, world), 'auto' or None, got {shard!r}") from None
    rank, world = _check_rank_world(rank, world, who)
    return rank, world, bool(drop_last)


class UnshardedWarning(UserWarning):
    """A pipeline read by one of several ranks with nothing in it that shards: every rank reads all of it.

    Training on it feeds each rank the whole dataset (each epoch is ``world`` epochs, every datapoint
    seen ``world`` times). When that is what you want (every rank evaluates everything, or your own flow
    reads its rank's part), silence it: ``warnings.simplefilter("ignore", bridgeflow.UnshardedWarning)``.
    Flows fed from outside (``RemoteDataZMQ``, ``DataFromQueue``) count as per rank: they give what their
    producers send this process.
    """


def _shards(flow: Any) -> bool:
    if getattr(flow, "_fed_from_outside", False):  # RemoteDataZMQ, DataFromQueue
        return True
    if isinstance(flow, ShardData):
        return flow.world > 1
    shard = getattr(getattr(flow, "_order", None), "shard", None)  # an IndexedSource's EpochOrder
    return isinstance(shard, tuple) and len(shard) == 3 and shard[1] > 1


def warn_if_unsharded(df: Any, who: str, stacklevel: int = 3) -> bool:
    """Warn (:class:`UnshardedWarning`) when this process is one of several ranks (:func:`rank_and_world`)
    and no flow in ``df`` takes a part per rank (:class:`ShardData`, a source's ``shard=``). Returns whether
    it warned."""
    rank, world = rank_and_world()
    if world <= 1:
        return False
    flows = list(iter_flows(df))
    if any(_shards(flow) for _, flow in flows):
        return False
    path = max((p for p, _ in flows), key=lambda p: p.count("/"))
    warnings.warn(
        f"{who}: this process is rank {rank} of {world}, and nothing in the pipeline {path} shards it, so "
        "every rank reads the whole dataset; give its source "
        "shard='auto' (LMDB, HDF5, npz, DataFromList) or wrap it in ShardData(df), with the same seed on every "
        "rank (silence with warnings.simplefilter('ignore', bridgeflow.UnshardedWarning) if every rank must "
        "read everything)", UnshardedWarning, stacklevel=stacklevel)
    return True


def check_same_on_every_rank(df: Any, who: str) -> None:
    """Refuse a pipeline with a random flow that has no seed, or an unordered parallel stage: each rank would
    see its own order, so the parts would overlap."""
    stage = unordered_stage(df, itself=True)
    if stage is not None:
        raise ValueError(f"{who}: {stage} delivers in an order of its workers' timing (ordered=False, or a runner "
                         "of several workers), so every rank would keep other datapoints and the ranks' parts would "
                         "overlap; give it ordered=True, or shard its source (shard= on the source, or ShardData "
                         "under the stage)")
    for path, flow in iter_flows(df):
        if isinstance(flow, RNGDataFlow) and flow.seed is None and getattr(flow, "shuffle", True) \
                and getattr(flow, "random", True):
            raise ValueError(f"{who}: {path} draws random numbers without a seed, so every rank would draw "
                             "different ones and the ranks' parts would overlap; pass the same seed= on every "
                             "rank")


class ShardData(ProxyDataFlow):
    """This rank's part of ``ds``: datapoints ``rank``, ``rank + world``, ... of every epoch.

    Each rank reads the whole of ``ds`` (a random-access source with ``shard=`` reads only its part).
    ``ds`` needs a length, so that every rank yields the same count: ``len(ds) // world`` with
    ``drop_last=True``, else ``ceil(len(ds) / world)``, the short ranks repeating the epoch's last
    datapoint once. ``rank`` and ``world`` default to :func:`rank_and_world` (``torch.distributed``,
    then ``RANK``/``WORLD_SIZE``). Random flows inside ``ds`` need a seed (the same on every rank).

    Example:
        >>> from bridgeflow import DataFromList
        >>> [list(ShardData(DataFromList([[i] for i in range(5)], shuffle=False), r, 2)) for r in range(2)]
        [[[0], [2], [4]], [[1], [3], [4]]]
    """

    state_fields = (Same("rank", "rank"), Same("world", "world"), Same("drop_last", "drop_last"), Count("seen"),
                    Count("yielded"), Flag("child_done"), Child())

    def __init__(self, ds: DataFlow, rank: int | None = None, world: int | None = None, *,
                 drop_last: bool = False) -> None:
        super().__init__(ds)
        if (rank is None) != (world is None):
            raise ValueError("ShardData: give both rank and world, or neither (to read them from "
                             "torch.distributed or RANK/WORLD_SIZE)")
        if rank is None:
            rank, world = rank_and_world()
        self.rank, self.world = _check_rank_world(rank, world, "ShardData")
        self.drop_last = bool(drop_last)
        if self.world > 1:
            check_same_on_every_rank(self.ds, "ShardData")
        self._seen = 0  # datapoints of ds read this epoch
        self._yielded = 0
        self._child_done = False  # ds's epoch ended within this one (only the repeated datapoint is left)

    def _per_rank(self, n: int) -> int:
        return n // self.world if self.drop_last else -(-n // self.world)

    def __len__(self) -> int:
        try:
            return self._per_rank(len(self.ds))
        except LengthUnknownError:
            raise LengthUnknownError(f"ShardData over a {type(self.ds).__name__}, which has no length") from None

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        try:
            n = len(self.ds)
        except LengthUnknownError:
            raise LengthUnknownError(
                f"ShardData needs len() of the {type(self.ds).__name__} it wraps, so that every rank yields as "
                "many datapoints; shard before the flow that loses the length (a filter), or give it one"
            ) from None
        self._seen, self._yielded = (resume["seen"], resume["yielded"]) if resume is not None else (0, 0)
        self._child_done = resume is not None and resume["child_done"]
        if self._child_done:  # saved after the child's epoch ended: this one has nothing left either
            return iter(())
        return self._shard(iter(self.ds), self._per_rank(n))

    def _shard(self, it: Iterator, m: int) -> Iterator:
        """Every ``world``-th datapoint of the child's epoch, read to its end: a child epoch left unfinished
        would leave its read-ahead (a parallel stage's work in flight) to the next epoch, which a saved
        state cannot say, so a resumed flow would read different epochs after it."""
        rank, world = self.rank, self.world
        last = None
        for dp in it:
            i = self._seen
            self._seen = i + 1
            last = dp
            if i % world == rank and self._yielded < m:
                self._yielded += 1
                yield dp
        self._child_done = True
        if self._yielded < m and last is not None:  # a short rank: repeat the epoch's last datapoint
            self._yielded += 1
            yield last

    def _own_state(self) -> dict:
        if epoch_live(self):
            own = {"seen": self._seen, "yielded": self._yielded, "child_done": self._child_done}
        else:
            own = {"seen": 0, "yielded": 0, "child_done": False}
        return {"rank": self.rank, "world": self.world, "drop_last": self.drop_last, **own,
                "child": child_state(self.ds)}
