"""Saving and restoring where a flow is: plain-data states, their checks and their errors.

A flow's ``state_dict()`` is a dict of plain data (ints, floats, strings, lists, dicts, ``None``) with the
flow's class name and a format version at every level, so ``json`` and ``torch.save`` store it as it is.
A proxy keeps its child's state under ``"child"``, a flow of several children a list under
``"children"``. ``load_state_dict(state)`` checks the state against the flow before taking it: a state
of another structure, length, file or a newer format raises :class:`StateMismatchError` (a
``ValueError``) whose message starts with the path of the flow at fault, e.g.
``BatchData/MapData/DataFromList: ...``.

This module holds what every flow's implementation shares: the errors, the header checks, and the
encoding of numpy random generators as plain data. See ``DataFlow.state_dict`` for the contract.

Example:
    >>> import json
    >>> from bridgeflow import DataFromList
    >>> df = DataFromList([[i] for i in range(5)], shuffle=True, seed=0)
    >>> it = iter(df); first = [next(it), next(it)]
    >>> saved = json.dumps(df.state_dict())
    >>> again = DataFromList([[i] for i in range(5)], shuffle=True, seed=0)
    >>> again.load_state_dict(json.loads(saved))
    >>> first + list(again) == first + list(it)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import BridgeflowError

__all__ = [
    "NotResumableError",
    "StateError",
    "StateMismatchError",
    "expect_field",
    "field",
    "check_count",
    "check_plain",
    "load_children",
    "rng_from_state",
    "rng_state",
    "set_rng_state",
    "state_or_error",
    "unless_error",
]

RESERVED = ("class", "version")


class StateError(BridgeflowError):
    """A state that cannot be taken or used; ``path`` names the flow at fault from the outermost one."""

    def __init__(self, reason: str, path: Sequence[str] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = list(path)

    def __str__(self) -> str:
        return f"{'/'.join(self.path)}: {self.reason}" if self.path else self.reason

    def __reduce__(self) -> tuple:
        return type(self), (self.reason, self.path)

    def within(self, name: str) -> StateError:
        """A copy of this error one level further out, under the flow named ``name``."""
        err = type(self)(self.reason, [name, *self.path])
        err.__traceback__ = self.__traceback__
        return err

    def renamed_first(self, name: str) -> StateError:
        err = type(self)(self.reason, [name, *self.path[1:]])
        err.__traceback__ = self.__traceback__
        return err


class StateMismatchError(StateError, ValueError):
    """A state saved from another flow: another class at some depth, another length, file or version."""


class NotResumableError(StateError, TypeError):
    """A flow whose position cannot be saved (a generator object, a network stream); says what to do."""


def check_header(flow: Any, state: Any, version: int) -> None:
    """``state`` is a dict saved by a flow of ``flow``'s class, in a format version this code reads."""
    name = type(flow).__name__
    if not isinstance(state, dict):
        raise StateMismatchError(f"a state must be a dict, got {type(state).__name__}")
    saved = state.get("class")
    if saved is None:
        raise StateMismatchError("the dict names no flow class: it is not a state saved by state_dict()")
    if saved != name:
        raise StateMismatchError(f"the state was saved by a {saved}, this flow is a {name}: the state "
                                 "comes from a pipeline of another structure")
    v = state.get("version")
    if not isinstance(v, int) or isinstance(v, bool):
        raise StateMismatchError(f"the state has no format version (got {v!r})")
    if v > version:
        raise StateMismatchError(f"the state has format version {v}, newer than this bridgeflow's {version}; "
                                 "load it with the bridgeflow that saved it")


def field(state: dict, key: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """``state[key]``, checked to be of ``kind``; a missing or mistyped field is a mismatch."""
    if key not in state:
        raise StateMismatchError(f"the state has no {key!r} field; it was saved by another version of this flow")
    value = state[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if kind is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        raise StateMismatchError(f"field {key!r} of the state is a {type(value).__name__} ({value!r:.60})")
    return value


def expect_field(state: dict, key: str, have: Any, what: str) -> None:
    """Raise a mismatch when the state's ``key`` differs from this flow's ``have``; ``what`` names it."""
    saved = field(state, key)
    if _plain(saved) != _plain(have):
        raise StateMismatchError(f"the state is for {what} {saved!r}, this flow has {what} {have!r}")


def _plain(value: Any) -> Any:
    """Tuples as lists, as they come back from json."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load_children(children: Sequence[Any], states: Any) -> None:
    """Load one state per child, in order; a mismatch names the child by its position."""
    if not isinstance(states, list):
        raise StateMismatchError(f"the state's 'children' is a {type(states).__name__}, not a list")
    if len(states) != len(children):
        raise StateMismatchError(f"the state has {len(states)} children, this flow reads {len(children)}")
    for i, (child, s) in enumerate(zip(children, states)):
        load_child(child, s, i if len(children) > 1 else None)


def load_child(child: Any, state: Any, index: int | None = None) -> None:
    load = getattr(child, "load_state_dict", None)
    if load is None:
        raise NotResumableError(f"it reads a {type(child).__name__}, which has no load_state_dict()")
    try:
        load(state)
    except StateError as exc:
        if index is not None and exc.path:
            raise exc.renamed_first(f"{exc.path[0]}[{index}]") from None
        raise


def child_state(child: Any, index: int | None = None) -> dict:
    """``child.state_dict()``; a child without one (a duck-typed flow) cannot be resumed."""
    get = getattr(child, "state_dict", None)
    if get is None:
        raise NotResumableError(f"it reads a {type(child).__name__}, which has no state_dict(); wrap it in a "
                                "DataFlow subclass to make it resumable")
    try:
        return get()
    except StateError as exc:
        if index is not None and exc.path:
            raise exc.renamed_first(f"{exc.path[0]}[{index}]") from None
        raise


def state_or_error(get: Any, arg: Any) -> Any:
    """``get(arg)`` (e.g. ``child_state(flow)``), or the StateError it raised, kept to be raised by
    :func:`unless_error` if a state is asked for: a flow iterated without ever being saved must not
    fail because a part of it cannot be saved."""
    try:
        return get(arg)
    except StateError as exc:
        return exc


def unless_error(value: Any) -> Any:
    """``value`` as :func:`state_or_error` kept it: the state, or its StateError raised now."""
    if isinstance(value, StateError):
        raise type(value)(value.reason, value.path)
    return value


# --- random generators as plain data ------------------------------------------------------------


def rng_state(rng: Any) -> dict | None:
    """The state of a numpy ``RandomState`` or ``Generator`` as plain data (a hex string for the key)."""
    if rng is None:
        return None
    if isinstance(rng, np.random.RandomState):
        kind, key, pos, has_gauss, gauss = rng.get_state()
        return {"kind": str(kind), "key": np.asarray(key, "<u4").tobytes().hex(), "pos": int(pos),
                "has_gauss": int(has_gauss), "gauss": float(gauss)}
    if isinstance(rng, np.random.Generator):
        return {"kind": "Generator", "state": _jsonable(rng.bit_generator.state)}
    raise NotResumableError(f"its rng is a {type(rng).__name__}; only numpy RandomState and Generator states "
                            "can be saved")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def set_rng_state(rng: Any, state: dict) -> None:
    """Put ``rng`` (a ``RandomState`` or ``Generator``) in the state ``rng_state`` returned."""
    try:
        if state["kind"] == "Generator":
            if not isinstance(rng, np.random.Generator):
                raise StateMismatchError(f"the state holds a numpy Generator, this flow's rng is a "
                                         f"{type(rng).__name__}")
            rng.bit_generator.state = state["state"]
            return
        if not isinstance(rng, np.random.RandomState):
            raise StateMismatchError(f"the state holds a RandomState, this flow's rng is a {type(rng).__name__}")
        key, pos, has_gauss, gauss = state["key"], state["pos"], state["has_gauss"], state["gauss"]
        if not (isinstance(key, str) and len(key) == 624 * 8):
            raise StateMismatchError(f"damaged random generator state: 'key' is not 624 words in hex ({key!r:.40})")
        if type(pos) is not int or not 0 <= pos <= 624:
            raise StateMismatchError(f"damaged random generator state: 'pos' is {pos!r:.40}, not 0 to 624")
        if type(has_gauss) is not int or has_gauss not in (0, 1) or type(gauss) not in (int, float):
            raise StateMismatchError(f"damaged random generator state: 'has_gauss' {has_gauss!r:.40} or 'gauss' "
                                     f"{gauss!r:.40}")
        words = np.frombuffer(bytes.fromhex(key), "<u4").astype(np.uint32)
        rng.set_state((state["kind"], words, pos, has_gauss, float(gauss)))
    except StateMismatchError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise StateMismatchError(f"damaged random generator state ({type(exc).__name__}: {exc})") from None


def rng_from_state(state: dict) -> np.random.RandomState:
    """A new ``RandomState`` in a state saved by :func:`rng_state`."""
    rng = np.random.RandomState()
    set_rng_state(rng, state)
    return rng


def check_rng_field(state: dict, key: str = "rng") -> dict | None:
    value = field(state, key, (dict, type(None)))
    if value is not None:
        set_rng_state(np.random.Generator(np.random.PCG64()) if value.get("kind") == "Generator"
                      else np.random.RandomState(), value)  # validates it before the flow takes it
    return value


def check_count(state: dict, key: str, most: int | None = None, why: str = "") -> int:
    """``state[key]``, an int from 0 to ``most`` (no bound when None); ``why`` says where the bound comes from.

    A bound keeps a damaged or crafted count from turning a resume into an endless replay or a silently
    empty epoch: the refusal names the field, its value and the bound.
    """
    value = field(state, key, int)
    if value < 0:
        raise StateMismatchError(f"field {key!r} of the state is negative ({value})")
    if most is not None and value > most:
        raise StateMismatchError(f"field {key!r} of the state is {value}, above {most}, the most this flow can "
                                 f"save{': ' + why if why else ''}")
    return value


_PLAIN = (str, int, float, bool, type(None))


def check_plain(value: Any, where: str = "the state") -> None:
    """Refuse anything but plain data (dicts with string keys, lists, strings, numbers, booleans, None):
    a live object in a state would be pickled to the workers and rebuilt there (its ``__reduce__`` run)."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise StateMismatchError(f"{at} has a key of type {type(k).__name__} ({k!r:.60}): a state is "
                                             "plain data")
                stack.append((item, f"{at}[{k!r}]"))
        elif isinstance(v, (list, tuple)):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(v))
        elif not isinstance(v, _PLAIN):
            raise StateMismatchError(f"{at} holds a {type(v).__module__}.{type(v).__qualname__}: a state is plain "
                                     "data (dicts, lists, strings, numbers, booleans, None)")
