"""Small pieces shared by the dataset formats: progress bars, path checks, index normalisation."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from .._progress import progress_bar
from ..base import DataFlow
from .errors import CorruptDataError, DatasetNotFoundError

__all__ = ["classes_json", "existing_path", "iterate_source", "normalize_index", "parse_classes",
           "source_length"]


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
    """``reset_state()`` then iterate ``df`` behind a tqdm bar on stderr (with ETA when len() is known)."""
    if not hasattr(df, "__iter__"):
        raise TypeError(f"{desc}: expected a DataFlow or iterable, got {type(df).__name__}")
    if hasattr(df, "reset_state"):
        df.reset_state()
    with progress_bar(enabled=progress, total=source_length(df), desc=desc, unit="dp") as bar:
        for dp in df:
            yield dp
            bar.update(1)


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
