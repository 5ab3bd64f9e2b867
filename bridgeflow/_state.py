"""What every flow's state shares: its errors, header and checksum, random generators and datapoints as
plain data. The contract (what a state promises, over ordered and unordered stages) is in
:mod:`bridgeflow._base`; the fields of each flow's state are declared with :mod:`bridgeflow._state_schema`.

A flow's ``state_dict()`` is a dict of plain data (ints, floats, strings, lists, dicts, ``None``) with, at
every level, the flow's class name, a format version and a checksum, so ``json`` and ``torch.save`` store it
as it is. ``load_state_dict(state)`` checks it before taking it; a state of another structure, length, file
or a newer format, or one changed after it was saved, raises :class:`StateMismatchError` (a ``ValueError``)
whose message starts with the path of the flow at fault, e.g. ``BatchData/MapData/DataFromList: ...``.

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

import base64
import binascii
import json
import reprlib
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._codec import decode, encode
from ._errors import BridgeflowError

__all__ = [
    "RESERVED",
    "NotResumableError",
    "StateError",
    "StateMismatchError",
    "check_header",
    "check_plain",
    "checksum",
    "child_state",
    "held_then",
    "read_first",
    "pack_held",
    "rng_from_state",
    "rng_state",
    "set_rng_state",
    "state_or_error",
    "unless_error",
    "short",
    "unpack_held",
    "verify_checksum",
]

RESERVED = ("class", "version", "check")  # the header every level of a state has


MESSAGE_MOST = 2000  # characters of a StateError's reason: a crafted state cannot make its message huge
MAX_DEPTH = 400  # levels of dicts and lists in a state: far more than any pipeline saves, below recursion limits

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 60
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple = 3, 6, 4, 6


def short(value: Any) -> str:
    """``repr(value)`` cut to about 60 characters, without building the whole of it first (a state is
    untrusted: a field may hold 100 MB)."""
    return _SHORT.repr(value)


class StateError(BridgeflowError):
    """A state that cannot be taken or used; ``path`` names the flow at fault from the outermost one. The
    reason is cut to ``MESSAGE_MOST`` characters."""

    def __init__(self, reason: str, path: Sequence[str] = ()) -> None:
        if len(reason) > MESSAGE_MOST:
            reason = f"{reason[:MESSAGE_MOST]}... ({len(reason) - MESSAGE_MOST} more characters)"
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
    """A damaged state, or one saved from another flow: another class at some depth, another length, file or
    version, a field out of range, a checksum that does not match. The base of every such error, the torch
    ``DataLoader``'s ``ResumeStateError`` included."""


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
        said = saved if isinstance(saved, str) and len(saved) <= 100 else short(saved)
        raise StateMismatchError(f"the state was saved by a {said}, this flow is a {name}: the state "
                                 "comes from a pipeline of another structure")
    v = state.get("version")
    if not isinstance(v, int) or isinstance(v, bool):
        raise StateMismatchError(f"the state has no format version (got {v!r})")
    if v > version:
        raise StateMismatchError(f"the state has format version {v}, newer than this bridgeflow's {version}; "
                                 "load it with the bridgeflow that saved it")


# --- the checksum ----------------------------------------------------------------------------------


def _c_encoder() -> Any:
    """json's C encoder, built once (``JSONEncoder.encode`` builds one per call, which costs as much as the
    encoding of a small state), writing what ``_ENCODER`` writes; None where there is none."""
    try:
        from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]  # typeshed omits it

        # markers None: a state is a tree (a cycle, in a state made by hand, ends in RecursionError below)
        return c_make_encoder(None, None, encode_basestring_ascii, None, ":", ",", False, False, True)
    except (ImportError, TypeError):  # a Python without json's C speedups, or another signature
        return None


_ENCODE = _c_encoder()
_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)


def checksum(state: dict) -> str | None:
    """The ``check`` field of the outermost state of a tree: a CRC-32 of the whole tree (``check`` aside) as
    JSON writes it, which reads the same after a ``json`` or ``torch.save`` round trip (tuples as lists, keys as
    text, in their order). Field checks see a value no saved state can hold; this sees a value another saved
    state could hold (another position, a generator state changed into another valid one). None for a state
    JSON cannot write (a custom flow's numpy number): it is then taken on its fields. It is most of what
    ``state_dict()`` costs (about 0.25 us per field on a quiet 2-core box): a cheaper text (``repr``,
    ``marshal``) tells a tuple from the list that ``json`` gives back, so a state would not load after json."""
    tree = {k: v for k, v in state.items() if k != "check"} if "check" in state else state
    try:
        text = "".join(_ENCODE(tree, 0)) if _ENCODE is not None else _ENCODER.encode(tree)
    except (TypeError, ValueError, RecursionError):
        return None
    return f"{zlib.crc32(text.encode('ascii')):08x}"


def verify_checksum(state: dict) -> None:
    """Refuse a state whose ``check`` does not match its fields (a state without one, made by hand, is taken
    on its fields)."""
    if "check" not in state:
        return
    saved = state["check"]
    if not isinstance(saved, str) or saved != checksum(state):  # a state the sum was not made of is refused
        raise StateMismatchError(f"the state's checksum {saved!r:.20} does not match its fields: it was changed "
                                 "after state_dict() saved it (its fields may each look valid)")


# --- children's states ----------------------------------------------------------------------------


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


def load_child(child: Any, state: Any, index: int | None = None) -> None:
    """``child.load_state_dict(state)``; an error names the child by its position among several."""
    load = getattr(child, "load_state_dict", None)
    if load is None:
        raise NotResumableError(f"it reads a {type(child).__name__}, which has no load_state_dict()")
    try:
        load(state)
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


# --- plain data ----------------------------------------------------------------------------------

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


def pack_held(items: list, stage: str) -> str:
    """Datapoints a flow holds (the rest of a batch, a datapoint's remaining repeats, a cache, a buffer, a
    stage's work in flight) as text for its state: the bridgeflow codec (arrays, numbers, strings, bytes,
    lists, tuples, dicts; never pickle), in base64. A state over an unordered stage (``stage``) keeps them,
    since the stage would not give them again; a datapoint the codec cannot store makes the state refused
    (:class:`NotResumableError` naming the stage; the base puts the flow's path in front)."""
    try:
        raw = encode(items)
    except (TypeError, ValueError) as exc:  # EncodeError, or an array dtype the codec does not store
        raise NotResumableError(
            f"it holds datapoints of the unordered {stage} under it, which its state must keep (that stage would "
            f"give others on a resume), and they cannot be stored as plain data: {exc}") from None
    return base64.b64encode(raw).decode("ascii")


def unpack_held(text: str, gaps: bool = False) -> list:
    """The datapoints :func:`pack_held` stored (arrays writable), or a StateMismatchError for damaged text or
    an item that is not a datapoint (``gaps``: None too, a map stage's place of a datapoint received)."""
    try:
        out = decode(bytearray(base64.b64decode(text.encode("ascii"), validate=True)))
    except (binascii.Error, UnicodeError, ValueError, TypeError) as exc:  # CorruptDataError is a ValueError
        raise StateMismatchError(f"damaged held datapoints in the state ({type(exc).__name__}: {exc})") from None
    if not isinstance(out, list):
        raise StateMismatchError(f"the state's held datapoints are a {type(out).__name__}, not a list")
    for i, dp in enumerate(out):
        if not isinstance(dp, (list, tuple, dict)) and not (gaps and dp is None):
            raise StateMismatchError(f"the state's held datapoint {i} is a {type(dp).__name__} ({short(dp)}), "
                                     "not a datapoint (a list, tuple or dict)")
    return out


def read_first(it: Any) -> Any:
    """``it`` with its first item read now and given first: a resumed flow that replays a part-used item (the
    rest of a batch, of a datapoint's repeats) reads it at ``iter()``, so that its child stands after that
    item as in the saved run even where the epoch is left before a datapoint is asked for (FixedSizeData
    without keep_state resumed at its size, a join whose shortest child ends)."""
    end = object()
    first = next(it, end)
    return it if first is end else held_then([first], it)


def held_then(items: list, it: Any) -> Any:
    """The datapoints a state held (``items``), then ``it``'s; closes ``it`` when done or dropped."""
    try:
        yield from items
        yield from it
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
