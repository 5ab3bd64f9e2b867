"""Small pieces shared by the dataset formats: progress bars, path checks, index normalisation."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from .._base import DataFlow
from .._progress import progress_bar
from .._serialize_errors import CorruptDataError, DatasetNotFoundError
from ._pinned import PinnedFile

__all__ = ["LOADERS", "classes_json", "existing_path", "hdf5_superblock_at", "iterate_source", "normalize_index",
           "note_datapoint", "parse_classes", "sniff", "source_length", "wrong_format"]

_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_ZIP_STARTS = (b"PK\x03\x04", b"PK\x05\x06")  # a zip's first member, or an empty zip's end record
_EOCD = b"PK\x05\x06"  # a zip's end-of-central-directory record: 22 bytes and a comment end the file
_NAMES = {"lmdb": "an LMDB", "hdf5": "an HDF5", "npz": "an npz (zip)"}
LOADERS = {"lmdb": "LMDBSerializer.load(path)", "hdf5": "HDF5Serializer.load(path)",
           "npz": "NumpySerializer.load(path)"}


def hdf5_superblock_at(pin: PinnedFile) -> int | None:
    """Where an HDF5 file's superblock lies: at byte 0, or after a user block at 512, 1024, 2048, ... (where
    libhdf5 looks); ``None`` when at none of them."""
    size, at = pin.size(), 0
    while at + len(HDF5_SIGNATURE) <= size:
        if pin.pread(len(HDF5_SIGNATURE), at) == HDF5_SIGNATURE:
            return at
        at = 512 if at == 0 else at * 2
    return None


def _zip_ends_file(pin: PinnedFile) -> bool:
    """A zip's end record lies where zip readers take it from: its 22 bytes and its comment end the file."""
    size = pin.size()
    n = min(size, 22 + 0xFFFF)
    tail = pin.pread(n, size - n)
    at = tail.rfind(_EOCD)
    while at >= 0:
        if at + 22 <= len(tail) and at + 22 + int.from_bytes(tail[at + 20:at + 22], "little") == len(tail):
            return True
        at = tail.rfind(_EOCD, 0, at)
    return False


def sniff(pin: PinnedFile) -> str | None:
    """``"lmdb"``, ``"hdf5"`` or ``"npz"``, from each format's signature at its real place, or ``None``.

    HDF5's is at byte 0 or after a user block (512, 1024, ... bytes that other tools fill, e.g. with a zip);
    a zip's end record ends the file (whatever comes before its first member). So a file starting with
    ``PK\\3\\4`` is an npz if its end record ends it; otherwise, with an HDF5 superblock after a user block,
    it is HDF5 (the user block holds the zip); with neither, a damaged npz."""
    head = pin.pread(32, 0)
    if head.startswith(HDF5_SIGNATURE):
        return "hdf5"
    if head[16:20] == _LMDB_MAGIC:
        return "lmdb"
    if _zip_ends_file(pin):
        return "npz"
    if hdf5_superblock_at(pin) is not None:
        return "hdf5"
    return "npz" if head.startswith(_ZIP_STARTS) else None


def wrong_format(path: str, pin: PinnedFile, wanted: str) -> CorruptDataError | None:
    """The error for a loader of ``wanted`` given a file of another format (:func:`sniff`), naming the
    loader that reads it; ``None`` when the file is not of another known format (then it is damaged)."""
    found = sniff(pin)
    if found is None or found == wanted:
        return None
    return CorruptDataError(f"{path} is {_NAMES[found]} file, not {_NAMES[wanted]} one: load it with "
                            f"{LOADERS[found]}, or with load_dataset(path), which recognises the format")


def classes_json(classes: Sequence[str]) -> str:
    """The names of a dataset's labels as the JSON list the formats store."""
    if isinstance(classes, str):
        raise TypeError("classes must be a sequence of names, not one string")
    return json.dumps([str(c) for c in classes])


def parse_classes(raw: str | bytes | None, path: str) -> list[str] | None:
    """The label names stored by :func:`classes_json`, or :class:`CorruptDataError` naming ``path``."""
    if raw is None:
        return None
    try:
        classes = json.loads(raw)
    except ValueError:
        classes = None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise CorruptDataError(f"{path}: damaged class names in its metadata")
    return classes


def existing_path(path: str | os.PathLike, what: str) -> str:
    """``path`` as a string, or :class:`DatasetNotFoundError` naming it."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise DatasetNotFoundError(f"{what}: no such file: {p}")
    return p


def source_length(df: Any) -> int | None:
    try:
        return len(df)
    except TypeError:  # LengthUnknownError is a TypeError
        return None


def iterate_source(df: DataFlow, *, progress: bool, desc: str) -> Iterator[Any]:
    """``reset_state()`` then iterate ``df`` behind a tqdm bar on stderr (with ETA when len() is known); an
    error of the source is noted with the datapoint it arose at (:func:`note_datapoint`)."""
    if not hasattr(df, "__iter__"):
        raise TypeError(f"{desc}: expected a DataFlow or iterable, got {type(df).__name__}")
    if hasattr(df, "reset_state"):
        df.reset_state()
    n = 0
    with progress_bar(enabled=progress, total=source_length(df), desc=desc, unit="dp") as bar:
        try:
            for dp in df:
                yield dp
                n += 1
                bar.update(1)
        except Exception as exc:  # the source failed (the writer's own errors are raised in its frame)
            note_datapoint(exc, n)
            raise


def note_datapoint(exc: BaseException, index: int) -> None:
    """Note on ``exc`` the datapoint of the source it arose at (``bridgeflow serialize`` prints it)."""
    note = f"at datapoint {index} of the source"
    notes = getattr(exc, "__notes__", ())
    if note in notes:
        return
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: no add_note; the attribute it fills (PEP 678), which describe_error reads
        try:
            exc.__notes__ = [*notes, note]  # type: ignore[attr-defined]  # PEP 678's, not in 3.10's stubs
        except AttributeError:
            pass


def normalize_index(index: Any, n: int, who: str) -> int:
    try:
        i = int(index)
    except (TypeError, ValueError):
        raise TypeError(f"{who} indices must be integers, got {type(index).__name__}") from None
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"{who} index {index} out of range for {n} datapoints")
    return i
