"""Command-line scripts: ``bridgeflow serialize``, ``bridgeflow inspect``, and ``bridgeflow bench FILE``.

``register(subparsers)`` adds ``serialize`` and ``inspect`` to the ``bridgeflow`` command;
``bench_file(path, args)`` is what ``bridgeflow bench`` runs when its target is a dataset file.
``main(argv)`` runs these commands alone (``python -m bridgeflow._cli_serialize``).

Example (shell):
    bridgeflow serialize photos/ photos.lmdb --workers 4
    bridgeflow serialize mymodule:make_flow train.h5 --format hdf5
    bridgeflow serialize train.lmdb train.npz            # format conversion
    bridgeflow inspect train.lmdb
    bridgeflow bench train.lmdb --size 5000
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ._base import DataFlow
from ._commands import Terminated, load_object, run_command
from ._serialize_errors import CorruptDataError, TargetExistsError
from .serialize._atomic import check_target
from .serialize._formats import EXTENSIONS, FORMATS, detect_format, load_dataset

__all__ = ["Terminated", "bench_file", "main", "open_source", "register"]

log = logging.getLogger(__name__)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM in this process raises :class:`Terminated` (worker processes forked
    meanwhile keep the default: they just end)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:  # someone else's handler: leave it
        yield
        return
    owner = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated(signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

def _parallel_map(df: DataFlow, workers: int) -> DataFlow:
    """Run the outermost ``MapData`` of ``df`` in ``workers`` processes, order kept."""
    from ._transforms import MapData

    if not isinstance(df, MapData):
        raise ValueError(f"--workers needs a source whose last stage is a MapData (its map stage runs in "
                         f"parallel); {type(df).__name__} has none. Build the map stage in parallel yourself.")
    try:
        from .parallel import MultiProcessMapData
    except ImportError as exc:  # the parallel package is optional for this module
        raise ValueError("--workers needs bridgeflow.parallel.MultiProcessMapData, which is not available") \
            from exc
    # strict: one pass over the source, each datapoint mapped once (non-strict stages read ahead into the next)
    return MultiProcessMapData(df.ds, workers, df.func, buffer_size=max(16, 8 * workers), ordered=True, strict=True)


def open_source(spec: str, *, decode: bool = False, workers: int = 0, allow_pickle: bool = False,
                split: str | None = None, non_images: str = "skip", bad_images: str = "error",
                allow_external: bool = False) -> DataFlow:
    """The flow ``bridgeflow serialize`` reads: an image folder, a dataset file, or ``module:function``.
    ``bad_images``: images that do not decode are refused (``"error"``), left out and named (``"skip"``),
    or stored unchecked (``"keep"``). ``allow_external``: an HDF5 source may read data lying in other
    files (see :func:`~bridgeflow.serialize.load_dataset`)."""
    return _open_source(spec, decode=decode, workers=workers, allow_pickle=allow_pickle, split=split,
                        non_images=non_images, bad_images=bad_images, allow_external=allow_external)[0]


def _open_source(spec: str, *, decode: bool, workers: int, allow_pickle: bool, split: str | None, non_images: str,
                 bad_images: str = "error",
                 allow_external: bool = False) -> tuple[DataFlow, list[str] | None, list[str], int | None]:
    """(flow, class names to store or None, files skipped as not images, images found or None)."""
    if split is not None and not (os.path.isdir(spec) and not os.path.exists(os.path.join(spec, "data.mdb"))):
        raise ValueError("--split applies to image folders only")
    classes: list[str] | None = None
    skipped: list[str] = []
    found = None
    if os.path.isdir(spec) and not os.path.exists(os.path.join(spec, "data.mdb")):
        from .serialize._images import ImageFolderData

        images = ImageFolderData(spec, decode=decode, split=split, non_images=non_images,
                                 bad_images={"keep": None, "skip": "error"}.get(bad_images, bad_images))
        if bad_images == "skip":  # those that do not decode come back named, from whatever process read them
            images.func = functools.partial(_read_or_name, images.func)
        df: DataFlow = images
        classes, skipped, found = images.classes, images.skipped, len(images.files)
        log.info("image folder %s: %d images in classes %s", images.root, len(df), images.classes)
    elif os.path.exists(spec):
        if decode:
            raise ValueError("--decode applies to image folders only")
        df = load_dataset(spec, allow_pickle=allow_pickle, allow_external=allow_external)
        classes = getattr(df, "classes", None)  # a conversion keeps the label names
        if workers:
            log.warning("--workers ignored: reading %s has no map stage to parallelize", spec)
            workers = 0
    elif ":" in spec:
        df = load_object(spec)
        if not hasattr(df, "__iter__"):
            raise ValueError(f"{spec} returned a {type(df).__name__}, not a DataFlow")
        if not isinstance(df, DataFlow):
            from ._sources import DataFromIterable

            df = DataFromIterable(df)
    else:
        raise FileNotFoundError(f"source {spec!r} is neither an existing folder/file nor MODULE:FUNCTION")
    return (_parallel_map(df, workers) if workers else df), classes, skipped, found


class _Undecodable(str):
    """The path of an image that does not decode, in its datapoint's place (``--bad-images skip``)."""


def _read_or_name(read: Any, dp: list) -> list:
    """``read(dp)``, or ``[_Undecodable(path), why]`` for an image that does not decode: the command drops
    it and names the file at the end, whichever process read it."""
    try:
        return read(dp)
    except CorruptDataError as exc:
        return [_Undecodable(dp[0]), str(exc.__cause__ or exc)]


def _drop_undecodable(df: DataFlow, names: list[str]) -> DataFlow:
    """``df`` less the images :func:`_read_or_name` named, whose paths go to ``names``."""
    from ._transforms import MapData

    def drop(dp: Any) -> Any:
        if not (isinstance(dp, list) and dp and isinstance(dp[0], _Undecodable)):
            return dp
        if not names:
            log.warning("skipping images that do not decode, each named at the end (first: %s: %s)", dp[0], dp[1])
        names.append(str(dp[0]))
        return None

    return MapData(df, drop)


def _cmd_serialize(args: argparse.Namespace) -> int:
    fmt = args.format or EXTENSIONS.get(os.path.splitext(args.output)[1].lower())
    if fmt is None:
        raise ValueError(f"cannot tell the format from {args.output!r}; pass --format {'|'.join(FORMATS)}")
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    try:  # before reading the source; the function's argument is overwrite=True, the command's --overwrite
        check_target(args.output, args.overwrite)
    except TargetExistsError:
        raise TargetExistsError(f"{args.output} already exists; pass --overwrite to replace it") from None
    with sigterm_unwinds():  # SIGTERM (timeout, Slurm) cleans up like Ctrl-C
        df, classes, skipped, images = _open_source(args.source, decode=args.decode, workers=args.workers,
                                                    allow_pickle=args.allow_pickle, split=args.split,
                                                    non_images=args.non_images, bad_images=args.bad_images,
                                                    allow_external=args.allow_external)
        undecodable: list[str] = []
        if args.bad_images == "skip" and images is not None:
            df = _drop_undecodable(df, undecodable)
        if args.limit:
            from ._transforms import FixedSizeData

            df = FixedSizeData(df, args.limit)
        progress = not args.quiet
        with df:
            if fmt == "lmdb":
                from .serialize._lmdb_format import LMDBSerializer

                n = LMDBSerializer.save(df, args.output, write_frequency=args.write_frequency, codec=args.codec,
                                        overwrite=args.overwrite, progress=progress, checksum=args.checksum,
                                        classes=classes)
            elif fmt == "hdf5":
                from .serialize._hdf5_format import HDF5Serializer

                n = HDF5Serializer.save(df, args.output, overwrite=args.overwrite, progress=progress,
                                        classes=classes)
            else:
                from .serialize._npz_format import NumpySerializer

                n = NumpySerializer.save(df, args.output, overwrite=args.overwrite, progress=progress,
                                         classes=classes)
    extra = f"; skipped {len(skipped)} files that are not images" if skipped else ""
    if undecodable:
        extra += f"; skipped {len(undecodable)} images that do not decode (named above)"
    for path in skipped:
        print(f"skipped (not an image): {path}", file=sys.stderr)
    for path in undecodable:
        print(f"skipped (does not decode): {path}", file=sys.stderr)
    print(f"wrote {n} datapoints to {args.output} ({fmt}, {_size(args.output)}){extra}")
    return 0


def _size(path: str) -> str:
    total: float
    if os.path.isdir(path):
        total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    else:
        total = os.path.getsize(path)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if total < 1024 or unit == "GiB":
            return f"{total:.1f} {unit}" if unit != "B" else f"{total} B"
        total /= 1024
    return ""  # pragma: no cover


def _checksums(fmt: str, ds: Any) -> str:
    """What checks the file's data on read, in words."""
    if fmt == "lmdb" and getattr(ds, "format", None) == "tensorpack":
        return ("none: written by tensorpack, whose values carry no checksum (bridgeflow serialize converts it to a "
                "file with one)")
    if fmt == "lmdb":
        if ds.meta.get("checksum"):
            return f"{ds.meta['checksum']} per value, checked on every read"
        return ("none: saved with checksum=False or by an older bridgeflow; damage inside values reads back "
                "as other values (save it again to add them)")
    if fmt == "npz":
        return "zip CRC-32 per member, checked on load"
    version = getattr(ds, "version", 0)
    if version >= 2:
        return "HDF5 metadata checksums and a CRC-32 per row of every component"
    if version == 1:
        return ("HDF5 metadata checksums, fletcher32 on fixed-size components, a CRC-32 per variable-length "
                "row (format version 1: save it again for a CRC on every row)")
    return "HDF5's own, if the writer enabled them (a file not written by bridgeflow)"


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ._transforms import describe_datapoint

    path = args.path
    # a reader (LMDBDataset, HDF5Data or NumpyData): indexable, though load_dataset promises a DataFlow only
    ds: Any = load_dataset(path, allow_pickle=args.allow_pickle, allow_external=args.allow_external)
    fmt = detect_format(path)
    print(f"path:    {path}")
    layout = getattr(ds, "format", None)
    print(f"format:  {fmt}" + (" (written by tensorpack's LMDBSerializer)" if layout == "tensorpack" else ""))
    print(f"size:    {_size(path)} on disk")
    print(f"count:   {len(ds)}")
    meta = getattr(ds, "meta", None)
    if meta and layout == "tensorpack":
        print(f"codec:   {meta['codec']} (tensorpack's serializer)")
    elif meta:
        print(f"codec:   {meta['codec']} (format version {meta['version']})")
    print(f"checksum: {_checksums(fmt, ds)}")
    classes = getattr(ds, "classes", None)
    if classes is not None:
        shown = ", ".join(f"{i}={name}" for i, name in enumerate(classes[:20]))
        print(f"classes: {len(classes)} ({shown}{', ...' if len(classes) > 20 else ''})")
    columns = getattr(ds, "columns", None)
    if columns:
        print("columns:")
        for c in columns:
            detail = f" dtype={c.dtype}" if c.dtype else ""
            detail += f" shape={list(c.shape)}" if c.kind in ("array", "ragged") else ""
            print(f"  {c.name}: {c.kind}{detail}")
    with ds:
        ds.reset_state()
        for i in range(min(args.num, len(ds))):
            print(f"datapoint {i}:")
            print(describe_datapoint(ds[i], max_list=8, _depth=1))
    return 0


def bench_file(path: str, args: argparse.Namespace) -> int:
    """``bridgeflow bench FILE``: datapoints/s of the loaded flow, sequential then shuffled."""
    from ._batch import BatchData
    from ._speed import TestDataSpeed, bench_counts

    quiet = bool(getattr(args, "quiet", False))
    for shuffle in (False, True):
        ds = load_dataset(path, shuffle=shuffle, seed=0, allow_pickle=bool(getattr(args, "allow_pickle", False)),
                          allow_external=bool(getattr(args, "allow_external", False)))
        if len(ds) == 0:
            print(f"{path}: empty dataset, nothing to measure")
            return 0
        rounds, skipped = bench_counts(args)  # in batches with --batch
        batch = int(getattr(args, "batch", 0))
        seconds = float(getattr(args, "seconds", 2.0))
        size = rounds * (batch or 1)
        passes = size / len(ds)
        warmup = skipped * (batch or 1)
        print(f"{path}: {'shuffled' if shuffle else 'sequential'} read, {len(ds)} datapoints; timing rounds of "
              f"{size} datapoints" + (f" in batches of {batch}" if batch else "")
              + (f" for at least {seconds:g} s" if seconds else "") + f" after {warmup} untimed"
              + (f"; a round reads the file {passes:.1f} times (pass --size to change)" if passes > 1.5 else ""))
        flow: Any = BatchData(ds, batch) if batch else ds
        with flow:
            TestDataSpeed(flow, rounds, skipped, progress=not quiet, min_seconds=seconds).start()
    return 0


def register(subparsers: Any) -> None:
    """Add the ``serialize`` and ``inspect`` commands to a ``bridgeflow`` sub-parser collection."""
    ser = subparsers.add_parser("serialize", help="write a flow, image folder or dataset to LMDB/HDF5/npz",
                                description="Write SOURCE to OUTPUT. SOURCE is MODULE:FUNCTION (returning a "
                                "DataFlow), a folder of images in class subfolders, or an existing "
                                "LMDB/HDF5/npz file (conversion).")
    ser.add_argument("source", help="MODULE:FUNCTION, FILE.py:FUNCTION, an image folder or a dataset file")
    ser.add_argument("output", help="the file to write (.lmdb, .h5, .npz)")
    ser.add_argument("--format", choices=FORMATS, help="output format (default: from OUTPUT's extension)")
    ser.add_argument("--decode", action="store_true", help="image folders: store decoded uint8 arrays "
                     "instead of the encoded file bytes (needs Pillow)")
    ser.add_argument("--split", metavar="NAME", help="image folders: read SOURCE/NAME (e.g. train), for a "
                     "folder of split folders holding class folders")
    ser.add_argument("--non-images", choices=("skip", "error"), default="skip",
                     help="image folders: files without an image extension are skipped, each named (default), "
                     "or refused")
    ser.add_argument("--bad-images", choices=("error", "skip", "keep"), default="error",
                     help="image folders: images that do not decode (a truncated JPEG, a .jpg holding no image) "
                     "are refused, naming the file (default), skipped, each named, or stored unchecked (keep: no "
                     "decoding, faster; files that do not start like an image are skipped as not images); "
                     "checking needs Pillow")
    ser.add_argument("--workers", type=int, default=0, help="run the source's map stage (image reading/"
                     "decoding, or the outermost MapData) in N processes, order kept")
    ser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    ser.add_argument("--codec", default="bridgeflow", choices=("bridgeflow", "pickle"),
                     help="LMDB value codec (pickle stores any object; readers must pass --allow-pickle)")
    ser.add_argument("--allow-pickle", action="store_true", help="read a pickle-codec LMDB source")
    ser.add_argument("--allow-external", action="store_true", help="HDF5 source: read data lying in other files "
                     "(external links, external storage, virtual datasets; refused by default), only for a "
                     "file you trust")
    ser.add_argument("--write-frequency", type=int, default=5000, help="LMDB: datapoints per commit")
    ser.add_argument("--no-checksum", dest="checksum", action="store_false", help="LMDB: store no CRC-32 with "
                     "each value (by default every value carries one, checked on every read; HDF5 and npz "
                     "files always carry checksums)")
    ser.add_argument("--checksum", dest="checksum", action="store_true", help=argparse.SUPPRESS)  # the default
    ser.add_argument("--limit", type=int, default=0, help="write only the first N datapoints")
    ser.add_argument("--quiet", action="store_true", help="no progress bar")
    ser.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                     help="on an error, print the full traceback (default: one line)")
    ser.set_defaults(func=_cmd_serialize)

    ins = subparsers.add_parser("inspect", help="show count, codec, schema and size of a dataset file")
    ins.add_argument("path", help="an LMDB, HDF5 or npz dataset")
    ins.add_argument("--num", type=int, default=2, help="datapoints to describe (default 2)")
    ins.add_argument("--allow-pickle", action="store_true", help="describe a pickle-codec LMDB")
    ins.add_argument("--allow-external", action="store_true", help="HDF5: read data lying in other files "
                     "(refused by default), only for a file you trust")
    ins.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                     help="on an error, print the full traceback (default: one line)")
    ins.set_defaults(func=_cmd_inspect)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``serialize`` / ``inspect`` / ``bench FILE`` without the rest of the ``bridgeflow`` command."""
    parser = argparse.ArgumentParser(prog="bridgeflow-serialize")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    register(sub)
    bench = sub.add_parser("bench", help="read speed of a dataset file")
    bench.add_argument("target")
    bench.add_argument("--size", type=int, default=2000)
    bench.add_argument("--warmup", type=int, default=0)
    bench.add_argument("--quiet", action="store_true")
    bench.add_argument("--seconds", type=float, default=2.0)
    bench.add_argument("--batch", type=int, default=0)
    bench.set_defaults(func=lambda a: bench_file(a.target, a))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_command(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
