"""Flows written the tensorpack way keep working: one rename at class creation, and their ``super()`` calls.

tensorpack's flows override the public methods: ``__iter__`` (or the older ``get_data``), ``reset_state``,
``size`` (and flows written for earlier bridgeflow versions ``state_dict``, ``load_state_dict`` and
``stats``). bridgeflow's :class:`~bridgeflow._base.DataFlow` defines its public methods once (reset on first
use, one consumer at a time, states with a header) and calls hooks that subclasses fill. So when a
subclass is created, :func:`adopt` moves the public methods its class body writes to the hooks, and
wraps nothing:

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
(or a parent named outright, ``RNGDataFlow.reset_state(self)``, as tensorpack's own code does) reach the
public method on the base. It asks :func:`moved_caller` whether it was called from a moved method on the
same flow, and then runs the hook of the parents instead of the whole public method.

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

import sys
import types
from typing import Any

__all__ = ["adopt", "moved_caller"]

MOVES = {"__iter__": "_iter_epoch", "reset_state": "_on_reset", "state_dict": "_own_state",
         "load_state_dict": "_take_state", "stats": "_own_stats"}

# the code of every moved method (and of what it wraps) -> (the class it was written in, the hook it became)
_moved_code: dict[types.CodeType, tuple[type, str]] = {}


def adopt(cls: type, base: type) -> None:
    """Move the public methods ``cls``'s body writes to the hooks of ``base`` (:class:`DataFlow`)."""
    ns = cls.__dict__
    get_data = ns.get("get_data")
    if "__iter__" not in ns and callable(get_data):  # tensorpack's older protocol iterates with get_data
        _move(cls, "get_data", "_iter_epoch")
    for public, hook in MOVES.items():
        if public in ns:
            _move(cls, public, hook)
    size = ns.get("size")
    if "__len__" not in ns and callable(size):
        cls.__len__ = size  # type: ignore[attr-defined]  # the class is rewritten as it is made
    if "_iter_epoch" in ns and "_begin_epoch" not in ns:  # (type[Any] has no such attributes for mypy)
        cls._begin_epoch = base._begin_epoch  # type: ignore[attr-defined]  # (same)
        if "_own_state" not in ns:
            cls._own_state = base._own_state  # type: ignore[attr-defined]  # (same)
            cls._take_state = base._take_state  # type: ignore[attr-defined]  # (same)


def _move(cls: type, public: str, hook: str) -> None:
    if hook in cls.__dict__:
        raise TypeError(f"{cls.__qualname__} defines both {public} and {hook}, the hook {public} is moved to; "
                        f"keep one")
    fn = cls.__dict__[public]
    delattr(cls, public)
    setattr(cls, hook, fn)
    cls._tensorpack_style = True  # type: ignore[attr-defined]  # it and its subclasses may be routed
    while fn is not None:  # a decorated method (functools.wraps) calls super() from the function it wraps
        code = getattr(fn, "__code__", None)
        if isinstance(code, types.CodeType):
            _moved_code[code] = (cls, hook)
        fn = getattr(fn, "__wrapped__", None)


def moved_caller(flow: Any, hook: str) -> type[Any] | None:
    """The class of the moved method that called the public method of ``hook`` now running on ``flow``,
    through ``super()`` or a parent named outright; None for any other caller (a moved ``__iter__`` that calls
    ``self.reset_state()`` means this flow's own). Looks at the frame two levels up: the caller."""
    if not type(flow)._tensorpack_style:  # no class of this flow had a method moved: nothing to route
        return None
    frame = sys._getframe(2)
    moved = _moved_code.get(frame.f_code)
    if moved is None or moved[1] != hook:
        return None
    code = frame.f_code
    if not code.co_argcount or frame.f_locals.get(code.co_varnames[0]) is not flow:
        return None  # a moved method of another flow of the same class (its child, say)
    return moved[0]
