"""What the parallel stages share: a worker pool started in ``reset_state`` and closed in ``close``, their
statistics, the endless stream of a flow's epochs, and checks of their arguments."""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._base import DataFlow
from .._errors import DatapointError
from .._proxy import ProxyDataFlow
from ._faults import SkipLog
from ._transport.forensics import check_seconds
from ._transport.pickling import dumps_as_launched
from ._transport.pool import WorkerPool, describe_unpicklable
from ._transport.supervision import check_max_restarts

__all__ = [
    "ParallelStage", "check_picklable", "check_positive", "check_seconds", "chunk_size", "forever",
    "OversubscribedWarning", "seed_worker_globals", "warn_if_oversubscribed",
]

log = logging.getLogger("bridgeflow.parallel._stages")


def seed_worker_globals(seed: int) -> None:
    """Seed Python's and numpy's global RNGs in a worker."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


def chunk_size(buffer_size: int, num_workers: int) -> int:
    """Tasks per message: big enough to amortize a message (~20 us), small enough that every worker
    holds at least two chunks of the buffer, so none of them idles while the consumer catches up."""
    return max(1, min(16, buffer_size // (2 * num_workers)))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as torch's DataLoader counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class OversubscribedWarning(UserWarning):
    """A process stage asked for more workers than the CPUs this process may use (torch's DataLoader warns
    alike). Silence it with ``warnings.simplefilter("ignore", bridgeflow.OversubscribedWarning)``."""


def warn_if_oversubscribed(workers: int, who: str, keyword: str, note: str = "", stacklevel: int = 4) -> None:
    """Warn (once per message) when a stage starts more worker processes than there are CPUs to run them."""
    cpus = usable_cpus()
    if workers > cpus:
        warnings.warn(f"{who} starts {workers} processes on {cpus} CPUs (those this process may use): they compete "
                      f"for the CPUs and run slower than fewer would, and use more memory; pass {keyword}={cpus} or "
                      f"fewer{note}", OversubscribedWarning, stacklevel=stacklevel)


def check_positive(value: Any, what: str, who: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{who}: {what} must be a positive integer, got {value!r}")
    return int(value)


class _StageStats:
    """Counters every parallel stage keeps, to show which side is slow (see :mod:`bridgeflow.pipeline`)."""

    def __init__(self) -> None:
        self.datapoints = 0
        self.started: float | None = None
        self.busy_before = 0.0  # the workers' busy seconds when the consumer first asked for a result
        self.skips = SkipLog()  # datapoints left out under on_error="skip"

    def start(self, pool: WorkerPool) -> None:
        """The consumer asks for its first result: the times count from here."""
        if self.started is None:
            self.started = time.perf_counter()
            self.busy_before = pool.busy_seconds() or 0.0

    def as_dict(self, pool: WorkerPool | None, capacity: int) -> dict[str, float]:
        if pool is None or self.started is None:
            return {}
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        out = {
            "datapoints": self.datapoints,
            "workers": pool.num_workers,
            "buffer_fill": min(1.0, pool.fill_average() / max(capacity, 1)),
            "consumer_wait_s": pool.wait_time,
            "consumer_wait_frac": min(1.0, pool.wait_time / elapsed),
        }
        busy = pool.busy_seconds()
        if busy is not None:
            out["workers_busy"] = min(1.0, max(0.0, busy - self.busy_before) / (elapsed * pool.num_workers))
        return out


class ParallelStage(ProxyDataFlow):
    """What the map stages and the runners share: a pool started in ``reset_state``, closed in ``close``."""

    _processes = True
    _pool: WorkerPool | None = None
    timeout: float | None = None
    stall_warning: float | None = 60.0
    _mapping_hooks: Any = None
    max_restarts = 0
    on_error = "raise"
    _capacity: int  # items in flight at most (set by each stage's __init__)

    def _new_pool(self) -> WorkerPool:
        raise NotImplementedError

    def _set_waits(self, timeout: float | None, stall_warning: float | None) -> None:
        who = type(self).__name__
        self.timeout = check_seconds(timeout, "timeout", who)
        self.stall_warning = check_seconds(stall_warning, "stall_warning", who)

    def _set_faults(self, max_restarts: int) -> None:
        self.max_restarts = check_max_restarts(max_restarts, type(self).__name__)

    def _pool_options(self) -> dict[str, Any]:
        """The WorkerPool arguments every stage passes alike (``timeout``, stall warning, mapping hooks, restarts)."""
        return {"timeout": self.timeout, "stall_warning": self.stall_warning, "mapping_hooks": self._mapping_hooks,
                "max_restarts": self.max_restarts}

    def set_mapping_hooks(self, hooks: Any) -> None:
        """Tell ``hooks`` about this stage's shared-memory slab mappings, now and after any restart of its
        workers (see :meth:`WorkerPool.set_mapping_hooks`); ``None`` removes them."""
        self._mapping_hooks = hooks
        if self._pool is not None:
            self._pool.set_mapping_hooks(hooks)

    def _on_reset(self) -> None:
        # not ProxyDataFlow's: a runner's workers reset their own copies, a map stage resets its source first
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

    def _own_stats(self) -> dict[str, float]:
        out = self._stats.as_dict(self._pool, self._capacity) if hasattr(self, "_stats") else {}
        if out and self.max_restarts and self._processes:  # workers replaced, and datapoints left out
            out["restarts"] = self._pool.restarts if self._pool is not None else 0
        if out and self.on_error == "skip":
            out["skipped"] = self._stats.skips.count
        return out

    def _live_pool(self) -> WorkerPool:
        """The pool to iterate with: a new one when the stage was closed since (as a closed reader opens its
        file again: ``with QueueInput(df)`` twice, ``with df`` then another loop), or when the last
        iteration was interrupted mid-receive."""
        pool = self._pool
        if pool is None:
            log.debug("%s: closed since reset_state(); starting new workers", type(self).__name__)
            self._stats = _StageStats()
            pool = self._pool = self._new_pool().start()
        elif pool.interrupted:
            log.warning("%s: the last iteration was interrupted while receiving a result; starting new workers",
                        type(self).__name__)
            self._close_pool()
            pool = self._pool = self._new_pool().start()
        return pool

    def _get(self, pool: WorkerPool) -> Any:
        self._stats.start(pool)
        return pool.get()[1]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_pool", None)  # a copy sent elsewhere starts its own workers
        state.pop("_mapping_hooks", None)  # and has its own mappings
        return state


def forever(ds: DataFlow, who: str, resumed: bool = False) -> Iterator:
    """Epoch after epoch of ``ds``; after a resume the first may have nothing left. Closing it closes the
    epoch in progress at once (not when it is collected), so ``ds`` can be iterated again right away."""
    while True:
        empty = True
        it = iter(ds)
        try:
            for dp in it:
                empty = False
                yield dp
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        if empty and not resumed:
            raise DatapointError(f"{who}: the source flow yielded nothing")
        resumed = False


def check_picklable(obj: Any, what: str, who: str, method: str) -> None:
    try:
        dumps_as_launched(obj)
    except Exception as exc:
        raise TypeError(f"{who}: {what} {describe_unpicklable(obj)} cannot be pickled, which "
                        f"start_method={method!r} needs ({exc}); define it at module level, or use "
                        "start_method='fork'") from exc
