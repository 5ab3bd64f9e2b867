"""The order a random-access source reads an epoch in: shuffled or not, one rank's shard, how far it got.

``DataFromList`` and the LMDB, HDF5 and npz readers share it. Epoch ``e`` of a shuffled source reads a
permutation drawn from ``(base, e)``, where ``base`` comes from the flow's seed (and, in a parallel
worker, the worker's seed): any epoch's order can be rebuilt from two integers, so a state stays
small however large the dataset, and every rank that uses the same seed draws the same permutation.
With a shard ``(rank, world)`` the epoch's order is cut into ``world`` contiguous blocks of equal
length, padded by wrapping around to its start (``drop_last=False``, like torch's
``DistributedSampler``) or cut short (``drop_last=True``); the rank reads its block. Contiguous blocks
keep sequential reads sequential (an LMDB cursor, HDF5 block reads).

The position is read off the index iterator itself (``list_iterator``/``range_iterator`` know how far
they are), so tracking it costs nothing per datapoint.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._base import epoch_live
from ._rng import RNGDataFlow
from ._shard import check_same_on_every_rank, resolve_shard
from ._state import StateMismatchError
from ._state_schema import Count, Field, Same, Value, check_fields

__all__ = ["EpochOrder", "IndexedSource", "order_fields"]

Run = Sequence[int]  # a range (sequential reads) or a list of indices (shuffled)


def iterator_position(it: Any, run_length: int) -> int:
    """How many items of its ``run_length`` a ``list_iterator`` or ``range_iterator`` has handed out.

    From the items it has left, which every Python version gives alike (a ``range_iterator``'s
    ``__reduce__`` holds its position only up to 3.11: from 3.12 it holds the range that is left).
    """
    return run_length - operator.length_hint(it)


class EpochOrder:
    """Indices to read per epoch for a source of ``n`` datapoints, and the position in the current epoch.

    The source calls :meth:`begin` when an iteration starts (in ``_begin_epoch``, not in its generator, so
    an iterator dropped before its first datapoint still ends the epoch) and reads the indices of
    :meth:`iters`; :meth:`state` saves the position, :meth:`check` checks a saved one, and ``begin(state)``
    starts from it.
    """

    def __init__(self, n: int, shuffle: bool, shard: tuple[int, int, bool] | None, who: str) -> None:
        self.n = int(n)
        self.shuffle = bool(shuffle)
        self.shard = shard
        self.part: tuple[int, int] | None = None  # (k, n): read piece k of n of every epoch (see split)
        self.who = who
        self.base: int | None = None  # entropy of the permutations, drawn in reset()
        self.epoch = 0  # the epoch of the last iteration begun
        self.next_epoch = 0  # the epoch the next iteration reads
        self._asked: int | None = None  # the last epoch given to set_epoch
        self._it: Any = None  # the index iterator of the current run
        self._done = 0  # indices of the epoch in runs before the current one
        self._run_len = 0

    # --- epochs -----------------------------------------------------------------------------------

    def reset(self, rng: np.random.RandomState) -> None:
        """Draw the permutations' entropy from the flow's generator (seeded in ``reset_state``) and start
        again from epoch 0, or from the epoch last given to ``set_epoch`` (a loaded state overrides both).
        A split order keeps the entropy it has: its pieces must come from the permutations of the others."""
        if self.part is None or self.base is None:
            self.base = int(rng.randint(0, 2**62, dtype=np.int64)) if self.shuffle else None
        self.next_epoch = self._asked if self._asked is not None else 0

    def set_epoch(self, epoch: int, live: bool) -> None:
        """The next iteration reads epoch ``epoch``, unless the one in progress is that epoch already."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"{self.who}: set_epoch needs an epoch >= 0, got {epoch}")
        self._asked = epoch
        if live and epoch == self.epoch:
            return
        self.next_epoch = epoch

    def _shard_length(self) -> int:
        if self.shard is None:
            return self.n
        _, world, drop_last = self.shard
        return self.n // world if drop_last else -(-self.n // world)

    def length(self) -> int:
        """Datapoints per epoch: all of them, or the shard's (or its piece's, see :meth:`split`)."""
        m = self._shard_length()
        if self.part is not None:
            k, parts = self.part
            return m * (k + 1) // parts - m * k // parts
        return m

    def split(self, k: int, parts: int) -> None:
        """Read only piece ``k`` of ``parts`` contiguous pieces of each epoch's order (of this rank's shard):
        the pieces of one epoch, read by ``parts`` copies of the source with the same permutations (the same
        ``base``), hold every datapoint once. A DataLoader reads a length-free flow in its workers so."""
        if not 0 <= k < parts:
            raise ValueError(f"{self.who}: split needs 0 <= k < parts, got k={k}, parts={parts}")
        self.part = (k, parts)

    def _piece(self, runs: list[Run], part: tuple[int, int]) -> list[Run]:
        k, parts = part
        total = sum(len(r) for r in runs)
        lo, hi = total * k // parts, total * (k + 1) // parts
        out, at = [], 0
        for run in runs:
            a, b = max(lo - at, 0), min(hi - at, len(run))
            if a < b:
                out.append(run[a:b])
            at += len(run)
        return out

    def permutation(self, epoch: int) -> list[int]:
        if self.base is None:
            raise RuntimeError(f"{self.who}: reset_state() has not run")
        return np.random.default_rng([self.base, epoch]).permutation(self.n).tolist()

    def runs(self, epoch: int) -> list[Run]:
        """The indices of ``epoch`` for this flow (this rank's block when sharded, its piece when split), as
        one or more runs."""
        runs = self._runs(epoch)
        return runs if self.part is None else self._piece(runs, self.part)

    def _runs(self, epoch: int) -> list[Run]:
        n = self.n
        if self.shard is None:
            return [self.permutation(epoch) if self.shuffle else range(n)]
        rank, _, _ = self.shard
        m = self._shard_length()
        lo, hi = rank * m, (rank + 1) * m
        if n == 0 or m == 0:
            return []
        if self.shuffle:
            order = self.permutation(epoch)
            return [[order[i % n] for i in range(lo, hi)] if hi > n else order[lo:hi]]
        runs: list[Run] = []
        at = lo
        while at < hi:  # past the end the order wraps around to its start
            start = at % n
            take = min(hi - at, n - start)
            runs.append(range(start, start + take))
            at += take
        return runs

    def shard_index(self, i: int) -> int:
        """The file index of the ``i``-th datapoint of this rank's part in file order (for ``ds[i]``)."""
        if self.shard is None:
            return i
        rank, _, _ = self.shard
        return (rank * self._shard_length() + i) % self.n

    def begin(self, resume: dict | None = None) -> tuple[list[Run], int]:
        """Start an iteration: the runs of its epoch and the position to start from (``resume``'s, a state
        :meth:`check` accepted)."""
        if resume is not None:
            if resume["base"] is not None:
                self.base = resume["base"]
            epoch, pos = resume["epoch"], resume["pos"]
        else:
            epoch, pos = self.next_epoch, 0
        self.epoch, self.next_epoch = epoch, epoch + 1
        self._it, self._done, self._run_len = None, pos, 0  # the position until iters() starts
        return self.runs(epoch), pos

    def iters(self, runs: list[Run], pos: int) -> Iterator[tuple[Iterator[int], Run, int]]:
        """``(index iterator, run, where in the run it starts)`` per run, the first one advanced to ``pos``;
        the position is read off the iterator, so the caller may iterate it at full speed."""
        done = 0
        for run in runs:
            n = len(run)
            if pos >= done + n:
                done += n
                continue
            skip = max(0, pos - done)
            it: Any = iter(run)  # a range's or a list's iterator: its __setstate__(n) (a pickling hook) seeks
            if skip:
                it.__setstate__(skip)
            self._it, self._done, self._run_len = it, done, n
            yield it, run, skip
            done += n
        self._it, self._done, self._run_len = None, done, 0

    def items(self, seq: Sequence, pos: int) -> Iterator:
        """The iterator of a list or tuple itself, from ``pos``, for an unsharded sequential epoch: the
        fastest way through it, and it knows its position like the index iterators do (a split order:
        through its piece)."""
        if self.part is not None:
            piece = self._piece([range(len(seq))], self.part)
            first = piece[0] if piece else range(0)
            assert isinstance(first, range)  # the piece of a range is a range
            seq = seq[first.start:first.stop]
        it: Any = iter(seq)  # a list's or a tuple's iterator: its __setstate__(n) (a pickling hook) seeks
        if pos:
            it.__setstate__(pos)
        self._it, self._done, self._run_len = it, 0, len(seq)
        return it

    def position(self) -> int:
        it = self._it
        return self._done if it is None else self._done + iterator_position(it, self._run_len)

    # --- state ------------------------------------------------------------------------------------

    def state(self, live: bool) -> dict:
        if live:
            epoch, pos = self.epoch, self.position()
        else:
            epoch, pos = self.next_epoch, 0
        return {"n": self.n, "shuffle": self.shuffle, "shard": None if self.shard is None else list(self.shard),
                "base": self.base, "epoch": epoch, "pos": pos}

    def check(self, state: dict) -> None:
        """Refuse a state saved from another order (length, shuffle, shard) or past the epoch's end."""
        check_fields(self, state, order_fields(lambda order: order), reserved=())


def order_fields(order_of: Any) -> tuple[Field, ...]:
    """The fields of an :class:`EpochOrder`'s state, for the flow whose order is ``order_of(flow)``."""
    return (
        Same("n", lambda f: order_of(f).n, "the state is for a dataset of length {saved}, this flow has a dataset of "
             "length {have}"),
        Same("shuffle", lambda f: order_of(f).shuffle, "the state is for shuffle={saved}, this flow has "
             "shuffle={have}"),
        Same("shard", lambda f: None if order_of(f).shard is None else list(order_of(f).shard),
             "the state is for shard (rank, world, drop_last) {saved}, this flow has {have}"),
        Count("base", (1 << 64) - 1, "a seed of 64 bits", none=True),
        Count("epoch", (1 << 63) - 1, "an epoch number of 63 bits"),
        Count("pos", lambda f: order_of(f).length(), "the epoch's length"),
    )


def _same_data(flow: Any, saved: dict) -> None:
    have = flow._identity()
    if have is not None and saved != have:
        raise StateMismatchError(f"the state was saved reading {saved}, this flow reads {have}: another file")


class IndexedSource(RNGDataFlow):
    """A random-access source read in an :class:`EpochOrder`: ``shuffle``, ``shard`` and a resumable position.

    Subclasses call :meth:`_init_order` in ``__init__`` and write ``_read(runs, pos)``, a generator of the
    datapoints at the indices of :meth:`EpochOrder.iters`. ``_identity()`` may name the file, so that a
    state saved from another file is refused.
    """

    _order: EpochOrder
    state_fields = (*order_fields(lambda f: f._order), Value("data", dict, _same_data, none=True))

    def _init_order(self, n: int, shuffle: bool, shard: Any, drop_last: bool) -> None:
        who = type(self).__name__
        self._order = EpochOrder(n, shuffle, resolve_shard(shard, drop_last, who), who)
        if self._order.shard is not None and self._order.shard[1] > 1:
            check_same_on_every_rank(self, who)

    def __len__(self) -> int:
        return self._order.length()

    def _seed_random(self) -> None:
        super()._seed_random()
        self._order.reset(self.rng)

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        self._sync_length()
        return self._read(*self._order.begin(resume))

    def _read(self, runs: list[Run], pos: int) -> Iterator:
        raise NotImplementedError

    def _sync_length(self) -> None:
        """Hook: follow a change of the data's length since construction."""

    def _identity(self) -> dict | None:
        """What tells this source's data from another's of the same length (e.g. a file's size)."""
        return None

    def split(self, k: int, parts: int) -> None:
        """Read only piece ``k`` of ``parts`` of every epoch (of this rank's shard): ``parts`` copies of this
        source, made after its ``reset_state()`` (so with its permutations), read each datapoint once per
        epoch between them. A DataLoader reads a length-free flow over this source so, one piece per worker."""
        self._order.split(k, parts)

    def set_epoch(self, epoch: int) -> None:
        """The next iteration reads epoch ``epoch``'s order (the same on every rank for one seed), unless
        the iteration in progress reads that epoch already."""
        self._order.set_epoch(epoch, epoch_live(self))

    def _own_state(self) -> dict:
        """The epoch, the position in it and the entropy of the shuffle: a few integers."""
        out = self._order.state(epoch_live(self))
        out["data"] = self._identity()
        return out
