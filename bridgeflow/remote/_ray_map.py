"""Run the map stage of a pipeline on Ray actors, on this machine or on a cluster.

:class:`RayMapData` reads its source flow in the consumer, groups ``batch_size`` datapoints per task (a
Ray call costs far more than a pipe message, so single datapoints would drown in overhead), and sends
the groups to ``num_workers`` actors that each run ``map_func``. Arguments and results travel through
Ray's object store, arrays included. At most ``max_in_flight`` groups are out at a time (bounded
memory); results come back in source order (``ordered=True``) or as they are ready.

Failures: an exception in ``map_func`` is re-raised in the consumer with its type and message, the
actor's traceback attached as ``__cause__`` (as the local parallel stages do). An actor that dies (killed,
OOM, node lost) is restarted up to ``max_restarts`` times and its unfinished groups are retried on it;
past that, or if an actor cannot start within ``start_timeout``, :class:`~bridgeflow.WorkerError` names
the actor. ``task_timeout`` bounds the wait for one group, so a ``map_func`` that hangs is an error too.

Ray: if Ray is already initialized in this process, it is used as it is. Otherwise ``reset_state()``
calls ``ray.init``: on ``ray_address`` (an existing cluster, e.g. ``"ray://head:10001"`` or ``"auto"``), else
on ``RAY_ADDRESS`` if the environment sets it, else a new local instance with ``num_workers *
num_cpus_per_worker`` CPUs, even where ``ray start`` or another program left a cluster on this machine (Ray's
own ``ray.init()`` would join that one, and refuse the CPU count). Only a Ray that this
flow initialized is shut down by ``close()`` (for a cluster that means disconnecting, not stopping it).
Actors import ``map_func``'s module: on a cluster, bridgeflow and that module must be installed on the
workers (or shipped with a Ray ``runtime_env``).

When it pays off: Ray adds a per-group cost (scheduling, object store) that local processes do not
have. On one machine :class:`~bridgeflow.MultiProcessMapData` is as fast or faster; use Ray when the map
needs more CPUs (or GPUs) than one host has, or when the cluster already runs Ray.

Example:
    >>> df = RayMapData(DataFromList(paths, shuffle=True), decode_and_augment, num_workers=32,
    ...                 ray_address="auto", batch_size=32)                 # doctest: +SKIP
"""

from __future__ import annotations

import collections
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..engine import (
    DATAPOINT_TYPES,
    DataFlow,
    ProxyDataFlow,
    WorkerError,
    check_datapoint,
    pack_exception,
    require,
    unpack_exception,
)

__all__ = ["RayMapData"]

log = logging.getLogger(__name__)

_OK, _ERR = 0, 1


class _MapActor:
    """Runs ``map_func`` over groups of datapoints inside a Ray actor process."""

    def __init__(self, map_func: Callable[[Any], Any], seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        self.map_func = map_func
        self.who = f"map_func {getattr(map_func, '__qualname__', map_func)!s}"

    def ready(self) -> tuple:
        return _OK, os.getpid()

    def map_batch(self, items: list) -> tuple:
        func, out = self.map_func, []
        try:
            for dp in items:
                r = func(dp)
                if r is not None and type(r) not in DATAPOINT_TYPES:
                    check_datapoint(r, self.who)
                out.append(r)
        except BaseException as exc:  # sent back as data, re-raised by the consumer
            return _ERR, pack_exception(exc, True)
        return _OK, out


def _check_int(value: Any, what: str, minimum: int, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"RayMapData: {what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class RayMapData(ProxyDataFlow):
    """Apply ``map_func`` to every datapoint of ``df`` on Ray actors (see the module doc).

    ``num_workers`` actors (default: the cluster's CPUs divided by ``num_cpus_per_worker``), each asking
    Ray for ``num_cpus_per_worker`` CPUs; ``batch_size`` datapoints per task; ``max_in_flight`` tasks out
    at a time (default ``2 * num_workers``). ``map_func`` returning ``None`` drops the datapoint. One
    iteration is one pass over ``df``; ``len()`` is ``len(df)``. ``stats()`` gives ``datapoints``,
    ``workers``, ``buffer_fill`` (tasks in flight / ``max_in_flight``, averaged), ``consumer_wait_s`` and
    ``consumer_wait_frac``.
    """

    def __init__(self, df: DataFlow, map_func: Callable[[Any], Any], num_workers: int | None = None,
                 ordered: bool = True, ray_address: str | None = None, num_cpus_per_worker: float = 1,
                 batch_size: int = 16, *, max_in_flight: int | None = None, max_restarts: int = 2,
                 task_timeout: float | None = None, start_timeout: float = 60.0, seed: int | None = None) -> None:
        super().__init__(df)
        if not callable(map_func):
            raise TypeError(f"RayMapData: map_func must be callable, got {map_func!r}")
        self.map_func = map_func
        self.num_workers = _check_int(num_workers, "num_workers", 1, allow_none=True)
        self.ordered = bool(ordered)
        if ray_address is not None and not isinstance(ray_address, str):
            raise TypeError(f"RayMapData: ray_address must be a string like 'auto' or 'ray://host:10001', "
                            f"got {ray_address!r}")
        self.ray_address = ray_address
        if isinstance(num_cpus_per_worker, bool) or not isinstance(num_cpus_per_worker, (int, float)) \
                or num_cpus_per_worker < 0:
            raise ValueError(f"RayMapData: num_cpus_per_worker must be a number >= 0, got {num_cpus_per_worker!r}")
        self.num_cpus_per_worker = num_cpus_per_worker
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.max_in_flight = _check_int(max_in_flight, "max_in_flight", 1, allow_none=True)
        self.max_restarts = _check_int(max_restarts, "max_restarts", 0)
        for name, value in (("task_timeout", task_timeout), ("start_timeout", start_timeout)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"RayMapData: {name} must be a positive number of seconds, got {value!r}")
        self.task_timeout = task_timeout
        self.start_timeout = start_timeout
        self.seed = seed
        self._actors: list = []
        self._owns_ray = False

    # lifecycle

    def _on_reset(self) -> None:  # not ProxyDataFlow's: the source is reset here, before Ray starts
        self._release()
        self.ds.reset_state()
        ray = require("ray", "RayMapData")
        self._ray = ray
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            address = self.ray_address or os.environ.get("RAY_ADDRESS") or None
            if address is not None:
                ray.init(address=address, **kwargs)
            else:
                n = self.num_workers
                ray.init(address="local", **kwargs,
                         num_cpus=None if n is None else max(1, int(np.ceil(n * self.num_cpus_per_worker))))
            self._owns_ray = True
            log.info("RayMapData started Ray (%s); close() shuts it down", address or "local")
        n = self.num_workers
        if n is None:
            cpus = ray.cluster_resources().get("CPU", 1)
            n = max(1, int(cpus // self.num_cpus_per_worker) if self.num_cpus_per_worker else int(cpus))
        self._n_workers = n
        self._in_flight_max = self.max_in_flight or 2 * n
        actor_cls = ray.remote(num_cpus=self.num_cpus_per_worker, max_restarts=self.max_restarts,
                               max_task_retries=self.max_restarts)(_MapActor)
        base = self.seed if self.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._actors = [actor_cls.remote(self.map_func, base + i) for i in range(n)]
        pending = {a.ready.remote(): i for i, a in enumerate(self._actors)}
        ready, not_ready = ray.wait(list(pending), num_returns=n, timeout=self.start_timeout)
        for ref in ready:
            self._get(ref, pending[ref])  # an actor that failed in __init__ raises here
        if not_ready:
            missing = sorted(pending[r] for r in not_ready)
            self._release()
            raise WorkerError(f"RayMapData: {len(missing)} of {n} Ray actors did not start within "
                              f"{self.start_timeout} s (actors {missing}); each asks for {self.num_cpus_per_worker} "
                              f"CPU and the cluster has {ray.cluster_resources().get('CPU', 0)}: lower num_workers",
                              stage="RayMapData", worker=missing[0])
        self._n = 0
        self._wait = 0.0
        self._fill_sum = 0.0
        self._fill_count = 0
        self._started: float | None = None

    def _release(self) -> None:
        actors, self._actors = self._actors, []
        if actors:
            ray = self._ray
            for a in actors:
                try:
                    ray.kill(a)
                except Exception as exc:  # pragma: no cover - Ray already gone
                    log.debug("RayMapData: killing an actor failed: %r", exc)

    def close(self) -> None:
        self._release()
        if self._owns_ray:
            self._owns_ray = False
            self._ray.shutdown()
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for key in ("_actors", "_ray", "_owns_ray"):
            state.pop(key, None)
        state["_actors"], state["_owns_ray"] = [], False
        return state

    def _own_stats(self) -> dict[str, float]:
        started = getattr(self, "_started", None)
        if started is None:
            return {}
        elapsed = max(time.perf_counter() - started, 1e-9)
        return {
            "datapoints": self._n,
            "workers": self._n_workers,
            "buffer_fill": self._fill_sum / max(self._fill_count, 1),
            "consumer_wait_s": self._wait,
            "consumer_wait_frac": min(1.0, self._wait / elapsed),
        }

    @property
    def actors(self) -> list:
        """The Ray actor handles of the workers (empty before ``reset_state()`` and after ``close()``)."""
        return list(self._actors)

    # iteration

    def _why_not_resumable(self) -> str:
        return ("RayMapData cannot save its position: the work in flight on its Ray actors is not tracked; use "
                "MultiProcessMapData to resume mid-epoch")

    def _iter_epoch(self) -> Iterator:
        if not self._actors:
            raise RuntimeError("RayMapData is closed; call reset_state() to start it again")
        if self._started is None:
            self._started = time.perf_counter()
        ray, actors = self._ray, self._actors
        load = [0] * len(actors)
        in_flight: collections.OrderedDict = collections.OrderedDict()  # ref -> actor index
        source = iter(self.ds)
        more = True

        def submit() -> None:
            nonlocal more
            group = []
            for dp in source:
                group.append(dp)
                if len(group) == self.batch_size:
                    break
            else:
                more = False
            if group:
                i = min(range(len(actors)), key=load.__getitem__)
                load[i] += 1
                in_flight[actors[i].map_batch.remote(group)] = i, group

        try:
            while more and len(in_flight) < self._in_flight_max:
                submit()
            while in_flight:
                self._fill_sum += len(in_flight) / self._in_flight_max
                self._fill_count += 1
                ref = self._next_ready(ray, in_flight)
                i, group = in_flight.pop(ref)
                load[i] -= 1
                out = self._get(ref, i, group)
                if more:
                    submit()
                for dp in out:
                    if dp is not None:
                        self._n += 1
                        yield dp
        finally:
            in_flight.clear()  # dropped results are freed by Ray's reference counting
            if hasattr(source, "close"):
                source.close()

    def _next_ready(self, ray: Any, in_flight: collections.OrderedDict) -> Any:
        refs = [next(iter(in_flight))] if self.ordered else list(in_flight)
        t0 = time.perf_counter()
        ready, _ = ray.wait(refs, num_returns=1, timeout=self.task_timeout)
        self._wait += time.perf_counter() - t0
        if not ready:
            i = in_flight[refs[0]][0]
            raise WorkerError(f"RayMapData: Ray actor {i} returned no result within task_timeout="
                              f"{self.task_timeout} s (map_func hanging?)", stage="RayMapData", worker=i)
        return ready[0]

    def _get(self, ref: Any, i: int, group: list | None = None) -> Any:
        ray = self._ray
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())  # Ray 2.30+
        for _ in range(self.max_restarts + 1):
            try:
                kind, value = ray.get(ref)
                break
            except unavailable as exc:
                # The actor's node went away (or the connection to it): Ray restarts the actor, and retries
                # its tasks while it is down, which can spend every retry before it is back. The group is sent
                # again once the actor answers; a map is a function of its group, so running it twice is safe.
                if group is None:  # at start: an actor that never answered
                    raise WorkerError(f"RayMapData: Ray actor {i} is unavailable: {_first_line(exc)}",
                                      stage="RayMapData", worker=i) from exc
                log.warning("RayMapData: Ray actor %d is unavailable (its node lost?); waiting up to "
                            "start_timeout=%s s for it to restart, then sending its group again: %s", i,
                            self.start_timeout, _first_line(exc))
                self._wait_restarted(i, exc)
                ref = self._actors[i].map_batch.remote(group)
            except ray.exceptions.RayActorError as exc:
                raise WorkerError(f"RayMapData: Ray actor {i} died and could not be restarted "
                                  f"(max_restarts={self.max_restarts}): {_first_line(exc)}",
                                  stage="RayMapData", worker=i) from exc
            except ray.exceptions.RayTaskError as exc:  # failed outside map_func, e.g. unpicklable datapoints
                raise exc.as_instanceof_cause() from None
        else:
            raise WorkerError(f"RayMapData: Ray actor {i} was unavailable {self.max_restarts + 1} times in a row "
                              f"(max_restarts={self.max_restarts})", stage="RayMapData", worker=i)
        if kind == _ERR:
            raise unpack_exception(value, f"RayMapData actor {i}")
        return value

    def _wait_restarted(self, i: int, cause: BaseException) -> None:
        """Wait up to ``start_timeout`` for actor ``i`` to answer again, or raise a WorkerError naming it."""
        ray = self._ray
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                ray.get(self._actors[i].ready.remote(), timeout=max(deadline - time.monotonic(), 0.01))
                return
            except unavailable as exc:  # its node not yet known lost, or the actor restarting: ask again
                last: BaseException = exc
                if time.monotonic() >= deadline:
                    break
                time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
            except ray.exceptions.GetTimeoutError as exc:
                last = exc
                break
            except ray.exceptions.RayActorError as exc:  # Ray gave it up: its restarts are spent
                raise WorkerError(f"RayMapData: Ray actor {i} was lost and could not be restarted "
                                  f"(max_restarts={self.max_restarts}): {_first_line(exc)}",
                                  stage="RayMapData", worker=i) from cause
        raise WorkerError(f"RayMapData: Ray actor {i} was lost (its node gone?) and did not come back within "
                          f"start_timeout={self.start_timeout} s: no node has room for it "
                          f"({self.num_cpus_per_worker} CPU) or it cannot start ({_first_line(last)})",
                          stage="RayMapData", worker=i) from cause

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
