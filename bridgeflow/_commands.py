"""What every ``bridgeflow`` command shares: the flow a ``MODULE:FUNCTION`` (or ``FILE.py:FUNCTION``) names,
and running a command with one-line errors and the shell's exit codes.

:mod:`bridgeflow.cli` builds the command line; the commands of :mod:`bridgeflow._cli_serialize` and
:mod:`bridgeflow._cli_remote` use these too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
import traceback
from typing import Any

from ._base import DataFlow
from ._errors import BridgeflowError
from ._iterables import as_dataflow

__all__ = ["Terminated", "describe_error", "load_object", "run_command"]

log = logging.getLogger("bridgeflow.cli")


class Terminated(BaseException):
    """SIGTERM arrived (``timeout``, Slurm, ``kill``): unwinds like Ctrl-C, so that nothing half-written
    stays behind. A ``BaseException``, so that no ``except Exception`` on the way swallows it."""


def load_object(spec: str) -> Any:
    """Resolve ``module:attr`` or ``path/to/file.py:attr``; call ``attr`` if it is not a DataFlow already."""
    if ":" not in spec:
        raise ValueError(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    target, attr = spec.rsplit(":", 1)
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise FileNotFoundError(f"no such file: {target}")
        module = _import_file(target)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if not exc.name or not (target == exc.name or target.startswith(exc.name + ".")):
                raise  # the module is there and imports one that is not: its traceback says where
            raise ModuleNotFoundError(f"No module named {exc.name!r} (looked in the current folder and the "
                                      "installed packages; FILE.py:FUNCTION reads a file elsewhere)",
                                      name=exc.name) from None
        except (TypeError, ValueError) as exc:  # '.', '' or other names that are not modules
            raise ValueError(f"{spec!r}: {target!r} is not a module name ({exc})") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{target} has no attribute {attr!r}") from None
    if callable(obj) and not isinstance(obj, DataFlow):
        try:
            inspect.signature(obj).bind()
        except TypeError as exc:
            raise ValueError(f"{spec} must be callable without arguments to make the flow ({exc})") from None
        except ValueError:  # no signature to inspect (some builtins): just call it
            pass
        obj = obj()
    if isinstance(obj, DataFlow):
        return obj
    if hasattr(obj, "__iter__") and not isinstance(obj, (str, bytes, dict)):
        return as_dataflow(obj, spec)  # a list or generator of datapoints is fine too
    raise ValueError(f"{spec} gave a {type(obj).__name__}, not a DataFlow or an iterable of datapoints")


def _import_file(path: str) -> Any:
    """Import ``dir/name.py`` as module ``name``, with ``dir`` on ``sys.path``.

    Worker processes started by ``spawn`` or ``forkserver`` unpickle the file's functions by importing
    their module by name, so the module must be importable under that name there too (they inherit
    ``sys.path``). When ``name`` would shadow another module (``queue.py``), the file is loaded under a
    private name instead, which only ``fork``-started workers can use.
    """
    path = os.path.abspath(path)
    folder, base = os.path.split(path)
    name = base[:-3]
    if name.isidentifier():
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is None or (found.origin and os.path.abspath(found.origin) == path):
            if folder not in sys.path:
                sys.path.insert(0, folder)
            return importlib.import_module(name)
        log.info("%s would shadow the module %r; loading it under a private name (fork only)", path, name)
    private = "_bridgeflow_user_" + "".join(c if c.isalnum() else "_" for c in name)
    mod_spec = importlib.util.spec_from_file_location(private, path)
    if mod_spec is None or mod_spec.loader is None:  # not a file Python knows how to load
        raise ImportError(f"{path}: not a Python module file")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[private] = module
    mod_spec.loader.exec_module(module)
    return module


def describe_error(exc: BaseException) -> str:
    """One line for an error: its message, with its type and the place in the user's code it came from
    when it did not come from bridgeflow itself (for an error raised in a worker process, the place in the
    worker), and the datapoint it arose at when a save noted it."""
    text = str(exc) or type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    frames += _worker_frames(exc)
    package = os.path.dirname(os.path.abspath(__file__))
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(package + os.sep)]
    at = [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str) and n.startswith("at datapoint ")]
    if isinstance(exc, (BridgeflowError, OSError)) and not isinstance(exc, ImportError) or not outside:
        line = text.splitlines()[0] if text else type(exc).__name__
        return line + (f" ({at[-1]})" if at else "")
    last = frames[-1]
    if os.path.abspath(last.filename).startswith(package + os.sep) and not isinstance(exc, ImportError):
        return f"{type(exc).__name__}: {text}".splitlines()[0] + (f" ({at[-1]})" if at else "")
    where = outside[-1]
    return (f"{type(exc).__name__}: {text}".splitlines()[0] + f" (in {os.path.basename(where.filename)}:"
            f"{where.lineno}, {where.name}" + (f", {at[-1]})" if at else ")"))


def _worker_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of the traceback a worker process sent with ``exc`` (its ``RemoteTraceback`` cause)."""
    cause = exc.__cause__
    if cause is None or type(cause).__name__ != "RemoteTraceback":
        return []
    found = re.findall(r'^ +File "(.+?)", line (\d+), in (.+)$', str(cause), re.MULTILINE)
    return [traceback.FrameSummary(name, int(line), func) for name, line, func in found]


def run_command(args: argparse.Namespace) -> int:
    """Run ``args.func(args)``: errors as one line on stderr (exit 1), Ctrl-C 130, SIGTERM 143;
    ``args.traceback`` lets the error propagate with its full traceback."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"bridgeflow {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"bridgeflow {args.command}: terminated (SIGTERM); nothing half-written was left",
              file=sys.stderr)
        return 143
    except Exception as exc:
        if getattr(args, "traceback", False):
            raise
        hint = " (--traceback shows where)" if _has_a_where(exc) else ""
        print(f"bridgeflow {args.command}: error: {describe_error(exc)}{hint}", file=sys.stderr)
        return 1


def _has_a_where(exc: BaseException) -> bool:
    """Whether a traceback would tell more than the one line: not for an error about a file or the data
    (``OSError``, bridgeflow's own errors), nor for a bad argument the command itself refused."""
    if isinstance(exc, (BridgeflowError, OSError)) and not isinstance(exc, ImportError):
        return False
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    package = os.path.dirname(os.path.abspath(__file__))
    last = os.path.abspath(frames[-1].filename) if frames else ""
    return not (last.startswith(package + os.sep) and os.path.basename(last) in _COMMAND_FILES)


# The modules of the command line itself: an error raised in one of them is a bad argument, not the user's code.
_COMMAND_FILES = ("cli.py", "_cli_serialize.py", "_cli_remote.py", "_commands.py")
