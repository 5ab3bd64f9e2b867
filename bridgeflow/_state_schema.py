"""The fields of a flow's state, declared once per flow; the base checks every state against them.

A flow that saves its own position declares ``state_fields``, a tuple of :class:`Field`\\ s, beside its
``_own_state()`` (which returns exactly those fields). ``load_state_dict`` then, before anything else uses
the state: checks the header (class, version), loads the children's states (each checked the same way:
a bound may follow from what a child loaded), refuses a field the flow does not save and a missing one,
checks each field's type and range (the bound and where it comes from are part of the declaration) and runs
the flow's ``_take_state`` (checks between fields, if any); the outermost load then checks the checksum of
the whole tree. A refusal is a :class:`~bridgeflow._state.StateMismatchError`
naming the flow's path, the field and its value, e.g. ``BatchData/MapData/DataFromList: field 'pos' of the
state is 14, above 12, the most this flow can save: the epoch's length``.

The kinds: :class:`Count` (an integer from 0 to a bound), :class:`Flag`, :class:`Same` (equal to the
flow's own setting), :class:`Rng`/:class:`Rngs` (random generator states), :class:`Held` (datapoints a
flow keeps, see :func:`~bridgeflow._state.pack_held`), :class:`Value` (a type and a check of its own),
:class:`Part` (a dict of fields), and :class:`Child`/:class:`Children` (states of the flows it reads,
loaded into them once every field passed).

Example:
    >>> from bridgeflow import DataFromList, ProxyDataFlow
    >>> class Skip(ProxyDataFlow):
    ...     state_fields = (Count("skipped", most=lambda f: len(f), why="the epoch's length"), Child("child"))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._state import (
    RESERVED,
    StateError,
    StateMismatchError,
    load_child,
    rng_state,
    set_rng_state,
    short,
    unpack_held,
)

__all__ = ["Child", "Children", "Count", "Field", "Flag", "Held", "Part", "Rng", "Rngs", "Same", "Value",
           "apply_fields"]

Getter = Callable[[Any], Any]


def _plain(value: Any) -> Any:
    """Tuples as lists, as they come back from json."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _typed(value: Any, kinds: tuple) -> bool:
    return isinstance(value, kinds) and (not isinstance(value, bool) or bool in kinds)


_show = short


class Field:
    """One field of a state: its name and what a saved state can hold in it (a hook, :meth:`check`).
    ``optional=True``: a state without it (saved by an older bridgeflow) is taken, the field read as None."""

    kinds: tuple = (object,)

    def __init__(self, name: str, *, optional: bool = False) -> None:
        self.name = name
        self.optional = optional

    def check(self, flow: Any, value: Any) -> None:
        if not _typed(value, self.kinds):
            expected = " or ".join(k.__name__ for k in self.kinds if k is not type(None))
            self.fail(f"is a {type(value).__name__} ({_show(value)}), expected {expected}")

    def load(self, flow: Any, value: Any) -> None:
        """Give the flow's children their states (child fields), once every field passed."""

    def settle(self, flow: Any, state: dict) -> None:
        """Complete, in ``state`` (loaded, not begun from yet), what a state saved before ``reset_state()``
        left open, now that the flow is reset (a hook; see :class:`Rng`)."""

    def fail(self, what: str) -> None:
        raise StateMismatchError(f"field {self.name!r} of the state {what}")


class Count(Field):
    """An integer from 0 to ``most`` (an int, an attribute's name, or ``most(flow)``; None: no bound); ``why``
    (text, or ``why(flow)``) says where the bound comes from, ``say`` words the refusal instead (``{value}``,
    ``{most}``). A bound keeps a damaged count from turning a resume into an endless replay or a silently
    empty epoch. ``none=True``: None is a value too."""

    kinds = (int,)

    def __init__(self, name: str, most: int | str | Getter | None = None, why: str | Getter = "", *,
                 none: bool = False, say: str | None = None, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.most, self.why, self.none, self.say = most, why, none, say

    def check(self, flow: Any, value: Any) -> None:
        if value is None and self.none:
            return
        super().check(flow, value)
        if value < 0:
            self.fail(f"is negative ({value})")
        most = self.most
        most = getattr(flow, most) if isinstance(most, str) else most(flow) if callable(most) else most
        if most is not None and value > most:
            if self.say is not None:
                raise StateMismatchError(self.say.format(value=value, most=most))
            why = self.why(flow) if callable(self.why) else self.why
            self.fail(f"is {value}, above {most}, the most this flow can save{': ' + why if why else ''}")


class Flag(Field):
    kinds = (bool,)


class Same(Field):
    """Equal to the flow's own setting ``have`` (an attribute name, or ``have(flow)``): a state saved by a
    flow built otherwise is refused. ``say`` words the refusal: a text where ``{saved}`` and ``{have}`` are
    filled in, or ``say(saved, have)``."""

    def __init__(self, name: str, have: str | Getter, say: str | Callable[[Any, Any], str] | None = None,
                 **kw: Any) -> None:
        super().__init__(name, **kw)
        self.have = have
        self.say = say or f"the state is for {name}={{saved!r}}, this flow has {name}={{have!r}}"

    def check(self, flow: Any, value: Any) -> None:
        have = getattr(flow, self.have) if isinstance(self.have, str) else self.have(flow)
        want = _plain(have)
        if value is not None and want is not None and type(value) is not type(want):
            self.fail(f"is a {type(value).__name__} ({_show(value)})")
        if _plain(value) != want:
            say = self.say
            raise StateMismatchError(say(value, have) if callable(say) else say.format(saved=value, have=have))


def check_rng(value: Any, name: str) -> None:
    """A random generator state :func:`~bridgeflow._state.rng_state` could have saved (tried on a scratch one)."""
    if not isinstance(value, dict):
        raise StateMismatchError(f"field {name!r} of the state is a {type(value).__name__} ({_show(value)})")
    scratch = np.random.Generator(np.random.PCG64()) if value.get("kind") == "Generator" else np.random.RandomState()
    set_rng_state(scratch, value)


class Rng(Field):
    """A random generator's state, or None: a flow without one, or one saved before ``reset_state()`` seeded
    it. ``current(flow)``: the generator's state now (default for the field ``"rng"``: ``flow.rng``'s).

    A None is completed (:meth:`settle`) with the state ``reset_state()`` gave the loading flow: that is what
    its next epoch would begin from, and a state taken again before that epoch (a parallel stage notes its
    source's state as it pulls) must say so, not None, which a later load would read as "keep the generator
    as it is then" (advanced by the epochs in between)."""

    def __init__(self, name: str, current: Getter | None = None, **kw: Any) -> None:
        super().__init__(name, **kw)
        if current is None and name == "rng":
            current = _own_rng
        self.current = current

    def check(self, flow: Any, value: Any) -> None:
        if value is not None:
            check_rng(value, self.name)

    def settle(self, flow: Any, state: dict) -> None:
        if state.get(self.name, 0) is None and self.current is not None:
            state[self.name] = self.current(flow)


def _own_rng(flow: Any) -> Any:
    return rng_state(getattr(flow, "rng", None))


class Rngs(Field):
    """A list of ``count(flow)`` random generator states (or None each)."""

    kinds = (list,)

    def __init__(self, name: str, count: Getter, what: str = "generators", **kw: Any) -> None:
        super().__init__(name, **kw)
        self.count, self.what = count, what

    def check(self, flow: Any, value: Any) -> None:
        super().check(flow, value)
        have = self.count(flow)
        if len(value) != have:
            raise StateMismatchError(f"the state holds {len(value)} {self.what}, this flow has {have}")
        for i, v in enumerate(value):
            if v is not None:
                check_rng(v, f"{self.name}[{i}]")


class Held(Field):
    """Datapoints the flow holds, packed by :func:`~bridgeflow._state.pack_held` (None when it holds none):
    exactly ``count`` of them, or at most ``most(flow)``, when given; each one a datapoint (``gaps``: or None,
    a map stage's place of one received) that ``item(dp)``, when given, finds nothing wrong with."""

    def __init__(self, name: str = "held", count: int | None = None, most: Getter | None = None,
                 item: Callable[[Any], str | None] | None = None, gaps: bool = False, **kw: Any) -> None:
        super().__init__(name, optional=True, **kw)
        self.count, self.most, self.gaps = count, most, gaps
        self.item: Callable[[Any], str | None] | None = item

    def check(self, flow: Any, value: Any) -> None:
        if value is None:
            return
        if not isinstance(value, str):
            self.fail(f"is a {type(value).__name__} ({_show(value)})")
        items = unpack_held(value, self.gaps)
        n = len(items)
        if self.item is not None:
            for dp in items:
                why = self.item(dp)
                if why:
                    self.fail(f"holds {_show(dp)}, {why}")
        if self.count is not None and n != self.count:
            self.fail(f"holds {n} datapoints, where {self.count} are held")
        most = self.most(flow) if self.most is not None else None
        if most is not None and n > most:
            self.fail(f"holds {n} datapoints, more than the {most} this flow can hold")


class Value(Field):
    """A value of ``kinds`` (None included when ``none``), checked further by ``check(flow, value)``, which
    raises StateMismatchError."""

    def __init__(self, name: str, kinds: type | tuple[type, ...], check: Callable[[Any, Any], None] | None = None,
                 *, none: bool = False, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.kinds = (kinds if isinstance(kinds, tuple) else (kinds,)) + ((type(None),) if none else ())
        self.extra = check

    def check(self, flow: Any, value: Any) -> None:
        super().check(flow, value)
        if self.extra is not None and value is not None:
            self.extra(flow, value)


class Part(Field):
    """A dict of fields of its own (None too, when ``none``)."""

    def __init__(self, name: str, fields: Sequence[Field], *, none: bool = False, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.fields, self.none = tuple(fields), none

    def check(self, flow: Any, value: Any) -> None:
        if value is None and self.none:
            return
        if not isinstance(value, dict):
            self.fail(f"is a {type(value).__name__} ({_show(value)})")
        try:
            check_fields(flow, value, self.fields, ())
        except StateMismatchError as exc:
            raise StateMismatchError(exc.reason.replace("field '", f"field '{self.name}.", 1)) from None


class Child(Field):
    """The state of the flow ``of(flow)`` reads (default: ``flow.ds``), loaded into it."""

    kinds = (dict,)

    def __init__(self, name: str = "child", of: Getter | None = None, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.of = of or (lambda f: f.ds)

    def load(self, flow: Any, value: Any) -> None:
        load_child(self.of(flow), value)


class Children(Field):
    """The states of the flows ``of(flow)`` reads (default: ``flow.children()``), one each, in order."""

    kinds = (list,)

    def __init__(self, name: str = "children", of: Getter | None = None, **kw: Any) -> None:
        super().__init__(name, **kw)
        self.of = of or (lambda f: f.children())

    def check(self, flow: Any, value: Any) -> None:
        super().check(flow, value)
        have = len(self.of(flow))
        if len(value) != have:
            raise StateMismatchError(f"the state has {len(value)} children, this flow reads {have}")

    def load(self, flow: Any, value: Any) -> None:
        children = self.of(flow)
        for i, (child, s) in enumerate(zip(children, value)):
            load_child(child, s, i if len(children) > 1 else None)


def check_fields(flow: Any, state: dict, fields: Sequence[Field], reserved: Sequence[str] = RESERVED) -> None:
    """Every field of ``fields`` there (or optional) and as declared, and no other (but ``reserved``)."""
    for f in fields:
        if f.name in state:
            f.check(flow, state[f.name])
        elif not f.optional:
            raise StateMismatchError(f"the state has no {f.name!r} field; it was saved by another version of "
                                     "this flow")
    if len(state) > sum(f.name in state for f in fields):  # a key that is not a field (or reserved)
        names = {f.name for f in fields}
        for key in state:
            if key not in names and key not in reserved:
                raise StateMismatchError(f"the state has a field {key!r} ({_show(state[key])}) that this flow does "
                                         "not save: it comes from another version of the flow, or was added")


def apply_fields(flow: Any, state: dict, fields: Sequence[Field]) -> None:
    """What ``load_state_dict`` does with a declared state: load the children's states (each checked the same
    way), then check the fields and run the flow's own checks between fields (``_take_state``); the outermost
    load then checks the tree's checksum. The children come first because a bound or a setting may follow
    from what they loaded (a stage over a ``CacheData`` whose loaded cache is filled has a length, so its
    epochs are carried); a refusal after they loaded takes their states back."""
    loaders = [f for f in fields if type(f).load is not Field.load and f.name in state]
    for f in loaders:
        f.check(flow, state[f.name])
    try:
        for f in loaders:
            f.load(flow, state[f.name])
        check_fields(flow, state, fields)
        flow._take_state(state)
    except StateError:
        flow._forget_loaded()
        raise
