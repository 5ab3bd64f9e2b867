"""Runners: every worker iterates its own copy of a flow (reset with a distinct seed); the consumer takes
datapoints as they come.

State: each worker's copy reports its state every few datapoints along with them (a
:class:`~bridgeflow.parallel._progress.WorkerSnapshot`), and the consumer keeps, per worker, the state at
the last datapoint it received from it (:class:`~bridgeflow.parallel._progress.WorkerLedger`). A resume
starts the workers from those states: each worker's continuation comes exactly once, the interleaving
of the workers may differ.

Restarts (``max_restarts``): a worker that replaces a dead one starts its copy from the same bookkeeping, at
the position after the last datapoint the pool received from the dead one, numbering its datapoints on
from there: each worker's stream of datapoints is exactly the undisturbed one's, the interleaving may
differ. A copy that cannot save its state starts again from its beginning (said once in the log).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from .._base import DataFlow, epoch_live, pending_state, unordered_stage
from .._errors import LengthUnknownError
from .._local_shuffle import LocallyShuffleData
from .._renamed import renamed_keywords
from .._rng import get_rng, in_worker_scope, worker_seed_scope
from .._shard import UnshardedWarning
from .._state import NotResumableError, StateError, StateMismatchError, check_plain, verify_checksum
from .._state_schema import Count, Same, Value
from ..pipeline import iter_flows
from ._common import (
    ParallelStage,
    check_picklable,
    check_positive,
    chunk_size,
    forever,
    seed_worker_globals,
    warn_if_oversubscribed,
)
from ._progress import WorkerLedger, WorkerSnapshot
from ._transport.pool import EXHAUSTED, WorkerContext, WorkerPool

__all__ = ["MultiProcessRunner", "MultiThreadRunner"]


log = logging.getLogger(__name__)

_RUNNER_SNAPSHOT_EVERY = 16  # a runner worker's datapoints between two states of its copy


def _runner_init(make_flow: Callable[[], DataFlow] | DataFlow, resume: list[dict | None] | None,
                 ctx: WorkerContext) -> Callable[[Any], Any]:
    seed_worker_globals(ctx.seed)
    df = make_flow() if callable(make_flow) and not isinstance(make_flow, DataFlow) else make_flow
    with worker_seed_scope(ctx.seed):
        df.reset_state()
    start = resume[ctx.worker_id] if resume is not None else None
    if start is not None and start["state"] is not None:
        df.load_state_dict(start["state"])
    stream = forever(df, f"{ctx.stage} worker {ctx.worker_id}", resumed=start is not None)
    for _ in range(start["replay"] if start is not None else 0):
        next(stream)
    count = start.get("count", 0) if start is not None else 0  # a restarted worker numbers on
    every = _RUNNER_SNAPSHOT_EVERY

    def task(_: Any) -> Any:
        # Every so often the datapoint travels with its copy's state just before it was made.
        nonlocal count, every
        n = count
        count += 1
        if n % every:
            return next(stream)
        try:
            state, error = df.state_dict(), None
        except StateError as exc:  # reported once; the consumer raises it if a state is asked for
            state, error, every = None, str(exc), 1 << 62
        return WorkerSnapshot(next(stream), n, state, error)

    return task


def _draw_seed() -> int:
    """A base seed for the workers (they add their number: room below 2**32). Random, but where a worker's seed
    scope is active (a runner in another runner's copy, reset there) derived from that worker's seed, so a copy
    restarted from the same seed, as a resume restarts it, starts its workers from the same seeds."""
    if in_worker_scope():
        return int(get_rng(None, None).randint(0, 1 << 31))
    return int.from_bytes(os.urandom(4), "little") >> 1


def _copy_flow(df: DataFlow) -> DataFlow:
    try:
        return pickle.loads(pickle.dumps(df))
    except Exception:
        return copy.deepcopy(df)


def _check_workers(stage: Any, workers: list) -> None:
    """Each worker's position: plain data (nothing live reaches a worker: spawn would rebuild it), a replay
    within what a worker reports, and a state its copy of the flow takes (tried here, on a fresh copy)."""
    if len(workers) != stage.num_workers:
        raise StateMismatchError(f"the state lists {len(workers)} workers' positions for {stage.num_workers}")
    probe = None
    for i, w in enumerate(workers):
        if not isinstance(w, dict):
            raise StateMismatchError(f"damaged worker position {w!r:.80} in the state")
        if set(w) != {"state", "replay"}:
            raise StateMismatchError(f"worker {i}'s position has the fields {sorted(w)}, not ['replay', 'state']")
        check_plain(w, f"the state of worker {i}")
        Count("replay", 2 * _RUNNER_SNAPSHOT_EVERY + stage._capacity, "a worker reports its copy's state every "
              f"{_RUNNER_SNAPSHOT_EVERY} datapoints").check(stage, w.get("replay"))
        saved = w.get("state")
        if not isinstance(saved, (dict, type(None))):
            raise StateMismatchError(f"field 'state' of worker {i}'s position is a {type(saved).__name__}")
        if saved is not None:
            probe = probe if probe is not None else stage._probe()
            try:
                if probe is not None:
                    probe.load_state_dict(saved)
                verify_checksum(saved)  # a worker's state is a tree of its own (the probe's load is nested)
            except StateError as exc:
                raise exc.within(f"workers[{i}]") from None
    if probe is not None:
        probe.close()


def _check_seed(stage: Any, seed: int) -> None:
    if stage.seed is not None:
        if seed != stage.seed:
            raise StateMismatchError(f"the state is for seed={seed}, this stage has seed={stage.seed}")
    elif not 0 <= seed < 1 << 32:
        raise StateMismatchError(f"field 'seed' of the state is {seed}, not a seed this stage draws (0 to 2**32)")


class _RunnerStage(ParallelStage):
    state_fields = (
        Same("num_workers", "num_workers", "the state is for {saved} workers, this stage has {have}: each "
             "worker's copy has its own position"),
        Value("workers", list, _check_workers),
        Count("taken", lambda f: f._epoch_size(), "the epoch's length"),
        Value("seed", int, _check_seed, none=True, optional=True),
    )

    def __init__(self, ds: DataFlow, num_workers: int, num_prefetch: int, *, start_method: str | None = None,
                 seed: int | None = None, factory: Callable[[], DataFlow] | None = None,
                 timeout: float | None = None, stall_warning: float | None = 60.0, max_restarts: int = 0) -> None:
        super().__init__(ds)
        who = type(self).__name__
        self._set_waits(timeout, stall_warning)
        self._set_faults(max_restarts)
        self.num_workers = check_positive(num_workers, "the number of workers", who)
        self.num_prefetch = check_positive(num_prefetch, "num_prefetch", who)
        self.start_method = start_method
        self.seed = seed
        self._factory = factory
        self._capacity = max(self.num_prefetch, self.num_workers)  # in flight: at least one per worker
        self._workers: WorkerLedger | None = None
        self._started_with: dict | None = None  # the loaded state the workers were started from
        self._n = 0  # datapoints yielded in the epoch in progress
        self._seed: int | None = None  # the base seed of the workers started last, or drawn for the next ones
        self._seed_used = False  # workers were started with it (the next ones draw another, unless a state says)

    def _new_pool(self, start: dict | None = None) -> WorkerPool:
        make = self._factory if self._factory is not None else self.ds
        if self._processes and self.start_method not in (None, "fork"):
            check_picklable(make, "flow", type(self).__name__, self.start_method)
        # a state loaded before reset_state() (or the one this epoch begins from): the workers start from it
        pending = start if start is not None else pending_state(self)
        self._started_with = pending
        starts = pending["workers"] if pending is not None else None
        self._workers = WorkerLedger([(w["state"], w["replay"]) for w in starts] if starts is not None
                                     else [(None, 0)] * self.num_workers)
        init = functools.partial(_runner_init, make, starts)
        # the workers' base seed: the state's, else seed, else one drawn for a state taken before, else a new one
        if pending is not None and pending.get("seed") is not None:
            self._seed = pending["seed"]
        elif self.seed is not None:
            self._seed = self.seed
        elif self._seed is None or self._seed_used:
            self._seed = _draw_seed()
        self._seed_used = True
        pool = WorkerPool(init, self.num_workers, processes=self._processes, start_method=self.start_method,
                          name=type(self).__name__, base_seed=self._seed, ordered=False,
                          chunk_size=chunk_size(self._capacity, self.num_workers),
                          restart_init=functools.partial(self._restart_init, make), **self._pool_options())
        return pool

    def _restart_init(self, make: Any, worker: int) -> Callable[[WorkerContext], Callable[[Any], Any]]:
        """The init function of a worker replacing dead ``worker``: its copy starts where the dead one's was
        after the last datapoint the pool received from it (those not yet taken from the pool included)."""
        ledger, pool = self._workers, self._pool
        assert ledger is not None and pool is not None  # a pool restarts its workers while it runs
        count = ledger.received[worker] + pool.ready_from(worker)
        start = ledger.position(worker, count)
        if start is None:
            log.warning("%s: worker %d's copy of the flow cannot say where it was (%s): the new worker starts its "
                        "copy from the beginning", type(self).__name__, worker, ledger.error)
        starts: list[dict | None] = [None] * self.num_workers
        starts[worker] = start
        return functools.partial(_runner_init, make, starts)

    def _begin_epoch(self, resume: dict | None) -> Iterator:
        if resume is not None and self._started_with is not resume:  # loaded after reset_state()
            self._close_pool()
            self._pool = self._new_pool(resume).start()
        self._started_with = None
        pool = self._live_pool()
        try:
            size: int | None = len(self.ds)
        except LengthUnknownError:
            size = None
        self._n = resume["taken"] if resume is not None else 0
        return self._run(pool, size)

    def _run(self, pool: WorkerPool, size: int | None) -> Iterator:
        workers = self._workers
        assert workers is not None  # _live_pool() made the ledger of the workers it started
        while size is None or self._n < size:
            while pool.outstanding < self._capacity:
                pool.put(None)
            self._stats.start(pool)
            worker, out = pool.get()
            if out is EXHAUSTED:  # pragma: no cover - workers loop their flow forever
                continue
            if type(out) is WorkerSnapshot:
                workers.record(worker, out)
                out = out.dp
            workers.received[worker] += 1
            self._n += 1
            self._stats.datapoints += 1
            yield out

    def _unordered(self) -> bool:
        return self.num_workers > 1

    def _epoch_size(self) -> int | None:
        try:
            return len(self.ds)
        except LengthUnknownError:
            return None

    def _own_state(self) -> dict:
        """Each worker's copy's state at the last datapoint received from it (a snapshot plus datapoints
        to replay), and the position in the epoch. A resume restarts the workers from these."""
        stage = unordered_stage(self)
        if stage is not None:
            raise NotResumableError(f"each worker's copy replays from a snapshot of its state, and the unordered "
                                    f"{stage} in it would give other datapoints: make that stage ordered")
        workers = self._workers.positions() if self._workers is not None else \
            [{"state": None, "replay": 0} for _ in range(self.num_workers)]
        if self._seed is None or (self._seed_used and self._pool is None):  # no workers run: the next ones' seed
            self._seed, self._seed_used = (self.seed if self.seed is not None else _draw_seed()), False
        # the seed too: a worker that had given nothing restarts its copy from reset_state(), seeded by it
        return {"num_workers": self.num_workers, "workers": workers, "taken": self._n if epoch_live(self) else 0,
                "seed": self._seed}

    def _probe(self) -> DataFlow | None:
        """A fresh copy of the workers' flow to check their states on (None when it cannot be copied)."""
        try:
            return self._factory() if self._factory is not None else _copy_flow(self.ds)
        except Exception:  # the workers' copies are checked in the workers all the same
            log.debug("%s: no copy of the flow to check the workers' states on", type(self).__name__, exc_info=True)
            return None

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_workers"] = state["_started_with"] = None
        return state


def _note_positional(init: Callable[..., None]) -> Callable[..., None]:
    """Record whether both counts came positionally (``self._bf_positional``), for :func:`_check_counts`."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        self._bf_positional = len(args) >= 3
        init(self, *args, **kwargs)

    return wrapper


_ORDER_NOTE = "the positional order is tensorpack's, {sig} (earlier bridgeflow versions took {old})"


def _check_counts(who: str, sig: str, old: str, num_prefetch: Any, count: int | None, name: str, positional: bool,
                  what: str) -> int:
    """Make the change of positional order loud: a missing count, or counts that read like the old order.
    Returns the count."""
    if count is None:
        raise TypeError(f"{who}{sig} needs {name}, the number of {what}; {_ORDER_NOTE.format(sig=sig, old=old)}: "
                        "pass both counts, or use keywords")
    if positional and isinstance(count, int) and isinstance(num_prefetch, int) and count > num_prefetch:
        first = sig.strip("()").split(",")[0]
        warnings.warn(f"{who}({first}, {num_prefetch}, {count}) starts {count} {what} and prefetches {num_prefetch}: "
                      f"{_ORDER_NOTE.format(sig=sig, old=old)}. Pass the counts by keyword to say which you mean",
                      UserWarning, stacklevel=5)  # the caller, above the two decorators
    return count


def _warn_if_copies_repeat(ds: DataFlow, workers: int, who: str) -> None:
    """Several workers each iterate a copy of ``ds``: say that this assumes i.i.d. datapoints, and warn
    (:class:`~bridgeflow.UnshardedWarning`) when nothing in ``ds`` shuffles, since every worker then gives
    the same datapoints in the same order and an epoch holds each of them up to ``workers`` times."""
    if workers < 2:
        return
    flows = [flow for _, flow in iter_flows(ds)]
    if any(getattr(flow, "_fed_from_outside", False) for flow in flows):
        return  # each worker receives its own part from outside
    if any(getattr(flow, "shuffle", False) is True for flow in flows):
        log.info("%s: %d workers each iterate a copy of the flow, which assumes its datapoints are i.i.d. (a "
                 "random or shuffled source): an epoch may hold a datapoint more than once", who, workers)
        return
    local = [path for path, flow in iter_flows(ds) if isinstance(flow, LocallyShuffleData)]
    if local:  # tensorpack's LMDB pipeline with its inner runner taken out
        what = (f"whose source is read in the same order by every copy ({local[0]} shuffles only within its "
                "buffer), so every worker gives the same datapoints, each in its own order")
    else:
        what = "and nothing in it shuffles, so every worker gives the same datapoints in the same order"
    warnings.warn(f"{who}: its {workers} workers each iterate their own copy of the flow, {what}, and an epoch "
                  f"holds each of them up to {workers} times. A runner assumes i.i.d. datapoints (a shuffled or "
                  "random source); to read a dataset once with the work done in parallel, use "
                  "MultiProcessMapData(source, num_proc, map_func) (silence with "
                  "warnings.simplefilter('ignore', bridgeflow.UnshardedWarning))",
                  UnshardedWarning, stacklevel=_outside_bridgeflow())


def _outside_bridgeflow() -> int:
    """The ``stacklevel`` that names the first caller outside bridgeflow (the line that made the stage)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


class MultiProcessRunner(_RunnerStage):
    """Run ``num_proc`` copies of ``ds`` in worker processes; yield their datapoints as they come.

    ``MultiProcessRunner(ds, num_prefetch, num_proc)``, in tensorpack's order (earlier bridgeflow versions
    took ``(ds, num_proc, num_prefetch)``; counts that read like that order are warned about). Each worker
    resets its copy with a distinct seed and loops over it forever. An iteration yields ``len(ds)``
    datapoints (forever if ``ds`` has no length) drawn from all workers, so within one iteration a
    datapoint can appear once per worker: shard the source if that matters. ``num_prefetch`` bounds the
    datapoints in flight (at least one per worker). ``nr_prefetch=`` / ``nr_proc=`` are accepted, deprecated.

    Example:
        >>> from bridgeflow import DataFromList
        >>> df = MultiProcessRunner(DataFromList([[i] for i in range(4)]), 3, 2)  # prefetch 3, two processes
        >>> with df:
        ...     epoch = [dp[0] for dp in df]
        >>> len(epoch), set(epoch) <= {0, 1, 2, 3}  # len(ds) datapoints, from either worker's copy
        (4, True)
    """

    _processes = True

    @renamed_keywords(nr_prefetch="num_prefetch", nr_proc="num_proc")
    @_note_positional
    def __init__(self, ds: DataFlow, num_prefetch: int = 16, num_proc: int | None = None, *,
                 start_method: str | None = None, seed: int | None = None, timeout: float | None = None,
                 stall_warning: float | None = 60.0, max_restarts: int = 0) -> None:
        num_proc = _check_counts(type(self).__name__, "(ds, num_prefetch, num_proc)", "(ds, num_proc, num_prefetch)",
                                 num_prefetch, num_proc, "num_proc", self.__dict__.pop("_bf_positional", False),
                                 "processes")
        super().__init__(ds, num_proc, num_prefetch, start_method=start_method, seed=seed, timeout=timeout,
                         stall_warning=stall_warning, max_restarts=max_restarts)
        _warn_if_copies_repeat(ds, self.num_workers, type(self).__name__)
        warn_if_oversubscribed(self.num_workers, type(self).__name__, "num_proc",
                               f" (num_prefetch={self.num_prefetch}, num_proc={self.num_workers}: the counts go in "
                               "tensorpack's order, (ds, num_prefetch, num_proc))", stacklevel=5)


class MultiThreadRunner(_RunnerStage):
    """Run ``num_thread`` flows in threads; ``get_df`` (a function returning a new flow) makes each one.

    ``MultiThreadRunner(get_df, num_prefetch, num_thread)``, in tensorpack's order (earlier bridgeflow
    versions took ``(get_df, num_thread, num_prefetch)``). A DataFlow may be passed instead of a function: each
    thread then gets a copy of it. ``nr_prefetch=`` / ``nr_thread=`` are accepted, deprecated.
    """

    _processes = False

    @renamed_keywords(nr_prefetch="num_prefetch", nr_thread="num_thread")
    @_note_positional
    def __init__(self, get_df: Callable[[], DataFlow] | DataFlow, num_prefetch: int = 16,
                 num_thread: int | None = None, *, seed: int | None = None, timeout: float | None = None,
                 stall_warning: float | None = 60.0, max_restarts: int = 0) -> None:
        num_thread = _check_counts(type(self).__name__, "(get_df, num_prefetch, num_thread)",
                                   "(get_df, num_thread, num_prefetch)", num_prefetch, num_thread, "num_thread",
                                   self.__dict__.pop("_bf_positional", False), "threads")
        if isinstance(get_df, DataFlow):
            proto = get_df
            factory: Callable[[], DataFlow] = lambda: _copy_flow(proto)
        elif callable(get_df):
            factory = get_df
            proto = get_df()
        else:
            raise TypeError(f"MultiThreadRunner needs a DataFlow or a function returning one, got {get_df!r}")
        super().__init__(proto, num_thread, num_prefetch, seed=seed, factory=factory, timeout=timeout,
                         stall_warning=stall_warning, max_restarts=max_restarts)
