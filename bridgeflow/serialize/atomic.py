"""Write a file under a temporary name beside its target and rename it into place only on success.

An exception or Ctrl-C while writing deletes the temporary file (and the sidecar files some formats
create next to it) and re-raises, so the target directory ends exactly as it was.

Example:
    >>> with atomic_path("out.lmdb", overwrite=False) as tmp:  # doctest: +SKIP
    ...     write_everything_to(tmp)
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence

from .errors import SerializationError, TargetExistsError

__all__ = ["atomic_path", "check_target", "remove_path"]

log = logging.getLogger(__name__)


def remove_path(path: str) -> None:
    """Remove a file or a directory tree; a missing path is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def check_target(path: str | os.PathLike, overwrite: bool) -> str:
    """Return ``path`` as a string after checking it may be written: its folder exists, and it does not
    exist unless ``overwrite``."""
    target = os.fspath(path)
    if not target or target.endswith(os.sep):
        raise ValueError(f"save needs a file path, got {target!r}")
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot save {target}: folder {folder} does not exist")
    if os.path.lexists(target) and not overwrite:
        raise TargetExistsError(f"{target} already exists; pass overwrite=True (--overwrite) to replace it")
    return target


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, overwrite: bool = False,
                sidecars: Sequence[str] = ("-lock",)) -> Iterator[str]:
    """Yield a temporary path beside ``path``; rename it to ``path`` when the block succeeds.

    ``sidecars`` are suffixes of extra files a writer may create next to the temporary path (LMDB's
    ``-lock``); they are removed in every case. An existing ``path`` is refused unless ``overwrite``.
    """
    target = check_target(path, overwrite)
    folder, name = os.path.split(os.path.abspath(target))
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield tmp
        if not os.path.lexists(tmp):
            raise SerializationError(f"writing {target}: the writer produced no file at {tmp}")
        if os.path.lexists(target):
            if not overwrite:  # appeared while we were writing
                raise TargetExistsError(f"{target} appeared while it was being written; not replacing it")
            if os.path.isdir(target) or os.path.isdir(tmp):  # os.replace swaps files atomically only
                remove_path(target)
        os.replace(tmp, target)
        log.debug("wrote %s", target)
    except BaseException:
        remove_path(tmp)
        raise
    finally:
        for suffix in sidecars:
            remove_path(tmp + suffix)
