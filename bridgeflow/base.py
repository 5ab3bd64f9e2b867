"""The DataFlow contract: a length-free, resettable, closable iterable of datapoints.

A *datapoint* is a list/tuple of components or a dict of named components. A flow is any object with
``__iter__`` yielding datapoints; this module gives the lifecycle around it:

- ``reset_state()`` is called once, in the process (and thread) that will iterate, before the first
  ``__iter__``. RNGs are seeded there and parallel flows start their workers there. If a consumer forgets,
  the first ``__iter__`` calls it.
- ``__len__`` is optional. A flow that cannot know its length raises :class:`LengthUnknownError`, a
  ``TypeError``, so ``list(df)`` still works.
- ``close()`` releases whatever the flow holds (threads, processes, shared memory, files). It is
  idempotent, recurses through wrapped flows, and runs on ``with`` exit.
- One flow may not be iterated by two consumers at once: the second ``iter()`` raises
  :class:`DataFlowReentrantError` until the first iterator is exhausted, closed or garbage-collected.
- ``state_dict()`` saves where the flow is, between two datapoints its consumer received;
  ``load_state_dict(state)`` on a freshly built flow of the same structure makes its next ``iter()``
  continue from there (see :meth:`DataFlow.state_dict` and :mod:`bridgeflow.state`).

Example:
    >>> from bridgeflow import DataFromList, MapData
    >>> with MapData(DataFromList([[1], [2]], shuffle=False), lambda dp: [dp[0] * 10]) as df:
    ...     df.reset_state()
    ...     [dp for dp in df]
    [[10], [20]]
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from .errors import DataFlowReentrantError, LengthUnknownError
from .state import (
    NotResumableError,
    StateError,
    StateMismatchError,
    check_count,
    check_header,
    check_rng_field,
    child_state,
    field,
    load_child,
    load_children,
    rng_state,
    set_rng_state,
)

__all__ = [
    "DataFlow", "ProxyDataFlow", "RNGDataFlow", "as_dataflow", "epoch_live", "get_rng", "iter_flows",
    "worker_seed_scope",
]

log = logging.getLogger(__name__)

Datapoint = Any  # list | tuple | dict of components


def _guard_iter(original):
    """Wrap a subclass's ``__iter__`` with auto-reset, the one-consumer-at-a-time guard and, for flows that
    use the default state (count and skip), the count of datapoints handed out this epoch.

    The guard acts only for the ``__iter__`` that ``iter(obj)`` resolves to; a subclass calling
    ``super().__iter__()`` reaches the parent's original iterator unguarded.
    """

    @functools.wraps(original)
    def __iter__(self):
        if type(self).__iter__ is not __iter__:  # a super() call from a subclass
            return original(self)
        if not self._bf_reset_done:
            log.debug("%s iterated before reset_state(); resetting it now", type(self).__name__)
            self.reset_state()
        if self._bf_iterating is not None:
            raise _reentrant(self)
        if self._bf_reader is not None:  # a new reader: the last one's view of the position is over
            self._bf_reader = None
        if self._bf_state_mode == "count":
            gen = _guarded_counting(self, _replay_begin(self, original))
        else:
            gen = _guarded(self, original(self))
        self._bf_gen = weakref.ref(gen)  # the epoch is in progress while this generator lives
        return gen

    __iter__._bf_guarded = True
    return __iter__


def _reentrant(flow: DataFlow) -> DataFlowReentrantError:
    return DataFlowReentrantError(
        f"{type(flow).__name__} is already being iterated by another consumer; finish, close() or "
        "drop the first iterator before starting a second one (wrap the flow twice to read it twice)"
    )


_claim_lock = threading.Lock()


def _guarded(flow: DataFlow, it: Iterator) -> Iterator:
    # The flow counts as iterated from this iterator's first next() until it ends, is closed or is
    # collected. The check is repeated here because two iterators may both be created before either
    # starts: the second to start is refused. A never-started iterator holds nothing (its finally
    # would never run), so it cannot block the flow forever.
    token = object()
    try:
        with _claim_lock:  # check-and-set as one step (free-threaded Python switches anywhere)
            if flow._bf_iterating is not None:
                raise _reentrant(flow)
            flow._bf_iterating = token
        yield from it
    finally:
        if flow._bf_iterating is token:
            flow._bf_iterating = None
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _guarded_counting(flow: DataFlow, it: Iterator) -> Iterator:
    """``_guarded`` that also counts the datapoints handed out (the default state's position)."""
    token = object()
    try:
        with _claim_lock:
            if flow._bf_iterating is not None:
                raise _reentrant(flow)
            flow._bf_iterating = token
        for dp in it:
            flow._bf_pos += 1
            yield dp
    finally:
        if flow._bf_iterating is token:
            flow._bf_iterating = None
        close = getattr(it, "close", None)
        if close is not None:
            close()


def epoch_live(flow: DataFlow) -> bool:
    """Whether ``flow`` is inside an epoch: the iterator of its last ``iter()`` exists and has not ended.

    A state taken then continues that epoch; otherwise it starts the next one. An iterator that was
    closed, exhausted or dropped (even before its first datapoint) ends its epoch.
    """
    ref = flow.__dict__.get("_bf_gen")
    gen = ref() if ref is not None else None
    return gen is not None and gen.gi_frame is not None


def take_pending(flow: DataFlow) -> dict | None:
    """The state loaded into ``flow`` and not yet applied, now handed to the caller (its next epoch)."""
    return flow.__dict__.pop("_bf_pending", None)


def _replay_begin(flow: DataFlow, original: Any) -> Iterator:
    """Begin an epoch of a flow with the default state: restore the saved epoch start (``self.rng`` and
    the children's states, loaded already) and skip the datapoints delivered before the state was saved.

    Runs at ``iter()`` time, so an iterator dropped before its first datapoint still ends the epoch.
    """
    pending = take_pending(flow)
    skip = 0
    rng = getattr(flow, "rng", None)
    if pending is not None:
        if pending["rng"] is not None:
            if rng is None:
                raise StateMismatchError("the state holds an rng, this flow has none", [type(flow).__name__])
            set_rng_state(rng, pending["rng"])
        flow._bf_epoch_start = (pending["rng"], pending["children"])
        skip = pending["pos"]
    else:
        flow._bf_epoch_start = (_try(rng_state, rng), [_try(child_state, c) for c in flow.children()])
    flow._bf_pos = 0
    it = original(flow)
    for i in range(skip):
        try:
            next(it)
        except StopIteration:
            raise StateMismatchError(
                f"resuming replays the epoch up to datapoint {skip}, but it ended after {i}: the flow's "
                "__iter__ does not depend only on its children and self.rng (the default state); give it "
                "state_dict() and load_state_dict()", [type(flow).__name__]) from None
    flow._bf_pos = skip
    return it


def _try(fn: Any, arg: Any) -> Any:
    """``fn(arg)``, or the StateError it raised (a state taken at every epoch start must not stop the
    iteration of a flow nobody saves; the error is raised when a state is asked for)."""
    try:
        return fn(arg)
    except StateError as exc:
        return exc


def _raise_if_error(value: Any) -> Any:
    if isinstance(value, StateError):
        raise type(value)(value.reason, value.path)
    return value


def _wrap_state_dict(original):
    @functools.wraps(original)
    def state_dict(self) -> dict:
        if type(self).state_dict is not state_dict:  # a super() call: the outermost wrapper adds the header
            return original(self)
        reader = self._bf_reader() if self._bf_reader is not None else None
        if reader is not None:  # a reader holds datapoints ahead of its consumer: its position is the consumer's
            out = reader.delivered_state(self)
            if out is not None:
                return out
        try:
            out = original(self)
        except StateError as exc:
            raise exc.within(type(self).__name__) from None
        if not isinstance(out, dict):
            raise TypeError(f"{type(self).__name__}.state_dict() returned a {type(out).__name__}, not a dict")
        out["class"] = type(self).__name__
        out["version"] = type(self).state_version
        return out

    state_dict._bf_wrapped = True
    return state_dict


def _wrap_load_state_dict(original):
    @functools.wraps(original)
    def load_state_dict(self, state: dict) -> None:
        if type(self).load_state_dict is not load_state_dict:
            return original(self, state)
        self._bf_reader = None
        try:
            check_header(self, state, type(self).state_version)
            original(self, state)
        except StateError as exc:
            raise exc.within(type(self).__name__) from None

    load_state_dict._bf_wrapped = True
    return load_state_dict


def _state_mode(cls: type) -> str:
    """How ``cls`` saves its position: ``own`` (its state_dict fits its __iter__), ``count`` (the default:
    count and skip), ``unsupported`` (a bridgeflow flow without state) or ``off`` (``resumable=False``)."""
    mro = cls.__mro__
    iter_owner = next(c for c in mro if "__iter__" in c.__dict__)
    state_owner = next((c for c in mro if c.__dict__.get("state_dict") not in (None, DataFlow.state_dict)), DataFlow)
    explicit = iter_owner.__dict__.get("_bf_state_mode")
    if explicit is not None and mro.index(iter_owner) <= mro.index(state_owner):
        return explicit
    if state_owner is not DataFlow and mro.index(state_owner) <= mro.index(iter_owner):
        return "own"
    return "unsupported" if iter_owner.__module__.split(".")[0] == "bridgeflow" else "count"


def _adapt_old_style(cls: type) -> None:
    """tensorpack's older protocol: a class that defines ``get_data()`` but not ``__iter__`` iterates with it,
    one that defines ``size()`` but not ``__len__`` has it as its length (as tensorpack maps them).

    ``get_data`` then becomes the guarded ``__iter__`` (auto-reset, one consumer at a time, the default
    state's count), and calling ``df.get_data()`` goes through it too; a subclass's ``super().get_data()``
    still reaches the parent's own generator.
    """
    ns = cls.__dict__
    get_data = ns.get("get_data")
    if "__iter__" not in ns and callable(get_data) and not getattr(get_data, "_bf_old_style", False):
        cls.__iter__ = get_data  # wrapped by the guard next, like any __iter__
        cls.get_data = _old_style_get_data(get_data)
    size = ns.get("size")
    if "__len__" not in ns and callable(size):
        cls.__len__ = size


def _old_style_get_data(original):
    @functools.wraps(original)
    def get_data(self):
        cls = type(self)
        if cls.get_data is get_data and getattr(cls.__iter__, "__wrapped__", None) is original:
            return iter(self)  # the guarded __iter__ made of this very get_data
        return original(self)  # a super() call, or a subclass iterating with its own __iter__

    get_data._bf_old_style = True
    return get_data


def _mark_reset(original):
    @functools.wraps(original)
    def reset_state(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        self._bf_reset_done = True
        return result

    reset_state._bf_marks_reset = True
    return reset_state


class DataFlow:
    """Base class of every flow. Subclasses implement ``__iter__`` and, when they can, ``__len__``.

    tensorpack's older protocol works too: a subclass defining ``get_data()`` and ``size()`` instead is
    iterated with them (with the same guard and default state as an ``__iter__``).

    ``class MyFlow(DataFlow, resumable=False)`` declares a flow whose position cannot be saved (its
    ``state_dict()`` raises :class:`~bridgeflow.state.NotResumableError`); see :meth:`state_dict`.
    """

    _bf_reset_done = False
    _bf_iterating: object | None = None  # the token of the running guarded iterator, if any
    # A weak reference to a reader that takes datapoints ahead of its consumer in another thread (e.g. a
    # CUDA prefetcher): ``reader.delivered_state(flow)`` gives the state as of what its consumer received
    # (None: compute it here). Set by the reader after its ``iter()``; a new ``iter()`` clears it.
    _bf_reader: Any = None
    _bf_state_mode = "count"
    _bf_pos = 0
    state_version: int = 1
    """The format version of this class's states; raise it when the fields change meaning."""

    def __init_subclass__(cls, resumable: bool | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _adapt_old_style(cls)
        it = cls.__dict__.get("__iter__")
        if it is not None and not getattr(it, "_bf_guarded", False):
            cls.__iter__ = _guard_iter(it)
        rs = cls.__dict__.get("reset_state")
        if rs is not None and not getattr(rs, "_bf_marks_reset", False):
            cls.reset_state = _mark_reset(rs)
        for name, wrap in (("state_dict", _wrap_state_dict), ("load_state_dict", _wrap_load_state_dict)):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_bf_wrapped", False):
                setattr(cls, name, wrap(fn))
        if resumable is not None:
            cls._bf_resumable = bool(resumable)
        if "_bf_state_mode" not in cls.__dict__:
            off = not getattr(cls, "_bf_resumable", True) and "state_dict" not in cls.__dict__
            cls._bf_state_mode = "off" if off else _state_mode(cls)
        if cls._bf_state_mode != "own" and "state_dict" not in cls.__dict__:
            # an inherited state_dict was written for another __iter__: take the default (or its refusal)
            cls.state_dict = DataFlow.state_dict
            cls.load_state_dict = DataFlow.load_state_dict

    def __iter__(self) -> Iterator[Datapoint]:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")

    def __len__(self) -> int:
        raise LengthUnknownError(f"{type(self).__name__} has no known length; iterate it to count")

    def reset_state(self) -> None:
        """Prepare to iterate in this process: seed RNGs, open files, start workers. Called once."""
        self._bf_reset_done = True

    def close(self) -> None:
        """Release threads, processes, shared memory and files. Idempotent; recursive through children."""
        seen: set[int] = set()
        for child in self.children():
            if id(child) in seen:  # the same flow read twice (ConcatData([a, a])) is closed once
                continue
            seen.add(id(child))
            close = getattr(child, "close", None)  # a duck-typed (tensorpack-style) flow may have none
            if close is not None:
                close()

    def children(self) -> list[DataFlow]:
        """The flows this one reads from (used by ``close()``, ``stats``, ``PrintData`` and the default
        ``state_dict()``)."""
        return []

    def set_epoch(self, epoch: int) -> None:
        """Make the shuffled sources in this pipeline read epoch ``epoch``'s order next.

        Forwarded to the children, like ``close()``; shuffled random-access sources (``DataFromList``, the
        LMDB, HDF5 and npz readers) act on it. Call it before each epoch, as with torch's
        ``DistributedSampler``: with the same seeds every rank then reads the same order (and its own part
        of it, when sharded). A runner's workers iterate their own copies, which it does not reach.
        """
        seen: set[int] = set()
        for child in self.children():
            if id(child) not in seen:
                seen.add(id(child))
                method = getattr(child, "set_epoch", None)
                if method is not None:
                    method(epoch)

    def state_dict(self) -> dict:
        """Where this flow is, as plain data: its next ``iter()`` after ``load_state_dict`` continues here.

        Take it between two datapoints the consumer received, in the thread that iterates (it is cheap:
        small dicts of integers, one per flow). Restored with ``load_state_dict`` on a
        freshly built flow of the same structure, before its first ``iter()`` (before or after
        ``reset_state()``), the flow yields exactly what this one would have yielded next, random
        choices included: the rest of the epoch in progress, then the following epochs. A state taken
        after an epoch's last datapoint resumes with that epoch's (empty) rest, so a loop
        ``for epoch in range(saved_epoch, n): for dp in df: ...`` sees the same epochs as without the
        interruption. Between epochs (an iteration ended or was dropped), the state starts the next one.

        The default, for a subclass that writes only ``__iter__``, counts the datapoints handed out
        this epoch and saves it with ``self.rng``'s state (for ``RNGDataFlow``) and the states of
        ``children()`` as they were when the epoch began; resuming restores those and skips that many
        datapoints. It is exact when ``__iter__`` depends only on them (not on other attributes that
        change between epochs), and it costs one replay of the epoch so far. Override ``state_dict`` and
        ``load_state_dict`` for anything else, or declare ``class F(DataFlow, resumable=False)``.
        """
        reason = self._bf_not_resumable()
        if reason:
            raise NotResumableError(reason)
        pending = self.__dict__.get("_bf_pending")
        if pending is not None:
            return dict(pending)
        if epoch_live(self):
            rng, children = self._bf_epoch_start
            return {"rng": _raise_if_error(rng), "children": [_raise_if_error(c) for c in children],
                    "pos": self._bf_pos}
        children = self.children()
        return {"rng": rng_state(getattr(self, "rng", None)), "pos": 0,
                "children": [child_state(c, i if len(children) > 1 else None) for i, c in enumerate(children)]}

    def load_state_dict(self, state: dict) -> None:
        """Take a state saved by :meth:`state_dict` of a flow of the same structure; its next ``iter()``
        continues from there. A state of another structure raises ``StateMismatchError`` (a ValueError)
        naming the flow and what differs."""
        reason = self._bf_not_resumable()
        if reason:
            raise NotResumableError(reason)
        rng = check_rng_field(state)
        children = field(state, "children", list)
        pos = check_count(state, "pos")
        load_children(self.children(), children)
        self._bf_pending = {"rng": rng, "children": children, "pos": pos}

    def _bf_not_resumable(self) -> str | None:
        """Why this flow cannot be resumed (a reason naming what to do), or None."""
        mode = self._bf_state_mode
        if mode == "off":
            return "declared resumable=False: its position cannot be saved"
        if mode == "unsupported":
            return (f"{type(self).__module__}.{type(self).__qualname__} cannot save its position (it has no "
                    "state_dict())")
        return None

    def stats(self) -> dict[str, float]:
        """Counters that help find the bottleneck (queue fill, wait times). Empty for plain flows."""
        return {}

    def get_data(self) -> Iterator[Datapoint]:
        """tensorpack's older spelling of ``iter(df)``."""
        return iter(self)

    def size(self) -> int:
        """tensorpack's older spelling of ``len(df)``."""
        return len(self)

    def __enter__(self) -> DataFlow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # A copy (sent to a worker) starts fresh: not reset, not being iterated.
        state = self.__dict__.copy()
        state.pop("_bf_reset_done", None)
        state.pop("_bf_iterating", None)
        state.pop("_bf_reader", None)
        state.pop("_bf_gen", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


DataFlow.state_dict = _wrap_state_dict(DataFlow.state_dict)
DataFlow.load_state_dict = _wrap_load_state_dict(DataFlow.load_state_dict)


def as_dataflow(ds: Any, who: str = "DataFlow") -> DataFlow:
    """``ds`` itself if it is a flow (a DataFlow, or any object with ``__iter__`` and ``reset_state``);
    a plain iterable (a list, a generator) wrapped in ``DataFromIterable``; else a ``TypeError``."""
    if isinstance(ds, DataFlow) or (hasattr(ds, "__iter__") and hasattr(ds, "reset_state")):
        return ds
    if not hasattr(ds, "__iter__"):
        raise TypeError(f"{who} wraps a DataFlow or iterable, got {type(ds).__name__}")
    from .sources import DataFromIterable  # sources imports this module

    return DataFromIterable(ds)


class ProxyDataFlow(DataFlow):
    """A flow that wraps one other flow, ``self.ds``; by default it forwards everything to it."""

    _bf_state_mode = "own"

    def __init__(self, ds: DataFlow) -> None:
        self.ds = as_dataflow(ds, type(self).__name__)

    def reset_state(self) -> None:
        self.ds.reset_state()

    def __len__(self) -> int:
        return len(self.ds)

    def __iter__(self) -> Iterator[Datapoint]:
        return iter(self.ds)

    def children(self) -> list[DataFlow]:
        return [self.ds]

    def state_dict(self) -> dict:
        """The wrapped flow's state under ``"child"``: a flow that holds nothing between two datapoints
        (a map, a filter) is wherever its child is."""
        return {"child": child_state(self.ds)}

    def load_state_dict(self, state: dict) -> None:
        load_child(self.ds, field(state, "child", dict))


# --- random number generators -------------------------------------------------------------------

_seed_local = threading.local()


class worker_seed_scope:
    """Within this scope, ``get_rng`` derives generators from ``seed`` (used by parallel workers).

    Parallel stages enter it in each worker, with a distinct seed, around ``reset_state()`` of the
    worker's copy of the flow, so two workers never draw the same random stream.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)

    def __enter__(self) -> worker_seed_scope:
        self._prev = getattr(_seed_local, "seed", None)
        _seed_local.seed = self.seed
        return self

    def __exit__(self, *exc: object) -> None:
        _seed_local.seed = self._prev


def get_rng(obj: object = None, seed: int | None = None) -> np.random.RandomState:
    """A ``RandomState`` for ``obj``: reproducible when ``seed`` is given, distinct per worker.

    With ``seed=None`` outside a worker the generator is seeded from OS entropy. Inside a worker scope
    the worker's seed is mixed in, so copies of one flow in different workers draw different streams
    while staying reproducible for a fixed ``seed``.
    """
    worker = getattr(_seed_local, "seed", None)
    if seed is None and worker is None:
        return np.random.RandomState(int(np.random.SeedSequence().generate_state(1)[0]))
    entropy = 0 if seed is None else int(seed) & 0xFFFFFFFFFFFFFFFF
    # The worker goes into the spawn key, not the entropy list: SeedSequence pads entropy with zeros,
    # so [seed, 0] would equal [seed] and worker 0 would repeat the consumer's stream.
    spawn_key = () if worker is None else (int(worker) & 0xFFFFFFFFFFFFFFFF, int(seed is None))
    state = np.random.SeedSequence(entropy, spawn_key=spawn_key).generate_state(1)[0]
    return np.random.RandomState(int(state))


class RNGDataFlow(DataFlow):
    """A flow with ``self.rng``, a ``numpy.random.RandomState`` seeded in ``reset_state()``.

    Set ``self.seed`` (subclasses take a ``seed=`` argument) for reproducible output.
    """

    seed: int | None = None
    rng: np.random.RandomState

    def reset_state(self) -> None:
        self.rng = get_rng(self, self.seed)


def iter_flows(df: DataFlow, prefix: str = "") -> Iterator[tuple[str, DataFlow]]:
    """Walk a pipeline depth-first, yielding ``(path, flow)``; the path reads like ``Batch/Map/List``."""
    seen: set[int] = set()

    def walk(node: Any, path: str) -> Iterator[tuple[str, DataFlow]]:
        if id(node) in seen:
            return
        seen.add(id(node))
        name = f"{path}/{type(node).__name__}" if path else type(node).__name__
        yield name, node
        children = node.children() if isinstance(node, DataFlow) else []
        for child in children:
            yield from walk(child, name)

    yield from walk(df, prefix)
