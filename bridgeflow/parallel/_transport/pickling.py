"""Say what in an object cannot be pickled, for the errors of ``spawn`` and ``forkserver`` stages."""

from __future__ import annotations

import functools
import os
import types
from typing import Any

__all__ = ["describe_unpicklable", "dumps_as_launched"]


class _LaunchCheck:
    """Stands in for the process being launched while :func:`dumps_as_launched` pickles."""

    def duplicate_for_child(self, fd: int) -> int:
        return fd

    DupFd = duplicate_for_child  # multiprocessing's name for it


def dumps_as_launched(obj: Any) -> bytes:
    """Pickle ``obj`` as starting a spawn/forkserver process does: multiprocessing's own objects (a Lock,
    Value or Event) pickle only while a process is being launched, so the check pretends to be one."""
    from multiprocessing import context, reduction

    context.set_spawning_popen(_LaunchCheck())  # type: ignore[arg-type]  # duck-types Popen: pickling calls DupFd only
    try:
        return bytes(reduction.ForkingPickler.dumps(obj))
    finally:
        context.set_spawning_popen(None)


def _picklable(obj: Any) -> bool:
    try:
        dumps_as_launched(obj)
    except Exception:
        return False
    return True


def _name(obj: Any) -> str:
    code = getattr(obj, "__code__", None)
    qualname = getattr(obj, "__qualname__", None)
    if code is not None and qualname:
        return f"{qualname!r} ({os.path.basename(code.co_filename)}, line {code.co_firstlineno})"
    if qualname:
        return repr(qualname)
    cls = type(obj)
    module = "" if cls.__module__ in ("builtins", "__main__") else cls.__module__ + "."
    return f"an instance of {module}{cls.__qualname__}"


def describe_unpicklable(obj: Any, _depth: int = 0) -> str:
    """Name what in ``obj`` cannot be pickled: a function by name and place, a ``functools.partial`` or an
    object by the argument or attribute at fault (``"'f' (x.py, line 3) in functools.partial, whose
    argument 0 (an instance of _thread.lock)"``)."""
    if _depth < 3:
        if isinstance(obj, functools.partial):
            parts = [*enumerate(obj.args), *((f"{k}=", v) for k, v in obj.keywords.items())]
            for key, arg in parts:
                if not _picklable(arg):
                    return (f"{_name(obj.func)} in functools.partial, whose argument {key} "
                            f"({describe_unpicklable(arg, _depth + 1)})")
            return describe_unpicklable(obj.func, _depth + 1)
        owner = getattr(obj, "__self__", None)  # a bound method
        if owner is not None and not isinstance(owner, types.ModuleType) and not _picklable(owner):
            return f"{_name(obj)}, bound to {describe_unpicklable(owner, _depth + 1)}"
        if getattr(obj, "__code__", None) is None and isinstance(getattr(obj, "__dict__", None), dict):
            for key, value in vars(obj).items():
                if not _picklable(value):
                    return (f"{_name(obj)}, whose attribute {key!r} "
                            f"({describe_unpicklable(value, _depth + 1)})")
    return _name(obj)
