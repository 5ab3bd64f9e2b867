"""The ``bridgeflow`` command line: ``demo``, ``bench``, and the commands other modules register.

Each command prints to stdout; progress bars go to stderr. An error prints one line naming the problem
(and where in the user's code it arose), exit code 1; ``--traceback`` prints the whole traceback instead.
"""


from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import __version__
from ._base import DataFlow
from ._commands import describe_error, load_object, run_command

__all__ = ["describe_error", "load_object", "main", "parse_shapes", "run_command"]

DESCRIPTION = ("bridgeflow: build, serialize and measure data pipelines that feed TensorFlow and PyTorch. "
               "Run 'bridgeflow COMMAND --help' for a command's options.")



def parse_shapes(text: str) -> list[list[int]]:
    """``"3x224x224,1"`` -> ``[[3, 224, 224], [1]]``; a component ``scalar`` gives shape ``[]``."""
    shapes: list[list[int]] = []
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


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError("must be >= 0")
    return value


def _cmd_bench(args: argparse.Namespace) -> int:
    from ._batch import BatchData
    from ._sources import FakeData
    from ._speed import TestDataSpeed, bench_counts

    if (args.target is None) == (args.fake is None):
        raise SystemExit("bridgeflow bench: give either TARGET (module:function or a dataset file) or --fake")
    if args.target is not None and ":" not in args.target:
        if not os.path.exists(args.target):
            raise FileNotFoundError(f"no such dataset file: {args.target} (and it is not MODULE:FUNCTION)")
        from ._cli_serialize import bench_file

        return bench_file(args.target, args)
    if args.fake is not None:
        df: DataFlow = FakeData(args.fake, size=None, random=not args.constant,
                                dtype=args.dtype, seed=0)
    else:
        assert args.target is not None  # exactly one of TARGET and --fake: checked above
        df = load_object(args.target)
    if args.batch:
        df = BatchData(df, args.batch)
    with df:
        size, warmup = bench_counts(args)
        TestDataSpeed(df, size, warmup, progress=not args.quiet, min_seconds=args.seconds).start()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

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
                       help="wrap the flow (or the file's) in BatchData of this size; --size and --warmup still "
                       "count datapoints, and the rate is given in batches and datapoints per second")
    bench.add_argument("--size", type=_int_at_least(1), default=2000, help="datapoints to time (default 2000)")
    bench.add_argument("--warmup", type=_int_at_least(0), default=50, help="datapoints to skip before timing")
    bench.add_argument("--seconds", type=_arg_type(_seconds, "a number of seconds >= 0"), default=2.0,
                       help="time --size datapoints again until this long has passed (default 2): a rate "
                       "measured over milliseconds varies several-fold between runs")
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


class _AboveProgressBars(logging.StreamHandler):
    """Log lines on stderr, written above the progress bar this process shows, not glued to its end."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self._pid = os.getpid()  # a worker forked from here has a copy of the bars, not the bars on screen

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")  # loaded when a bar was made
        if tqdm is None or os.getpid() != self._pid or not tqdm.tqdm._instances:
            super().emit(record)
            return
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


# Modules that add their own sub-commands with ``register(subparsers)``.
_COMMAND_MODULES: tuple[str, ...] = ("bridgeflow._cli_serialize", "bridgeflow._cli_remote")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = _build_parser()  # imports the commands' modules
    except KeyboardInterrupt:
        print("bridgeflow: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    handler = _AboveProgressBars()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, handlers=[handler])
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    np.set_printoptions(precision=4, suppress=True)
    return run_command(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
