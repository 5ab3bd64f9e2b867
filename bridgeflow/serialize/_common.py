"""Small pieces shared by the dataset formats: progress bars, path checks, index normalisation."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from .._base import DataFlow
from .._progress import progress_bar
from ._errors import CorruptDataError, DatasetNotFoundError

__all__ = ["LOADERS", "classes_json", "existing_path", "iterate_source", "normalize_index", "note_datapoint",
           "parse_classes", "sniff_format", "source_length", "wrong_format"]

_LMDB_MAGIC = (0xBEEFC0DE).to_bytes(4, "little")
_NAMES = {"lmdb": "an LMDB", "hdf5": "an HDF5", "npz": "an npz (zip)"}
LOADERS = {"lmdb": "LMDBSerializer.load(path)", "hdf5": "HDF5Serializer.load(path)",
           "npz": "NumpySerializer.load(path)"}


def sniff_format(head: bytes) -> str | None:
    """``"lmdb"``, ``"hdf5"`` or ``"npz"`` from a file's first 32 bytes, or ``None``."""
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "hdf5"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "npz"
    if head[16:20] == _LMDB_MAGIC:
        return "lmdb"
    return None


def wrong_format(path: str, head: bytes, wanted: str) -> CorruptDataError | None:
    """The error for a loader of ``wanted`` given a file of another format (by its first bytes), naming
    the loader that reads it; ``None`` when the file is not of another known format (then it is damaged)."""
    found = sniff_format(head)
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
