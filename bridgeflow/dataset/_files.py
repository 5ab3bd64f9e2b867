"""Where tensorpack-style datasets live on disk, and the error for a missing file."""

from __future__ import annotations

import os

from .._errors import BridgeflowError

__all__ = ["DatasetFilesMissingError", "dataset_path", "require_path"]


class DatasetFilesMissingError(BridgeflowError, FileNotFoundError):
    """A dataset file or folder is not where it should be; the message names it and what to get.

    bridgeflow never downloads datasets: put a local copy there, or pass the argument that points to it.
    """


def dataset_path(*parts: str) -> str:
    """``$TENSORPACK_DATASET/<parts>``, or ``~/tensorpack_data/<parts>`` (tensorpack's default places)."""
    root = os.environ.get("TENSORPACK_DATASET") or os.path.join(os.path.expanduser("~"), "tensorpack_data")
    return os.path.join(root, *parts)


def require_path(path: str, kind: str, hint: str) -> str:
    """``path`` if it exists as a ``kind`` ("file" or "folder"), else :class:`DatasetFilesMissingError`."""
    exists = os.path.isfile(path) if kind == "file" else os.path.isdir(path)
    if not exists:
        raise DatasetFilesMissingError(f"{kind} {path} not found; {hint}")
    return path
