"""The ``bridgeflow`` command line: ``demo``, ``bench``, and the commands other modules register.

Each command prints to stdout; progress bars go to stderr. An error prints one line naming the problem
(and where in the user's code it arose), exit code 1; ``--traceback`` prints the whole traceback instead.
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
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import __version__
from .base import DataFlow, as_dataflow
from .errors import BridgeflowError

__all__ = ["describe_error", "load_object", "main", "parse_shapes", "run_command"]

DESCRIPTION = ("bridgeflow: build, serialize and measure data pipelines that feed TensorFlow and PyTorch. "
               "Run 'bridgeflow COMMAND --help' for a command's options.")

log = logging.getLogger(__name__)


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
    module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
    sys.modules[private] = module
    mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def parse_shapes(text: str) -> list[list[int]]:
    """``"3x224x224,1"`` -> ``[[3, 224, 224], [1]]``; a component ``scalar`` gives shape ``[]``."""
    shapes = []
    for part in text.split(","):
        part = part.strip()
        if part in ("", "scalar"):
            shapes.append([])
            continue
        try:
            dims = [int(d) for d in part.lower().split("x")]
        except ValueError:
            dims = [-1]
        if any(d < 0 for d in dims):
            raise ValueError(f"bad shape {part!r} in {text!r}; write shapes like 3x224x224,1")
        shapes.append(dims)
    return shapes


def _arg_type(convert: Any, what: str) -> Any:
    """An argparse ``type=`` that turns ``convert``'s ValueError/TypeError into a usage error."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} ({exc})") from None

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _int_at_least(low: int) -> Any:
    def convert(text: str) -> int:
        value = int(text)
        if value < low:
            raise ValueError(f"must be >= {low}")
        return value

    return _arg_type(convert, f"an integer >= {low}")


def _cmd_bench(args: argparse.Namespace) -> int:
    from .batch import BatchData
    from .sources import FakeData
    from .speed import TestDataSpeed

    if (args.target is None) == (args.fake is None):
        raise SystemExit("bridgeflow bench: give either TARGET (module:function or a dataset file) or --fake")
    if args.target is not None and ":" not in args.target:
        if not os.path.exists(args.target):
            raise FileNotFoundError(f"no such dataset file: {args.target} (and it is not MODULE:FUNCTION)")
        from .serialize.cli import bench_file

        return bench_file(args.target, args)
    if args.fake is not None:
        df: DataFlow = FakeData(args.fake, size=None, random=not args.constant,
                                dtype=args.dtype, seed=0)
    else:
        df = load_object(args.target)
    if args.batch:
        df = BatchData(df, args.batch)
    with df:
        TestDataSpeed(df, size=args.size, warmup=args.warmup, progress=not args.quiet).start()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(size=args.size, workdir=args.workdir)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bridgeflow", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"bridgeflow {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, print the full traceback (default: one line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser("bench", help="measure how fast a flow or dataset file produces datapoints")
    bench.add_argument("target", nargs="?", help="module:function returning a DataFlow, or a dataset file")
    bench.add_argument("--fake", metavar="SHAPES", type=_arg_type(parse_shapes, "a list of shapes"),
                       help="measure FakeData of these shapes, e.g. 3x224x224,1")
    bench.add_argument("--dtype", default="uint8", type=_arg_type(np.dtype, "a numpy dtype"),
                       help="dtype of --fake components (default uint8)")
    bench.add_argument("--constant", action="store_true", help="--fake repeats one datapoint (no RNG cost)")
    bench.add_argument("--batch", type=_int_at_least(0), default=0,
                       help="wrap the flow in BatchData of this size")
    bench.add_argument("--size", type=_int_at_least(1), default=2000, help="datapoints to time (default 2000)")
    bench.add_argument("--warmup", type=_int_at_least(0), default=50, help="datapoints to skip before timing")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, print the full traceback (default: one line)")
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser("demo", help="build, serialize and measure a pipeline on built-in fake data")
    demo.add_argument("--size", type=_int_at_least(1), default=2048, help="datapoints in the demo dataset")
    demo.add_argument("--workdir", help="where to write the demo dataset (default: a temporary folder)")
    demo.set_defaults(func=_cmd_demo)

    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


# Modules that add their own sub-commands with ``register(subparsers)``.
_COMMAND_MODULES: tuple[str, ...] = ("bridgeflow.serialize.cli", "bridgeflow.remote.cli")


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
    from .serialize.cli import Terminated

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
        print(f"bridgeflow {args.command}: error: {describe_error(exc)} (--traceback shows where)",
              file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    np.set_printoptions(precision=4, suppress=True)
    return run_command(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
