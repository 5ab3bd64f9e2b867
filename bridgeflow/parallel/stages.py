"""Parallel stages: map a function over a flow in worker threads or processes, or run copies of a flow.

These are DataFlows, composable with batching on either side: ``BatchData`` after a map stage batches
in the consumer; ``BatchData`` inside the flow a runner copies batches in the workers.

- :class:`MultiProcessMapData` / :class:`MultiThreadMapData`: the source is read in the consumer, each
  datapoint goes to a worker, ``map_func`` runs there, results come back in source order
  (``ordered=True``) or as ready. The two differ only in the kind of worker; output is the same.
- :class:`MultiProcessRunner` / :class:`MultiThreadRunner`: every worker iterates its own copy of the
  flow (reset with a distinct seed) and the consumer takes datapoints as they come.

Each worker seeds Python's ``random`` and numpy's global RNG from its own seed, so augmentations that
use them differ between workers (forked workers would otherwise share one RNG state).

``strict`` keeps tensorpack's meaning for the map stages: ``strict=True`` runs exactly one epoch of the
source per iteration and drops anything in flight when an iteration ends early. ``strict=False`` (the
default) keeps the workers busy across epoch boundaries: an iteration yields ``len(ds)`` results and the
next one continues where it stopped (a source without ``len()`` always runs strict).
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools
import logging
import os
import pickle
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..base import DataFlow, ProxyDataFlow, worker_seed_scope
from ..batch import batch_datapoints
from ..errors import DatapointError, LengthUnknownError
from ..transforms import _DATAPOINT_TYPES, check_datapoint
from .pool import EXHAUSTED, WorkerContext, WorkerPool, check_seconds, describe_unpicklable

__all__ = ["MultiProcessMapData", "MultiProcessRunner", "MultiThreadMapData", "MultiThreadRunner"]

log = logging.getLogger(__name__)


def seed_worker_globals(seed: int) -> None:
    """Seed Python's and numpy's global RNGs in a worker."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


class _BatchTask:
    """A group of source datapoints that a worker maps and, if none is dropped, stacks into one batch."""

    __slots__ = ("items", "size", "use_list", "pad_value")

    def __init__(self, items: list, size: int, use_list: Any, pad_value: Any) -> None:
        self.items, self.size, self.use_list, self.pad_value = items, size, use_list, pad_value

    def __reduce__(self) -> tuple:
        return _BatchTask, (self.items, self.size, self.use_list, self.pad_value)


class _Stacked:
    """A batch stacked in a worker (as opposed to a list of mapped datapoints)."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __reduce__(self) -> tuple:
        return _Stacked, (self.batch,)


def _batch_bytes(dps: list) -> int:
    """Bytes the stacked arrays of a batch will take, judged from its first datapoint."""
    first = dps[0]
    values = first.values() if isinstance(first, dict) else first
    return sum(v.nbytes for v in values if isinstance(v, np.ndarray)) * len(dps)


def _map_init(map_func: Callable[[Any], Any], ctx: WorkerContext) -> Callable[[Any], Any]:
    seed_worker_globals(ctx.seed)
    writer = ctx.writer
    who = f"map_func {getattr(map_func, '__qualname__', map_func)!s}"

    def run(payload: Any) -> Any:
        if type(payload) is not _BatchTask:
            out = map_func(payload)
            return out if out is None or type(out) in _DATAPOINT_TYPES else check_datapoint(out, who)
        mapped = []
        for dp in payload.items:
            out = map_func(dp)
            if out is not None:
                mapped.append(out if type(out) in _DATAPOINT_TYPES else check_datapoint(out, who))
        if len(mapped) != payload.size:
            return mapped
        alloc = None
        if writer is not None:  # stack straight into shared memory: the only copy of the bytes
            writer.reserve(_batch_bytes(mapped) + 4096)
            alloc = writer.alloc
        return _Stacked(batch_datapoints(mapped, payload.use_list, payload.pad_value, alloc))

    return run


def _chunk_size(buffer_size: int, num_workers: int) -> int:
    """Tasks per message: big enough to amortize a message (~20 us), small enough that every worker
    holds at least two chunks of the buffer, so none of them idles while the consumer catches up."""
    return max(1, min(16, buffer_size // (2 * num_workers)))


def _check_positive(value: Any, what: str, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{who}: {what} must be a positive integer, got {value!r}")
    return int(value)


class _StageStats:
    """Counters every parallel stage keeps, to show whether the producer or the consumer is slow."""

    def __init__(self) -> None:
        self.datapoints = 0
        self.started: float | None = None

    def as_dict(self, pool: WorkerPool | None, capacity: int) -> dict[str, float]:
        if pool is None or self.started is None:
            return {}
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {
            "datapoints": self.datapoints,
            "workers": pool.num_workers,
            "buffer_fill": min(1.0, pool.fill_average() / max(capacity, 1)),
            "consumer_wait_s": pool.wait_time,
            "consumer_wait_frac": min(1.0, pool.wait_time / elapsed),
        }


class _ParallelStage(ProxyDataFlow):
    """What the map stages and the runners share: a pool started in ``reset_state``, closed in ``close``."""

    _processes = True
    _pool: WorkerPool | None = None
    timeout: float | None = None
    stall_warning: float | None = 60.0
    _mapping_hooks: Any = None

    def _new_pool(self) -> WorkerPool:
        raise NotImplementedError

    def _pool_options(self) -> dict[str, Any]:
        """The WorkerPool arguments every stage passes alike (``timeout``, stall warning, mapping hooks)."""
        return {"timeout": self.timeout, "stall_warning": self.stall_warning, "mapping_hooks": self._mapping_hooks}

    def set_mapping_hooks(self, hooks: Any) -> None:
        """Tell ``hooks`` about this stage's shared-memory slab mappings, now and after any restart of its
        workers (see :meth:`WorkerPool.set_mapping_hooks`); ``None`` removes them."""
        self._mapping_hooks = hooks
        if self._pool is not None:
            self._pool.set_mapping_hooks(hooks)

    def reset_state(self) -> None:
        self._close_pool()
        self._stats = _StageStats()
        self._pool = self._new_pool().start()

    def _close_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def close(self) -> None:
        self._close_pool()
        super().close()

    def stats(self) -> dict[str, float]:
        return self._stats.as_dict(self._pool, self._capacity) if hasattr(self, "_stats") else {}

    def _live_pool(self) -> WorkerPool:
        """The pool to iterate with: a new one when the last iteration was interrupted mid-receive."""
        pool = self._pool
        if pool is None:
            raise RuntimeError(f"{type(self).__name__} is closed; call reset_state() to start it again")
        if pool.interrupted:
            log.warning("%s: the last iteration was interrupted while receiving a result; starting new workers",
                        type(self).__name__)
            self._close_pool()
            pool = self._pool = self._new_pool().start()
        return pool

    def _get(self, pool: WorkerPool) -> Any:
        if self._stats.started is None:
            self._stats.started = time.perf_counter()
        return pool.get()[1]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_pool", None)  # a copy sent elsewhere starts its own workers
        state.pop("_mapping_hooks", None)  # and has its own mappings
        return state


class _MapStage(_ParallelStage):
    def __init__(self, ds: DataFlow, num_workers: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, start_method: str | None = None,
                 seed: int | None = None, timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        super().__init__(ds)
        who = type(self).__name__
        self.timeout = check_seconds(timeout, "timeout", who)
        self.stall_warning = check_seconds(stall_warning, "stall_warning", who)
        self.num_workers = _check_positive(num_workers, "the number of workers", who)
        if not callable(map_func):
            raise TypeError(f"{who}: map_func must be callable, got {map_func!r}")
        self.map_func = map_func
        self.buffer_size = _check_positive(buffer_size, "buffer_size", who)
        self.strict = strict
        self.ordered = ordered
        self.start_method = start_method
        self.seed = seed
        self._capacity = self.buffer_size
        self._carry: Iterator | None = None
        self._batched: _BatchPlan | None = None  # fused batching: groups in flight into the next epoch

    def _new_pool(self) -> WorkerPool:
        if self._processes and self.start_method not in (None, "fork"):
            _check_picklable(self.map_func, "map_func", type(self).__name__, self.start_method)
        self._carry = self._batched = None
        return WorkerPool(functools.partial(_map_init, self.map_func), self.num_workers,
                          processes=self._processes, start_method=self.start_method, name=type(self).__name__,
                          base_seed=self.seed, ordered=self.ordered,
                          chunk_size=_chunk_size(self.buffer_size, self.num_workers), **self._pool_options())

    def reset_state(self) -> None:
        self.ds.reset_state()
        super().reset_state()

    def _epoch_size(self) -> int | None:
        if self.strict:
            return None
        try:
            return len(self.ds)
        except LengthUnknownError:
            return None

    def __iter__(self) -> Iterator:
        pool = self._live_pool()
        if self._batched is not None:  # groups of a fused BatchData are in flight: not datapoints
            self._batched = None
            pool.discard_outstanding()
        size = self._epoch_size()
        if size is None:
            yield from self._strict_epoch(pool)
        else:
            yield from self._carried_epoch(pool, size)

    def _strict_epoch(self, pool: WorkerPool) -> Iterator:
        source = iter(self.ds)
        more = True
        try:
            while more and pool.outstanding < self.buffer_size:
                try:
                    pool.put(next(source))
                except StopIteration:
                    more = False
            while pool.outstanding:
                out = self._get(pool)
                if more:
                    try:
                        pool.put(next(source))
                    except StopIteration:
                        more = False
                if out is not None:
                    self._stats.datapoints += 1
                    yield out
        finally:
            if pool.outstanding and self._pool is pool:
                pool.discard_outstanding()
            if hasattr(source, "close"):
                source.close()

    def _carried_epoch(self, pool: WorkerPool, size: int) -> Iterator:
        if self._carry is None:
            self._carry = _forever(self.ds, type(self).__name__)
        carry = self._carry
        for _ in range(size):
            while pool.outstanding < self.buffer_size:
                pool.put(self._next_carried(carry))
            out = self._get(pool)
            if out is not None:
                self._stats.datapoints += 1
                yield out

    def _next_carried(self, carry: Iterator) -> Any:
        try:
            return next(carry)
        except BaseException:
            # The source raised, so its generator is finished: the next epoch must start a new pass (a
            # finished generator would raise StopIteration, or end every later epoch at once).
            if self._carry is carry:
                self._carry = None
            raise

    def iter_batched(self, batch_size: int, remainder: bool = False, use_list: Any = False,
                     pad_value: Any = None) -> Iterator:
        """Batches of the mapped datapoints, stacked in the workers; ``BatchData(self, ...)`` calls this.

        Yields exactly what ``BatchData`` would yield over this stage. A group in which ``map_func``
        dropped a datapoint comes back unstacked and is re-batched here. Like the unbatched stage, a
        non-strict one keeps the workers busy across epochs: the groups of the next epoch are already in
        flight when this one ends, so no worker waits for another's last batch.
        """
        pool = self._live_pool()
        size = self._epoch_size()
        state = self._batched
        self._batched = None  # this epoch owns the groups in flight until it completes
        if state is None or not state.continues(pool, batch_size, size, use_list, pad_value):
            if pool.outstanding:  # left by an unbatched iteration (or another batch size): not ours
                pool.discard_outstanding()
            state = _BatchPlan(pool, batch_size, size, use_list, pad_value, self._groups(batch_size, size))
        in_flight = max(2 * self.num_workers, -(-self.buffer_size // batch_size))
        holder: list = []
        complete = False
        try:
            while state.next_result(in_flight):
                out = self._get(pool)
                if type(out) is _Stacked and not holder:
                    self._stats.datapoints += batch_size
                    yield out.batch
                    continue
                holder.extend(_unstack(out.batch) if type(out) is _Stacked else out)
                while len(holder) >= batch_size:
                    self._stats.datapoints += batch_size
                    yield batch_datapoints(holder[:batch_size], use_list, pad_value)
                    del holder[:batch_size]
            if remainder and holder:
                self._stats.datapoints += len(holder)
                yield batch_datapoints(holder, use_list, pad_value)
            complete = True
        finally:
            if complete and size is not None and self._pool is pool:
                self._batched = state  # the next epoch takes over the groups already in flight
            else:
                if pool.outstanding and self._pool is pool:
                    pool.discard_outstanding()
                state.groups.close()

    def _groups(self, batch_size: int, size: int | None) -> Iterator:
        """The groups of source datapoints to map and stack, each epoch followed by ``_EPOCH_END``: one epoch
        of a fresh ``iter(ds)`` when strict, else epochs of ``size`` from the carried stream, forever."""
        if size is None:
            source = iter(self.ds)
            try:
                while True:
                    group = list(itertools.islice(source, batch_size))
                    if group:
                        yield group
                    if len(group) < batch_size:
                        break
            finally:
                if hasattr(source, "close"):
                    source.close()
            yield _EPOCH_END
            return
        if self._carry is None:
            self._carry = _forever(self.ds, type(self).__name__)
        carry = self._carry
        while True:
            for start in range(0, size, batch_size):
                yield [self._next_carried(carry) for _ in range(min(batch_size, size - start))]
            yield _EPOCH_END

    def close(self) -> None:
        state, self._batched = self._batched, None
        if state is not None:
            state.groups.close()
        carry, self._carry = self._carry, None
        if carry is not None:
            carry.close()
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_carry"] = state["_batched"] = None  # generators of this process's iteration
        return state


_EPOCH_END = object()


class _BatchPlan:
    """The groups sent to the workers for fused batching, and how many are in flight per epoch.

    ``pending`` holds ``True`` per group sent (in order) and ``None`` where an epoch ends, so an epoch
    knows how many results are its own even when groups of the next one are in flight already.
    """

    def __init__(self, pool: WorkerPool, batch_size: int, size: int | None, use_list: Any, pad_value: Any,
                 groups: Iterator) -> None:
        self.pool, self.batch_size, self.size = pool, batch_size, size
        self.use_list, self.pad_value = use_list, pad_value
        self.groups = groups
        self.pending: collections.deque = collections.deque()
        self.ends = 0  # epoch ends in pending: groups are planned at most one epoch ahead
        self.exhausted = False

    def continues(self, pool: WorkerPool, batch_size: int, size: int | None, use_list: Any, pad_value: Any) -> bool:
        return (pool is self.pool and batch_size == self.batch_size and size == self.size
                and use_list is self.use_list and pad_value is self.pad_value)

    def next_result(self, in_flight: int) -> bool:
        """Send groups until ``in_flight`` are out; True while this epoch has a result still to get."""
        pool = self.pool
        while not self.exhausted and pool.outstanding < in_flight and self.ends < 2:
            group = next(self.groups, None)
            if group is None:  # a strict epoch's groups are all sent
                self.exhausted = True
            elif group is _EPOCH_END:
                self.pending.append(None)
                self.ends += 1
            else:
                pool.put(_BatchTask(group, self.batch_size, self.use_list, self.pad_value), flush=True)
                self.pending.append(True)
        if not self.pending:
            return False
        if self.pending.popleft() is None:
            self.ends -= 1
            return False
        return True


def _unstack(batch: Any) -> list:
    if isinstance(batch, dict):
        n = len(next(iter(batch.values())))
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]
    n = len(batch[0])
    return [[c[i] for c in batch] for i in range(n)]


def _forever(ds: DataFlow, who: str) -> Iterator:
    while True:
        empty = True
        for dp in ds:
            empty = False
            yield dp
        if empty:
            raise DatapointError(f"{who}: the source flow yielded nothing")


def _check_picklable(obj: Any, what: str, who: str, method: str) -> None:
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(f"{who}: {what} {describe_unpicklable(obj)} cannot be pickled, which "
                        f"start_method={method!r} needs ({exc}); define it at module level, or use "
                        "start_method='fork'") from exc


class MultiProcessMapData(_MapStage):
    """Run ``map_func`` on every datapoint in ``num_proc`` worker processes.

    Array bytes in the results travel through shared memory (see :mod:`bridgeflow.parallel.shm`);
    received arrays are writable and valid for as long as you hold them. ``map_func`` returning
    ``None`` drops the datapoint. ``buffer_size`` bounds the datapoints in flight.

    ``timeout`` (seconds, like torch's ``DataLoader(timeout=)``; every parallel stage takes it) raises
    :class:`~bridgeflow.WorkerTimeoutError` naming the worker when a result takes longer; after
    ``stall_warning`` seconds of waiting (default 60, ``None`` for never) a warning is logged with the
    worker's pid, state and Python stack.

    Example:
        >>> from bridgeflow import DataFromList, BatchData
        >>> df = BatchData(MultiProcessMapData(DataFromList(list(range(100))), 2, load_image), 64)
        ...  # doctest: +SKIP
    """

    _processes = True

    def __init__(self, ds: DataFlow, num_proc: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, start_method: str | None = None,
                 seed: int | None = None, timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        super().__init__(ds, num_proc, map_func, buffer_size, strict, ordered, start_method=start_method,
                         seed=seed, timeout=timeout, stall_warning=stall_warning)


class MultiThreadMapData(_MapStage):
    """Run ``map_func`` on every datapoint in ``num_thread`` threads: the thread twin of MultiProcessMapData.

    Threads pay off when ``map_func`` releases the GIL (I/O, decoding in C, large numpy operations).
    A thread cannot be killed: a ``map_func`` that never returns keeps its thread alive after ``close()``.
    """

    _processes = False

    def __init__(self, ds: DataFlow, num_thread: int, map_func: Callable[[Any], Any], buffer_size: int = 200,
                 strict: bool = False, ordered: bool = True, *, seed: int | None = None,
                 timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        super().__init__(ds, num_thread, map_func, buffer_size, strict, ordered, seed=seed, timeout=timeout,
                         stall_warning=stall_warning)


# --- runners ------------------------------------------------------------------------------------


def _runner_init(make_flow: Callable[[], DataFlow] | DataFlow, ctx: WorkerContext) -> Callable[[Any], Any]:
    seed_worker_globals(ctx.seed)
    df = make_flow() if callable(make_flow) and not isinstance(make_flow, DataFlow) else make_flow
    with worker_seed_scope(ctx.seed):
        df.reset_state()
    stream = _forever(df, f"{ctx.stage} worker {ctx.worker_id}")
    return lambda _: next(stream)


def _copy_flow(df: DataFlow) -> DataFlow:
    try:
        return pickle.loads(pickle.dumps(df))
    except Exception:
        return copy.deepcopy(df)


class _RunnerStage(_ParallelStage):
    def __init__(self, ds: DataFlow, num_workers: int, num_prefetch: int, *, start_method: str | None = None,
                 seed: int | None = None, factory: Callable[[], DataFlow] | None = None,
                 timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        super().__init__(ds)
        who = type(self).__name__
        self.timeout = check_seconds(timeout, "timeout", who)
        self.stall_warning = check_seconds(stall_warning, "stall_warning", who)
        self.num_workers = _check_positive(num_workers, "the number of workers", who)
        self.num_prefetch = _check_positive(num_prefetch, "num_prefetch", who)
        self.start_method = start_method
        self.seed = seed
        self._factory = factory
        self._capacity = self.num_prefetch

    def reset_state(self) -> None:
        # The consumer does not iterate ds itself: each worker resets its own copy.
        super().reset_state()

    def _new_pool(self) -> WorkerPool:
        make = self._factory if self._factory is not None else self.ds
        if self._processes and self.start_method not in (None, "fork"):
            _check_picklable(make, "flow", type(self).__name__, self.start_method)
        init = functools.partial(_runner_init, make)
        pool = WorkerPool(init, self.num_workers, processes=self._processes, start_method=self.start_method,
                          name=type(self).__name__, base_seed=self.seed, ordered=False,
                          chunk_size=_chunk_size(self.num_prefetch, self.num_workers), **self._pool_options())
        return pool

    def __iter__(self) -> Iterator:
        pool = self._live_pool()
        try:
            size: int | None = len(self.ds)
        except LengthUnknownError:
            size = None
        n = 0
        while size is None or n < size:
            while pool.outstanding < self.num_prefetch:
                pool.put(None)
            out = self._get(pool)
            if out is EXHAUSTED:  # pragma: no cover - workers loop their flow forever
                continue
            n += 1
            self._stats.datapoints += 1
            yield out


class MultiProcessRunner(_RunnerStage):
    """Run ``num_proc`` copies of ``ds`` in worker processes; yield their datapoints as they come.

    Each worker resets its copy with a distinct seed and loops over it forever. An iteration yields
    ``len(ds)`` datapoints (forever if ``ds`` has no length) drawn from all workers, so within one
    iteration a datapoint can appear once per worker: shard the source if that matters. Note the
    argument order ``(ds, num_proc, num_prefetch)``, which differs from tensorpack's
    ``(ds, num_prefetch, num_proc)``: pass them by keyword when porting.
    """

    _processes = True

    def __init__(self, ds: DataFlow, num_proc: int, num_prefetch: int = 16, *, start_method: str | None = None,
                 seed: int | None = None, timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        super().__init__(ds, num_proc, num_prefetch, start_method=start_method, seed=seed, timeout=timeout,
                         stall_warning=stall_warning)
        cpus = os.cpu_count() or 1
        if self.num_workers > 2 * cpus and self.num_workers > self.num_prefetch:
            log.warning("MultiProcessRunner(ds, num_proc=%d, num_prefetch=%d) starts %d processes on %d CPUs; "
                        "tensorpack's order is (ds, num_prefetch, num_proc): pass them by keyword when porting",
                        self.num_workers, self.num_prefetch, self.num_workers, cpus)


class MultiThreadRunner(_RunnerStage):
    """Run ``num_thread`` flows in threads; ``get_df`` (a function returning a new flow) makes each one.

    A DataFlow may be passed instead of a function: each thread then gets a copy of it.
    """

    _processes = False

    def __init__(self, get_df: Callable[[], DataFlow] | DataFlow, num_thread: int, num_prefetch: int = 16, *,
                 seed: int | None = None, timeout: float | None = None, stall_warning: float | None = 60.0) -> None:
        if isinstance(get_df, DataFlow):
            proto = get_df
            factory: Callable[[], DataFlow] = lambda: _copy_flow(proto)
        elif callable(get_df):
            factory = get_df
            proto = get_df()
        else:
            raise TypeError(f"MultiThreadRunner needs a DataFlow or a function returning one, got {get_df!r}")
        super().__init__(proto, num_thread, num_prefetch, seed=seed, factory=factory, timeout=timeout,
                         stall_warning=stall_warning)
