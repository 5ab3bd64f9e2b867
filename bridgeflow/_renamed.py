"""tensorpack's older keyword names (``nr_proc=``, ``nr_thread=``, ...) accepted with a ``DeprecationWarning``.

Code written for tensorpack before it renamed ``nr_*`` to ``num_*`` still passes the old keywords. A
constructor decorated with :func:`renamed_keywords` takes them, warns once per call with the name to use
instead, and runs as if the new keyword had been passed. Passing both spellings is a ``TypeError``.

Example:
    >>> class Stage:
    ...     @renamed_keywords(nr_proc="num_proc")
    ...     def __init__(self, num_proc=1):
    ...         self.num_proc = num_proc
    >>> import warnings
    >>> with warnings.catch_warnings(record=True):
    ...     Stage(nr_proc=4).num_proc
    4
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["renamed_keywords"]


def renamed_keywords(**renames: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an ``__init__`` so that each ``old=`` keyword in ``renames`` is taken as ``renames[old]=``."""

    def decorate(init: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                who = type(self).__name__
                if new in kwargs:
                    raise TypeError(f"{who}: got both {old}= and {new}=; pass only {new}= ({old}= is its "
                                    "older tensorpack name)")
                warnings.warn(f"{who}({old}=...) is tensorpack's older name of the argument: use {new}=",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return init(self, *args, **kwargs)

        renamed = {**getattr(init, "_bf_renamed", {}), **renames}
        wrapper._bf_renamed = renamed  # type: ignore[attr-defined]  # an attribute set on a function object
        return wrapper

    return decorate
