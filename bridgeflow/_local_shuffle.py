"""``LocallyShuffleData``: shuffle a sequential source within a buffer, as tensorpack does, resumably.

The buffer is a FIFO queue of ``buffer_size`` datapoints. Each datapoint read from the source goes in
``num_reuse`` times; once the buffer is full, every datapoint that goes in pushes the oldest one out to
the consumer; every ``shuffle_interval`` datapoints read, the whole buffer is shuffled. The source is read
endlessly, one pass after another, so passes mix; an iteration (an epoch) yields ``len(source) *
num_reuse`` datapoints of that stream and the next one continues it. ``one_pass=True`` reads one pass
per iteration instead and drains the buffer, shuffled, at its end.

State: the buffer holds datapoints, which a state must not (it would be as large as the buffer). A
datapoint leaves the buffer only from its front, so everything in the buffer entered after the oldest
datapoint still in it; every slot the buffer held before that one was read will have been emptied by
then. So the buffer is rebuilt from an earlier *snapshot*, taken just before the source was read at or
before that oldest datapoint: the source's state, the random generator's state, the shuffle counter and
how full the buffer was. Resuming restores them, fills the buffer with placeholders, and runs the same
code again without yielding, up to the saved point: the placeholders all leave, and the buffer, the
generator and the source end where they were. A state is a few small dicts and integers plus one
generator state (about 5 KB of text); resuming re-reads the source from the snapshot, a few times
``buffer_size`` datapoints with the default interval (an old datapoint survives each shuffle with
probability about 2/3), and never yields them.

Over an unordered stage, re-reading the source from a snapshot would give other datapoints: the state then
holds the buffer's datapoints themselves (``held``) with the source's and the generator's states as they
are now, and takes no snapshots.
"""

from __future__ import annotations

import collections
import inspect
import itertools
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from ._base import DataFlow, epoch_live, unordered_stage
from ._errors import DatapointError, LengthUnknownError
from ._proxy import ProxyDataFlow
from ._renamed import renamed_keywords
from ._rng import RNGDataFlow
from ._state import (
    StateError,
    StateMismatchError,
    child_state,
    pack_held,
    rng_state,
    set_rng_state,
    unpack_held,
)
from ._state_schema import Child, Count, Flag, Held, Rng, Same

__all__ = ["LocallyShuffleData"]

_HOLE = (-1, None)  # a buffer slot of a rebuilt buffer whose datapoint left before the saved point


def _count(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"LocallyShuffleData {what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _snapshot_every(buffer_size: int) -> int:
    """Source reads between two snapshots."""
    return max(256, buffer_size // 4)


class _Snapshot:
    """What the stream needs to run again from just before its ``pulled``-th read of the source."""

    __slots__ = ("count", "fill", "pulled", "rng", "source", "yields")

    def __init__(self, pulled: int, yields: int, source: Any, rng: dict | None, count: int, fill: int) -> None:
        self.pulled, self.yields, self.source = pulled, yields, source
        self.rng, self.count, self.fill = rng, count, fill


class _Stream:
    """One run of the buffer over the source: the generator, the buffer, the counters, the snapshots."""

    def __init__(self, flow: LocallyShuffleData, count: int, fill: int, resumed: bool, loose: str | None = None,
                 held: list | None = None, ended: bool = False, left: int = 0) -> None:
        self.flow = flow
        self.queue: collections.deque = collections.deque([_HOLE] * fill if held is None else
                                                          [(-1, dp) for dp in held])
        self.loose = loose  # the unordered stage under the flow: hold the buffer's datapoints, take no snapshots
        self.ended = ended  # one pass: the source's pass ended, only the buffer is left to drain
        self.left = left  # times the last datapoint read is still to be put in (num_reuse in all)
        self.count = count  # source reads since the last shuffle
        self.pulled = 0  # source reads in this stream (the index of the next one)
        self.yields = 0  # datapoints handed out by this stream
        self.snaps: collections.deque[_Snapshot] = collections.deque()
        self.error: StateError | None = None
        self.every = _snapshot_every(flow.buffer_size)
        self.next_snap: float = 0  # inf: never (a loose state keeps no snapshots)
        self.limit = 32  # snapshots kept before the old ones are pruned
        self.low = (0, 0)  # (pulled when computed, oldest read still needed): a cached lower bound
        if loose is not None:
            self.next_snap = float("inf")
        self.gen = self._run(resumed)

    # --- the buffer -----------------------------------------------------------------------------

    def _run(self, resumed: bool) -> Generator[Any, None, None]:
        flow = self.flow
        ds, rng, queue = flow.ds, flow.rng, self.queue
        size, reuse, interval, one_pass = flow.buffer_size, flow.num_reuse, flow.shuffle_interval, flow.one_pass
        source = iter(ds) if not self.ended else iter(())
        fresh = not resumed  # this pass of the source has to yield something (a resumed one may be at its end)
        got = False
        try:
            if self.left:  # resumed part-way through putting the last datapoint read in num_reuse times
                item = queue[-1]
                for left in range(self.left - 1, -1, -1):
                    queue.append(item)  # the buffer is full: each put pushes the oldest out
                    out = queue.popleft()
                    self.yields += 1
                    self.left = left
                    yield out[1]
            while not self.ended:
                if self.pulled >= self.next_snap:
                    self._snapshot()
                try:
                    dp = next(source)
                except StopIteration:
                    if one_pass:
                        break
                    if fresh and not got:
                        raise DatapointError("LocallyShuffleData: its source yielded nothing; reading it "
                                             "endlessly would never end") from None
                    close = getattr(source, "close", None)
                    if close is not None:
                        close()
                    source, fresh, got = iter(ds), True, False
                    continue
                got = True
                item = (self.pulled, dp)
                self.pulled += 1
                self.count += 1
                if self.count >= interval:
                    self.count = 0
                    self._shuffle(rng)
                for left in range(reuse - 1, -1, -1):  # appended first, so a state taken at the yield sees
                    full = len(queue) >= size  # the buffer whole (and how many puts of the item are left)
                    queue.append(item)
                    if full:
                        out = queue.popleft()
                        self.yields += 1
                        self.left = left
                        yield out[1]
            if not self.ended:
                self.ended = True
                self._shuffle(rng)  # one pass: drain what is left, shuffled
            while queue:
                out = queue.popleft()
                self.yields += 1
                yield out[1]
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _shuffle(self, rng: np.random.RandomState) -> None:
        items = list(self.queue)
        rng.shuffle(items)  # the same draws (and permutation) as shuffling the deque in place
        self.queue.clear()
        self.queue.extend(items)

    # --- snapshots ------------------------------------------------------------------------------

    def _snapshot(self) -> None:
        self.next_snap = self.pulled + self.every
        if self.error is not None:
            return
        try:
            source = child_state(self.flow.ds)
        except StateError as exc:  # raised if a state is asked for; iterating goes on
            self.error = exc
            self.snaps.clear()
            return
        self.snaps.append(_Snapshot(self.pulled, self.yields, source, rng_state(self.flow.rng), self.count,
                                    len(self.queue)))
        if len(self.snaps) > self.limit:
            self._prune(self._oldest_needed(fresh=True))
            self.limit = max(32, 2 * len(self.snaps))

    def _oldest_needed(self, fresh: bool = False) -> int:
        """A read index at or before the oldest datapoint the buffer still needs (the datapoint being
        reused included). Scanning the buffer costs O(buffer_size); the value only grows, so a recent
        one (within ``every`` reads) is good enough unless ``fresh``."""
        at, low = self.low
        if fresh or self.pulled - at >= self.every or at == 0:
            low = min((item[0] for item in self.queue), default=self.pulled)
            low = min(low, max(self.pulled - 1, 0))
            self.low = (self.pulled, low)
        return low

    def _prune(self, needed: int) -> None:
        snaps = self.snaps
        while len(snaps) > 1 and snaps[1].pulled <= needed:
            snaps.popleft()

    def state(self) -> dict:
        """The snapshot to rebuild from and the datapoints handed out since it (to replay, not yield); over an
        unordered stage, the buffer's datapoints and the states now."""
        if self.loose is not None:
            held = pack_held([item[1] for item in self.queue], self.loose)
            return {"source": child_state(self.flow.ds), "rng": rng_state(self.flow.rng), "count": self.count,
                    "fill": 0, "replay": 0, "held": held, "ended": self.ended, "left": self.left}
        if not self.snaps and self.error is None:  # nothing read yet: the stream starts from here
            self._snapshot()
        if self.error is not None:
            raise type(self.error)(self.error.reason, self.error.path)
        needed = self._oldest_needed()
        self._prune(needed)
        snap = self.snaps[0]
        return {"source": snap.source, "rng": snap.rng, "count": snap.count, "fill": snap.fill,
                "replay": self.yields - snap.yields, "held": None, "ended": False, "left": 0}

    def check_rebuilt(self, who: str) -> None:
        if any(item is _HOLE for item in self.queue):
            raise StateMismatchError("replaying the source from the state left the buffer incomplete: the "
                                     "source does not yield what it yielded when the state was saved", [who])

    def close(self) -> None:
        self.gen.close()


class LocallyShuffleData(ProxyDataFlow, RNGDataFlow):
    """Shuffle within a buffer: good mixing of a sequential source without reading it all (tensorpack's).

    ``LocallyShuffleData(ds, buffer_size, num_reuse=1, shuffle_interval=None)``: a FIFO buffer of
    ``buffer_size`` datapoints, each datapoint of ``ds`` put in ``num_reuse`` times, the buffer shuffled
    every ``shuffle_interval`` datapoints read (default ``buffer_size // 3``, at least 1). ``ds`` is read
    endlessly, so its passes mix; ``len()`` is ``len(ds) * num_reuse``, and an iteration yields that many
    datapoints of the endless stream (forever if ``ds`` has no length); the next iteration continues it.
    With ``one_pass=True`` an iteration reads ``ds`` once and then empties the buffer in random order, so
    every epoch has each datapoint exactly ``num_reuse`` times.

    Resumable (see :mod:`bridgeflow._local_shuffle` for how and what it costs). In the endless mode
    ``set_epoch`` is not passed on to ``ds``: its passes do not line up with epochs, and a shuffled
    source reads a new order each pass by itself. ``nr_reuse=`` is tensorpack's older name of ``num_reuse=``.

    Example:
        >>> from bridgeflow import DataFromList
        >>> df = LocallyShuffleData(DataFromList([[i] for i in range(10)], shuffle=False), 4, seed=0)
        >>> df.reset_state()
        >>> epoch = [dp[0] for dp in df]  # 10 datapoints; the last ones may come from the second pass
        >>> len(df), len(epoch), min(epoch) >= 0
        (10, 10, True)
    """

    # A datapoint stays in the shuffled buffer about buffer_size reads, and the chance that one stays 64 times as
    # long is below e**-64: no saved state replays further (a crafted one would replay for ever). A state goes
    # back to the snapshot before the oldest read the buffer needed when that was last computed (up to
    # ``every`` reads ago, see _oldest_needed), and snapshots are ``every`` reads apart: two of those more.
    state_fields = (
        Same("buffer_size", "buffer_size"), Same("num_reuse", "num_reuse"),
        Same("shuffle_interval", "shuffle_interval"), Same("one_pass", "one_pass"),
        Count("count", lambda f: f.shuffle_interval - 1, lambda f: f"a shuffle counter below shuffle_interval="
              f"{f.shuffle_interval}"),
        Count("fill", "buffer_size", say="the state's buffer holds {value} datapoints, more than buffer_size={most}"),
        Count("replay", lambda f: (64 * f.buffer_size + 2 * _snapshot_every(f.buffer_size) + 2) * f.num_reuse,
              lambda f: f"64 buffers (buffer_size={f.buffer_size}) and twice the reads between two snapshots, "
                        f"each datapoint handed out num_reuse={f.num_reuse} times"),
        Count("taken", lambda f: None if f.one_pass else f._epoch_size(), "the epoch's length"),
        Rng("rng"), Held(most=lambda f: f.buffer_size), Flag("ended", optional=True),
        Count("left", lambda f: f.num_reuse - 1, "num_reuse puts of a datapoint", optional=True), Child("source"),
    )

    @renamed_keywords(nr_reuse="num_reuse")
    def __init__(self, ds: DataFlow, buffer_size: int, num_reuse: int = 1, shuffle_interval: int | None = None,
                 seed: int | None = None, *, one_pass: bool = False) -> None:
        ProxyDataFlow.__init__(self, ds)
        self.buffer_size = _count(buffer_size, "buffer_size")
        self.num_reuse = _count(num_reuse, "num_reuse")
        if shuffle_interval is None:
            shuffle_interval = max(1, self.buffer_size // 3)  # tensorpack's default (0 there below 3)
        self.shuffle_interval = _count(shuffle_interval, "shuffle_interval")
        self.one_pass = bool(one_pass)
        self.seed = seed
        self._stream: _Stream | None = None
        self._epoch_start = 0  # the stream's yields when the epoch in progress began

    def _on_reset(self) -> None:
        super()._on_reset()
        self._drop_stream()

    def __len__(self) -> int:
        return len(self.ds) * self.num_reuse

    def _epoch_size(self) -> int | None:
        try:
            return len(self)
        except LengthUnknownError:
            return None

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        taken = 0
        if resume is not None:
            self._drop_stream()
            if resume["rng"] is not None:
                set_rng_state(self.rng, resume["rng"])
            held = resume.get("held")
            stream = self._stream = _Stream(self, resume["count"], resume["fill"], resumed=True,
                                            loose=unordered_stage(self),
                                            held=unpack_held(held) if held is not None else None,
                                            ended=bool(resume.get("ended")), left=resume.get("left") or 0)
            replay = resume["replay"]
            for i in range(replay):
                if next(stream.gen, _HOLE) is _HOLE:
                    raise StateMismatchError(f"resuming replays {replay} datapoints of the buffer, but the stream "
                                             f"ended after {i}: the source yields less than when the state was "
                                             "saved", [type(self).__name__])
            stream.check_rebuilt(type(self).__name__)
            taken = resume["taken"]
        elif self.one_pass or self._stream is None or inspect.getgeneratorstate(self._stream.gen) == inspect.GEN_CLOSED:
            self._drop_stream()
            stream = self._stream = _Stream(self, 0, 0, resumed=False, loose=unordered_stage(self))
        else:
            stream = self._stream
        self._epoch_start = stream.yields - taken
        if self.one_pass:
            return stream.gen  # the stream is this epoch
        size = self._epoch_size()
        return itertools.islice(stream.gen, None if size is None else max(size - taken, 0))

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the source only with ``one_pass=True`` (see the class docstring)."""
        if self.one_pass:
            super().set_epoch(epoch)

    # --- state ----------------------------------------------------------------------------------

    def _settings(self) -> dict:
        return {"buffer_size": self.buffer_size, "num_reuse": self.num_reuse,
                "shuffle_interval": self.shuffle_interval, "one_pass": self.one_pass}

    def _own_state(self) -> dict:
        """A snapshot of the source, the random generator and the buffer's fill from before the oldest
        datapoint in the buffer was read, the datapoints handed out since, and the place in the epoch."""
        live = epoch_live(self)
        stream = self._stream
        open_stream = stream is not None and inspect.getgeneratorstate(stream.gen) != inspect.GEN_CLOSED
        if stream is not None and (live or not self.one_pass) and open_stream:
            own = stream.state()
            own["taken"] = stream.yields - self._epoch_start if live else 0
        else:  # nothing read yet, or between two one-pass epochs: a new stream starts from here
            own = {"source": child_state(self.ds), "rng": rng_state(getattr(self, "rng", None)), "count": 0,
                   "fill": 0, "replay": 0, "held": None, "ended": False, "left": 0, "taken": 0}
        return {**self._settings(), **own}

    def close(self) -> None:
        self._drop_stream()
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_stream"] = None  # a copy (sent to a worker) starts its own stream
        return state
