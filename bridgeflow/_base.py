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
  continue from there (see "States" below).

How a flow is written: :class:`DataFlow` defines those public methods once (they reset on first use, let
one consumer in at a time, put the class name and format version on a state and name the flow a state
error is about) and calls *hooks* that subclasses fill, as torchdata's ``BaseNode`` does:

- ``_iter_epoch()`` yields one epoch's datapoints. Its default state counts the datapoints handed out and
  resumes by replaying the epoch that far (exact when the epoch depends only on ``self.rng`` and the
  ``children()``).
- A flow that saves its own position writes ``_begin_epoch(resume)`` instead, which begins an epoch from
  ``resume`` (the state ``load_state_dict`` took) or afresh when it is None, with ``_own_state()`` (its
  fields, between two datapoints) and ``state_fields``, the declaration of those fields that the base
  checks a state against (:mod:`bridgeflow._state_schema`); ``_take_state(state)`` adds checks between
  fields, if any. A state loaded and not yet begun from is the flow's state: ``state_dict()`` gives it back.
- ``_on_reset()`` prepares the flow in this process; it ends with ``super()._on_reset()``, so the hooks of a
  flow with two bases (``ProxyDataFlow`` and ``RNGDataFlow``) both run.
- ``_why_not_resumable()`` says why the position cannot be saved, or returns None; ``_own_stats()`` gives the
  flow's own counters (:meth:`DataFlow.stats` collects them from the whole pipeline).

States, the contract:

- **What a state is.** Plain data (ints, floats, strings, lists, dicts, None), so ``json`` and ``torch.save``
  store it. Every level of the pipeline has a dict with the flow's ``class``, a format ``version`` and the
  fields the flow declares in ``state_fields``; the children's states nest in them (``"child"``,
  ``"children"``, a stage's ``"source"``). The outermost level also has ``check``, a CRC-32 of the whole
  tree as JSON writes it.
- **What it promises.** Loaded into a freshly built flow of the same structure (before or after
  ``reset_state()``, before its first ``iter()``), the flow yields what the interrupted one would have
  yielded next: the rest of the epoch, then the following epochs, shuffles and random choices included. A
  state taken after an epoch's last datapoint resumes with that epoch's empty rest; one taken between epochs
  starts the next. Over an ordered pipeline that is one sequence, exactly. A state saved before
  ``reset_state()`` has no generator states yet (None: as ``reset_state()`` seeds them); a flow that loads it
  fills them in once it is reset, so the state it gives back before its next epoch says the same later. A
  parallel stage that reads its source ahead of its consumer and begins its source's epochs afresh (a strict
  one) also saves how far it had read (``ahead``): resumed, it reads that far at once, so an epoch left before
  its first datapoint leaves the source where the saved one did and the source's next epoch is the same; and
  what its process pool learned its tasks cost (``costs``), so that the resumed pool goes on reading as far
  ahead as the saved one (a fresh pool holds back until its first result).
- **Over an unordered stage, a multiset.** A map stage with ``ordered=False`` or a runner of several
  workers delivers in an order its workers' timing makes, so its state promises the epoch's *multiset*:
  what was delivered is never given again, what is in flight and what is still to read is each given exactly
  once, in some order. Every flow above keeps that promise exactly: a flow part-way through an item it read
  from below (the rest of a batch being unbatched, the remaining repeats of a datapoint, a cache being
  filled, a shuffle buffer, a stage's work in flight over another stage) saves its child's state *after*
  the item and keeps the item's unconsumed rest in its own state (``held``: the datapoints in the bridgeflow
  codec, base64; no pickle), since the child would give another item first. Over ordered children it
  saves the child's state *before* the item and an offset instead (no datapoints in the state). What
  cannot be kept so is refused by name: ``state_dict()`` raises ``NotResumableError`` naming the flow and
  the unordered stage under it (a flow that resumes by replaying its epoch, the default state; a runner
  whose copies hold an unordered stage; a held datapoint the codec cannot store); ``ShardData`` over an
  unordered stage is refused when built (the ranks would keep overlapping parts). Randomness inside
  ``map_func`` is not replayed.
- **What a load checks, before anything uses the state.** The header; the children's states, each the
  same way (first: a flow's length may follow from its children's states, a ``CacheData`` loaded filled);
  each declared field's type and range (a count no larger than the epoch, a replay no longer than what a
  stage can have in flight, a valid generator state...); no missing or unknown field; the flow's own checks
  between fields; then, once every field of the tree passed, the outermost
  ``check`` (so a field changed into another valid value is refused too, and the flows are left as they
  were; a state without ``check``, made by hand, is taken on its fields).
- **The errors.** :class:`~bridgeflow._state.StateMismatchError` (a ``ValueError``): a state of another
  structure, length, file or newer format, or damaged; its message starts with the path of the flow at
  fault and names the field and the value (``BatchData/MapData/DataFromList: field 'pos' of the state is
  14, above 12, ...``). :class:`~bridgeflow._state.NotResumableError` (a ``TypeError``): a flow whose
  position cannot be saved (a generator object, a network stream), saying what to do. Both are
  :class:`~bridgeflow._state.StateError`; the torch ``DataLoader``'s ``ResumeStateError`` is a
  ``StateMismatchError``. See ``docs/resuming.md`` for costs and how it is tested.

Classes written the tensorpack way (``__iter__``, ``get_data``, ``reset_state``, ``size``) work unchanged:
see :mod:`bridgeflow._tensorpack_style`.

Example:
    >>> from bridgeflow import DataFromList, MapData
    >>> with MapData(DataFromList([[1], [2]], shuffle=False), lambda dp: [dp[0] * 10]) as df:
    ...     df.reset_state()
    ...     [dp for dp in df]
    [[10], [20]]
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

from ._errors import DataFlowReentrantError, length_unknown
from ._state import (
    MAX_DEPTH,
    NotResumableError,
    StateError,
    StateMismatchError,
    check_header,
    checksum,
    child_state,
    rng_state,
    set_rng_state,
    state_or_error,
    unless_error,
    verify_checksum,
)
from ._state_schema import Children, Count, Field, Rng, apply_fields
from ._tensorpack_style import adopt, public
from .pipeline import pipeline_stats

__all__ = ["DataFlow", "ReadAhead", "epoch_live", "pending_state", "reset_once", "unordered_stage"]

log = logging.getLogger(__name__)

Datapoint = Any  # list | tuple | dict of components
_Flow = TypeVar("_Flow", bound="DataFlow")


class ReadAhead(Protocol):
    """A reader that takes a flow's datapoints ahead of its own consumer, in another thread (a CUDA
    prefetcher). Attached with :meth:`DataFlow.attach_read_ahead`, it is asked first when a state is taken:
    ``delivered_state(flow)`` returns the flow's state as of the last datapoint its consumer received,
    or None to let the flow answer for itself."""

    def delivered_state(self, source: Any) -> dict | None: ...


_claim_lock = threading.Lock()


class _Nesting(threading.local):
    """How deep this thread is in ``state_dict()`` and ``load_state_dict()`` calls: the outermost state of
    a tree carries the tree's checksum, and the outermost load checks it."""

    saving = 0
    loading = 0


_nesting = _Nesting()


def _new_claim_lock() -> None:
    global _claim_lock
    _claim_lock = threading.Lock()  # a forked child (a runner's worker) iterates flows; another thread of
    # the parent may have held the lock at the fork


os.register_at_fork(after_in_child=_new_claim_lock)


class DataFlow:
    """Base class of every flow: the public lifecycle, around hooks a subclass fills (see the module doc).

    ``class MyFlow(DataFlow, resumable=False)`` declares a flow whose position cannot be saved (its
    ``state_dict()`` raises :class:`~bridgeflow._state.NotResumableError`); see :meth:`state_dict`.
    """

    state_version: int = 1
    """The format version of this class's states; raise it when the fields change meaning."""
    state_fields: tuple[Field, ...] | None = (Rng("rng"), Children(), Count("pos"))
    """The fields of this class's states (:mod:`bridgeflow._state_schema`), declared beside ``_own_state``;
    None for a flow that checks its state itself in ``_take_state``. The default: the default state's."""
    _resumable = True
    _tensorpack_style = False  # a class of this flow had public methods moved to hooks (tensorpack_style)

    # The base's own bookkeeping. Class defaults, so that a subclass need not call DataFlow.__init__.
    __reset_done = False
    __consumer: object | None = None  # the token of the iterator now running, if any
    __epoch: Any = None  # weak reference to the iterator of the last iter(): the epoch lives while it does
    __loaded: dict | None = None  # the state load_state_dict() took, until an iter() begins from it
    __read_ahead: Any = None  # weak reference to a ReadAhead attached since the last iter()
    __pos = 0  # the default state: datapoints handed out this epoch, and the epoch's start
    __epoch_start: Any = None

    def __init_subclass__(cls, resumable: bool | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        adopt(cls, DataFlow)
        if resumable is not None:
            cls._resumable = bool(resumable)
        if "state_fields" not in cls.__dict__:
            if cls._own_state is DataFlow._own_state:  # the default state (moved back to it by adopt, too)
                cls.state_fields = DataFlow.state_fields
            elif "_own_state" in cls.__dict__:  # its own state, without a declaration: it checks it itself
                cls.state_fields = None

    # --- the public lifecycle ---------------------------------------------------------------------

    @public("_iter_epoch")
    def __iter__(self) -> Iterator[Datapoint]:
        if not self.__reset_done:
            log.debug("%s iterated before reset_state(); resetting it now", type(self).__name__)
            self.reset_state()
        if self.__consumer is not None:
            raise _reentrant(self)
        self.__read_ahead = None  # a new reader: the last one's view of the position is over
        resume, self.__loaded = self.__loaded, None
        gen = self.__guard(self._begin_epoch(resume))
        self.__epoch = weakref.ref(gen)
        return gen

    @public("_iter_epoch")
    def get_data(self) -> Iterator[Datapoint]:
        """tensorpack's older spelling of ``iter(df)``."""
        return self.__iter__()

    @public("_on_reset")
    def reset_state(self) -> None:
        """Prepare to iterate in this process: seed RNGs, open files, start workers. Called once."""
        self._on_reset()
        self.__reset_done = True
        self._settle_loaded()

    @public("_own_state")
    def state_dict(self) -> dict[str, Any]:
        """Where this flow is, as plain data: its next ``iter()`` after ``load_state_dict`` continues here.

        Take it between two datapoints the consumer received, in the thread that iterates (it is cheap:
        small dicts of integers, one per flow). Restored with ``load_state_dict`` on a
        freshly built flow of the same structure, before its first ``iter()`` (before or after
        ``reset_state()``), the flow yields exactly what this one would have yielded next, random
        choices included: the rest of the epoch in progress, then the following epochs. A state taken
        after an epoch's last datapoint resumes with that epoch's (empty) rest, so a loop
        ``for epoch in range(saved_epoch, n): for dp in df: ...`` sees the same epochs as without the
        interruption. Between epochs (an iteration ended or was dropped), the state starts the next one.

        The default, for a subclass that writes only ``__iter__`` (``_iter_epoch``), counts the datapoints
        handed out this epoch and saves it with ``self.rng``'s state (for ``RNGDataFlow``) and the states
        of ``children()`` as they were when the epoch began; resuming restores those and skips that many
        datapoints. It is exact when the epoch depends only on them (not on other attributes that change
        between epochs), and it costs one replay of the epoch so far. Write ``state_dict`` and
        ``load_state_dict`` (``_own_state`` and ``_take_state``) for anything else, or declare
        ``class F(DataFlow, resumable=False)``.
        """
        reader = self.__read_ahead() if self.__read_ahead is not None else None
        if reader is not None:  # a reader holds datapoints ahead of its consumer: its position is the consumer's
            out = reader.delivered_state(self)
            if out is not None:
                return out
        depth = _nesting.saving
        _nesting.saving = depth + 1  # the children's states are taken inside this call
        try:
            reason = self._why_not_resumable()
            if reason:
                raise NotResumableError(reason)
            if not self.__reset_done:
                self._draw_seeds()
            out = copy.deepcopy(self.__loaded) if self.__loaded is not None else self._own_state()
        except StateError as exc:
            raise exc.within(type(self).__name__) from None
        finally:
            _nesting.saving = depth
        if not isinstance(out, dict):
            raise TypeError(f"{type(self).__name__}.state_dict() returned a {type(out).__name__}, not a dict")
        out["class"] = type(self).__name__
        out["version"] = type(self).state_version
        out.pop("check", None)
        if depth == 0:  # the outermost state: one sum over the whole tree
            check = checksum(out)
            if check is not None:
                out["check"] = check
        return out

    @public("_take_state")
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a state saved by :meth:`state_dict` of a flow of the same structure; its next ``iter()``
        continues from there. A state of another structure raises ``StateMismatchError`` (a ValueError)
        naming the flow and what differs."""
        self.__read_ahead = None
        depth = _nesting.loading
        _nesting.loading = depth + 1  # the children's states are loaded inside this call
        original = state
        try:
            if depth == 0:  # the flows keep (and may complete, _settle_loaded) their parts of a copy, not the caller's
                state = _tree_copy(state)
            check_header(self, state, type(self).state_version)
            reason = self._why_not_resumable()
            if reason:
                raise NotResumableError(reason)
            fields = type(self).state_fields
            if fields is None:  # a flow that checks its own state (and loads its children)
                self._take_state(state)
            else:
                apply_fields(self, state, fields)
            self.__loaded = state
            if depth == 0:  # every field of the tree passed: now the sum, which sees the rest
                try:
                    verify_checksum(original)
                except StateError:
                    self._forget_loaded()
                    raise
                self._settle_loaded(tree=True)
        except StateError as exc:
            raise exc.within(type(self).__name__) from None
        finally:
            _nesting.loading = depth

    def attach_read_ahead(self, reader: ReadAhead) -> None:
        """Let ``reader``, which takes this flow's datapoints ahead of its own consumer, answer
        ``state_dict()`` until the next ``iter()`` or ``load_state_dict()`` (see :class:`ReadAhead`).
        Held by a weak reference."""
        self.__read_ahead = weakref.ref(reader)

    @public("_own_stats")  # super().stats() in a moved stats(): the parents' own (flat) counters
    def stats(self) -> dict[str, dict[str, float]]:
        """The counters of every stage in the pipeline under this flow (this one included) that keeps
        them, by path: ``{"BatchData/MultiProcessMapData": {"buffer_fill": 0.9, ...}}``. See
        :func:`bridgeflow.pipeline.bottleneck` for what they say."""
        return pipeline_stats(self)

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
        """The flows this one reads from (used by ``close()``, ``stats()``, ``PrintData`` and the default
        state)."""
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

    def __len__(self) -> int:
        raise length_unknown(f"{type(self).__name__} has no known length; iterate it to count")

    def size(self) -> int:
        """tensorpack's older spelling of ``len(df)``."""
        return len(self)

    def __enter__(self: _Flow) -> _Flow:  # ``with MapData(...) as df``: df is a MapData
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        # A copy (sent to a worker) starts fresh: not reset, not being iterated, read by nobody.
        state = self.__dict__.copy()
        for name in ("__reset_done", "__consumer", "__read_ahead", "__epoch"):
            state.pop("_DataFlow" + name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # --- hooks ------------------------------------------------------------------------------------

    def _iter_epoch(self) -> Iterator[Datapoint]:
        """Yield one epoch's datapoints (a hook: a tensorpack-style ``__iter__`` or ``get_data`` becomes it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__")

    def _begin_epoch(self, resume: dict | None) -> Iterator[Datapoint]:
        """Begin an epoch, from ``resume`` (the state ``load_state_dict`` took) or afresh (a hook).

        The default runs ``_iter_epoch()``; with the default state it counts the datapoints handed out and,
        to resume, restores the epoch's start (``self.rng`` and the children's states, loaded already)
        and skips the datapoints delivered before the state was saved. It runs at ``iter()`` time, so an
        iterator dropped before its first datapoint still ends the epoch.
        """
        if type(self)._own_state is not DataFlow._own_state or not type(self)._resumable:
            return self._iter_epoch()
        rng = getattr(self, "rng", None)
        skip = 0
        if resume is not None:
            if resume["rng"] is not None:
                if rng is None:
                    raise StateMismatchError("the state holds an rng, this flow has none", [type(self).__name__])
                set_rng_state(rng, resume["rng"])
            self.__epoch_start = (resume["rng"], resume["children"])
            skip = resume["pos"]
        else:
            self.__epoch_start = (state_or_error(rng_state, rng),
                                  [state_or_error(child_state, c) for c in self.children()])
        self.__pos = 0
        it = self._iter_epoch()
        for i in range(skip):
            try:
                next(it)
            except StopIteration:
                raise StateMismatchError(
                    f"resuming replays the epoch up to datapoint {skip}, but it ended after {i}: the flow's "
                    "__iter__ does not depend only on its children and self.rng (the default state); give it "
                    "state_dict() and load_state_dict()", [type(self).__name__]) from None
        self.__pos = skip
        return self.__counted(it)

    def _on_reset(self) -> None:
        """Prepare this flow in this process (a hook; a tensorpack-style ``reset_state`` becomes it). End
        with ``super()._on_reset()``."""

    def _draw_seeds(self) -> None:
        """A state asked before ``reset_state()``: draw now the seeds that ``reset_state()`` would draw at random,
        so that the state says where the first epoch begins (a hook; ``RNGDataFlow`` seeds its generator)."""

    def _own_state(self) -> dict:
        """This flow's own fields between two datapoints (a hook; see :meth:`state_dict` for the default)."""
        if type(self)._begin_epoch is not DataFlow._begin_epoch:
            raise NotResumableError(f"{type(self).__module__}.{type(self).__qualname__} cannot save its position "
                                    "(it begins its epochs itself but has no state_dict())")
        stage = unordered_stage(self)
        if stage is not None:
            raise NotResumableError(
                f"it resumes by replaying its epoch (the default state), and the unordered {stage} under it would "
                "give other datapoints in another order: give the flow a state_dict() of its own, or make that "
                "stage ordered")
        if self._in_epoch():
            rng, children = self.__epoch_start
            return {"rng": unless_error(rng), "children": [unless_error(c) for c in children], "pos": self.__pos}
        children = self.children()
        return {"rng": rng_state(getattr(self, "rng", None)), "pos": 0,
                "children": [child_state(c, i if len(children) > 1 else None) for i, c in enumerate(children)]}

    def _take_state(self, state: dict) -> None:
        """Checks between the fields of a state (a hook): ``state_fields`` declares each field, and the base
        checks them and loads the children after this; a flow without a declaration checks everything here
        and loads its children. What ``_begin_epoch`` needs of the state comes back as its ``resume``."""

    def _unordered(self) -> bool:
        """Whether this flow delivers in an order of its workers' timing (an unordered stage, a hook): its
        state then promises a multiset, and the flows above keep what they hold (see the module doc)."""
        return False

    def _why_not_resumable(self) -> str | None:
        """Why this flow cannot save its position (a reason naming what to do), or None (a hook)."""
        if not type(self)._resumable:
            return "declared resumable=False: its position cannot be saved"
        return None

    def _own_stats(self) -> dict[str, float]:
        """This flow's own counters, for :meth:`stats` (a hook; empty for plain flows)."""
        return {}

    # --- the base's own machinery -----------------------------------------------------------------

    def _in_epoch(self) -> bool:
        ref = self.__epoch
        gen = ref() if ref is not None else None
        return gen is not None and gen.gi_frame is not None

    def _reset_done(self) -> bool:
        return self.__reset_done

    def _forget_loaded(self) -> None:
        """Drop the states loaded into this flow and the flows under it (a state refused as a whole)."""
        self.__loaded = None
        for child in _children_of(self):
            if isinstance(child, DataFlow):
                child._forget_loaded()

    def _pending_state(self) -> dict | None:
        return self.__loaded

    def _settle_loaded(self, tree: bool = False) -> None:
        """Complete the loaded state of this flow (and, with ``tree``, of the flows under it) where it was saved
        before ``reset_state()`` (a generator's state None), once the flow is reset: the state then says what
        its next epoch begins from, so taking it again before that epoch gives a state that resumes the same
        later too (:meth:`bridgeflow._state_schema.Field.settle`). In place: a parent's loaded state holds its
        children's."""
        loaded, fields = self.__loaded, type(self).state_fields
        if loaded is not None and fields and self.__reset_done:
            for f in fields:
                f.settle(self, loaded)
        if tree:
            for child in _children_of(self):
                if isinstance(child, DataFlow):
                    child._settle_loaded(tree=True)

    def __guard(self, it: Iterator) -> Iterator:
        # The flow counts as iterated from this iterator's first next() until it ends, is closed or is
        # collected. The check is repeated here because two iterators may both be created before either
        # starts: the second to start is refused. A never-started iterator holds nothing (its finally
        # would never run), so it cannot block the flow forever.
        token = object()
        try:
            with _claim_lock:  # check-and-set as one step (free-threaded Python switches anywhere)
                if self.__consumer is not None:
                    raise _reentrant(self)
                self.__consumer = token
            yield from it
        finally:
            if self.__consumer is token:
                self.__consumer = None
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def __counted(self, it: Iterator) -> Iterator:
        try:
            for dp in it:
                self.__pos += 1
                yield dp
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()


def _tree_copy(value: Any, depth: int = 0) -> Any:
    """The dicts and lists of a state copied, anything else shared: a state is not checked yet, and copying
    a live object in it (deepcopy pickles) is what the checks refuse. Deeper than ``MAX_DEPTH`` levels it is
    refused (a crafted one would end in RecursionError, which is no StateError)."""
    if depth > MAX_DEPTH:
        raise StateMismatchError(f"the state is nested deeper than {MAX_DEPTH} levels: no pipeline saves one")
    if isinstance(value, dict):
        return {k: _tree_copy(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_tree_copy(v, depth + 1) for v in value]
    return value


def _reentrant(flow: DataFlow) -> DataFlowReentrantError:
    return DataFlowReentrantError(
        f"{type(flow).__name__} is already being iterated by another consumer; finish, close() or "
        "drop the first iterator before starting a second one (wrap the flow twice to read it twice)"
    )


def epoch_live(flow: DataFlow) -> bool:
    """Whether ``flow`` is inside an epoch: the iterator of its last ``iter()`` exists and has not ended.

    A state taken then continues that epoch; otherwise it starts the next one. An iterator that was
    closed, exhausted or dropped (even before its first datapoint) ends its epoch.
    """
    return flow._in_epoch()


def unordered_stage(flow: Any, itself: bool = False) -> str | None:
    """The path (from ``flow``'s child, or ``flow`` when ``itself``) of the first flow under ``flow`` whose
    order is a matter of timing (``_unordered()``: a map stage with ``ordered=False``, a runner of several
    workers), or None."""
    start = [flow] if itself else _children_of(flow)
    stack = [(child, type(child).__name__) for child in reversed(start)]
    seen: set[int] = set()
    while stack:
        child, path = stack.pop()
        if id(child) in seen:
            continue
        seen.add(id(child))
        if isinstance(child, DataFlow) and child._unordered():
            return path
        stack.extend((c, f"{path}/{type(c).__name__}") for c in reversed(_children_of(child)))
    return None


def _children_of(flow: Any) -> list:
    children = getattr(flow, "children", None)
    try:
        return list(children()) if callable(children) else []
    except Exception:  # a duck-typed flow's own children(): nothing to see through
        return []


def pending_state(flow: DataFlow) -> dict | None:
    """The state ``load_state_dict`` gave ``flow`` that no ``iter()`` has begun from yet (a parallel stage
    that starts its workers in ``reset_state`` starts them from it)."""
    return flow._pending_state()


def reset_once(df: Any) -> None:
    """``df.reset_state()`` unless ``df`` is a DataFlow that was reset already (a duck-typed flow, which
    cannot say, is reset)."""
    if not (isinstance(df, DataFlow) and df._reset_done()):
        df.reset_state()
