"""Flows written the tensorpack way keep working: one rename at class creation, and their ``super()`` calls.

tensorpack's flows override the public methods: ``__iter__`` (or the older ``get_data``), ``reset_state``,
``size`` (and flows written for earlier bridgeflow versions ``state_dict``, ``load_state_dict`` and
``stats``). bridgeflow's :class:`~bridgeflow._base.DataFlow` defines its public methods once (reset on first
use, one consumer at a time, states with a header) and calls hooks that subclasses fill. Python calls
``type(df).__iter__``, so a base's method cannot run around an ``__iter__`` its subclass overrides: when such a
subclass is created, :func:`adopt` moves the public methods its class body writes to the hooks, and wraps
nothing (bridgeflow's own flows write the hooks; none is moved):

=====================================  ==========================
written in the class                   becomes
=====================================  ==========================
``__iter__`` (or ``get_data``)         ``_iter_epoch``
``reset_state``                        ``_on_reset``
``state_dict`` / ``load_state_dict``   ``_own_state`` / ``_take_state``
``stats``                              ``_own_stats``
``size`` (without ``__len__``)         also ``__len__``
=====================================  ==========================

A class whose body has ``_iter_epoch`` (moved or written) is iterated by it: its ``_begin_epoch`` is the
base's, and so is its state (count and replay) unless the body has its own. That is what its parents'
states cannot describe once it iterates differently from them.

Inside a moved method, ``super().__iter__()``, ``super().reset_state()``, ``super().state_dict()``...
(or a parent named outright, ``RNGDataFlow.reset_state(self)``, as tensorpack's own code does) mean the
parents' part: their hook, not the whole public method (which would run this class's hook again). The public
methods are :class:`Public` descriptors, and :func:`adopt` leaves one in the class where it moved a method:
Python's attribute lookup then says which was asked for. ``df.reset_state()`` finds the first of them in
the flow's MRO, the whole method; ``super().reset_state()`` in a moved method of class ``C`` finds one
after ``C``, and runs the hook of the classes after ``C``.

Example:
    >>> from bridgeflow import RNGDataFlow
    >>> class Noise(RNGDataFlow):   # as tensorpack users write it
    ...     def __init__(self, seed):
    ...         self.seed = seed
    ...     def reset_state(self):
    ...         super().reset_state()   # seeds self.rng
    ...         self.scale = 10
    ...     def __iter__(self):
    ...         for _ in range(2):
    ...             yield [int(self.rng.randint(self.scale))]
    >>> list(Noise(seed=0)) == list(Noise(seed=0))   # reset on first use, as any flow
    True
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["Public", "adopt", "public"]

MOVES = {"__iter__": "_iter_epoch", "get_data": "_iter_epoch", "reset_state": "_on_reset",
         "state_dict": "_own_state", "load_state_dict": "_take_state", "stats": "_own_stats"}

_F = TypeVar("_F", bound=Callable[..., Any])


class Public:
    """A public method of :class:`~bridgeflow._base.DataFlow` (``whole``), or its stand-in in a class whose
    method of that name :func:`adopt` moved. Reached through the first of them in a flow's MRO, it is
    ``whole``; reached through a later one (``super()`` in a moved method of class ``C``, or a parent named
    outright), it is the parents' part: the ``hook`` of the classes after ``C``."""

    base: type  # DataFlow, where the method is written

    def __init__(self, whole: Callable[..., Any], hook: str, name: str = "", moved: bool = False) -> None:
        self.whole, self.hook, self.name, self.moved = whole, hook, name or whole.__name__, moved
        self.__doc__, self.__wrapped__ = whole.__doc__, whole

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.base = name, owner

    def __get__(self, flow: Any, cls: type | None = None) -> Any:
        if flow is None:  # Parent.reset_state(self): the parents' part from Parent on, when called so
            return self if cls is None else self._named(cls)
        if not type(flow)._tensorpack_style:  # no class of this flow moved a method: nothing to tell apart
            return types.MethodType(self.whole, flow)
        after = _after(type(flow), self)
        if after is None:
            return types.MethodType(self.whole, flow)
        return functools.partial(self.parents, flow, after)

    def parents(self, flow: Any, after: type, *args: Any) -> Any:
        """The part of the classes after ``after`` in ``flow``'s MRO: their hook (for ``__iter__``, their epoch:
        ``_iter_epoch()``, or ``_begin_epoch(None)`` where they begin their epochs themselves)."""
        parent: Any = super(after, flow)  # (typed Any: mypy types a super() proxy by where it is written)
        if self.hook != "_iter_epoch":
            return getattr(parent, self.hook)(*args)
        # a bound method's __func__ (typeshed's Callable has none)
        if getattr(parent._begin_epoch, "__func__", None) is self.base.__dict__["_begin_epoch"]:
            return parent._iter_epoch()
        return parent._begin_epoch(None)

    def _named(self, parent: type) -> Callable[..., Any]:
        @functools.wraps(self.whole)  # the whole method's name, signature and doc (help(), Sphinx)
        def named(flow: Any, *args: Any, **kwargs: Any) -> Any:
            return _named(self, parent, flow, *args, **kwargs)
        return named


def public(hook: str) -> Callable[[_F], _F]:
    """Make a method of DataFlow a :class:`Public` one, whose parents' part is ``hook``."""
    def make(whole: _F) -> _F:
        return cast(_F, Public(whole, hook))
    return make


def _after(kind: type, found: Public) -> type | None:
    """Where in ``kind``'s MRO the parents' part that ``found`` was reached for begins: after the class
    returned; None for the whole method.

    ``found`` follows another :class:`Public` of its name: ``super()`` in that class's moved method. It is the
    first, in a class that moved ``get_data`` under a subclass that moved ``__iter__`` (or the other way
    round): that class's own method, as in tensorpack, where the two names are two methods."""
    before: type | None = None
    other = False  # a class before found moved the same hook under the other name
    siblings = [n for n, hook in MOVES.items() if hook == found.hook and n != found.name]
    mro = kind.__mro__
    for at, klass in enumerate(mro):
        here = klass.__dict__.get(found.name)
        if here is found:
            if before is None and other and found.moved:
                return mro[at - 1]
            return before
        if isinstance(here, Public):
            before = klass
        other = other or any(isinstance(klass.__dict__.get(n), Public) for n in siblings)
    return None


def _named(found: Public, parent: type, flow: Any, *args: Any, **kwargs: Any) -> Any:
    """``Parent.name(flow, ...)``: the whole method when nothing in ``flow``'s class moved it above ``Parent``,
    else the parents' part from ``Parent`` on."""
    kind = type(flow)
    if getattr(kind, "_tensorpack_style", False) and parent in kind.__mro__:
        mro = kind.__mro__
        at = mro.index(parent)
        if at and any(isinstance(k.__dict__.get(found.name), Public) for k in mro[:at]):
            return found.parents(flow, mro[at - 1], *args, **kwargs)
    return found.whole(flow, *args, **kwargs)


def adopt(cls: type, base: type) -> None:
    """Move the public methods ``cls``'s body writes to the hooks of ``base`` (:class:`DataFlow`)."""
    ns = cls.__dict__
    get_data = ns.get("get_data")
    if "__iter__" not in ns and callable(get_data):  # tensorpack's older protocol iterates with get_data
        _move(cls, base, "get_data", "_iter_epoch")
    for name, hook in MOVES.items():
        if name != "get_data" and name in ns and not isinstance(ns[name], Public):
            _move(cls, base, name, hook)
    size = ns.get("size")
    if "__len__" not in ns and callable(size):
        cls.__len__ = size  # type: ignore[attr-defined]  # the class is rewritten as it is made
    if "_iter_epoch" in ns and "_begin_epoch" not in ns:  # (type[Any] has no such attributes for mypy)
        cls._begin_epoch = base._begin_epoch  # type: ignore[attr-defined]  # (same)
        if "_own_state" not in ns:
            cls._own_state = base._own_state  # type: ignore[attr-defined]  # (same)
            cls._take_state = base._take_state  # type: ignore[attr-defined]  # (same)


def _move(cls: type, base: type, name: str, hook: str) -> None:
    if hook in cls.__dict__:
        raise TypeError(f"{cls.__qualname__} defines both {name} and {hook}, the hook {name} is moved to; keep one")
    setattr(cls, hook, cls.__dict__[name])
    found = base.__dict__[name]  # the base's: its stand-in here tells super() calls apart (see Public)
    stand_in = Public(found.whole, hook, name, moved=True)
    stand_in.base = base
    setattr(cls, name, stand_in)
    cls._tensorpack_style = True  # type: ignore[attr-defined]  # it and its subclasses may be told apart
