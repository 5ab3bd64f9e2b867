"""Write a file under a temporary name beside its target and rename it into place only on success.

An exception or Ctrl-C while writing deletes the temporary file (and the sidecar files some formats
create next to it) and re-raises, so the target directory ends exactly as it was. (``bridgeflow
serialize`` turns SIGTERM into the same clean exit.)

A writer that was killed outright (SIGKILL, out of memory, a power cut) cannot clean up: its
``.NAME.tmp-PID-XXXXXXXX`` file stays. The next save of ``NAME`` removes such files, but only those of a
writer that is surely gone: its pid is not running here *and* nobody holds the ``flock`` every writer
keeps on its temporary file while writing (which also protects a live writer in another pid namespace
sharing the folder, whose pid means nothing here).

Example:
    >>> with atomic_path("out.txt", overwrite=False) as tmp:  # out.txt appears only if the block succeeds
    ...     with open(tmp, "w") as f:
    ...         _ = f.write("done")
    >>> open("out.txt").read(), [n for n in os.listdir(".") if n.startswith(".out.txt")]
    ('done', [])
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Sequence

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, stale files are kept
    fcntl = None  # type: ignore[assignment]

from .errors import SerializationError, TargetExistsError

__all__ = ["atomic_path", "check_target", "remove_path", "remove_stale_temporaries"]

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


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True


def _unlocked(path: str) -> bool:
    """Whether nobody holds the writer's lock on ``path`` (taken and released here)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the lock, if taken


def remove_stale_temporaries(target: str | os.PathLike, sidecars: Sequence[str] = ("-lock",)) -> list[str]:
    """Remove the temporary files that killed writers of ``target`` left beside it (see the module doc);
    returns the paths removed. A live writer's file is never touched."""
    folder, name = os.path.split(os.path.abspath(os.fspath(target)))
    pattern = re.compile(rf"\.{re.escape(name)}\.tmp-(\d+)-[0-9a-f]{{8}}")
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m is None or int(m.group(1)) == os.getpid() or _pid_running(int(m.group(1))):
            continue
        path = os.path.join(folder, entry)
        if os.path.isdir(path) or not _unlocked(path):
            continue
        remove_path(path)
        for suffix in sidecars:
            remove_path(path + suffix)
        removed.append(path)
        log.warning("removed %s, left by a writer (pid %s) that is gone", path, m.group(1))
    return removed


def _lock_new_file(tmp: str) -> int | None:
    """Create ``tmp`` empty and hold an exclusive ``flock`` on it while the writer writes it."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a filesystem without flock: the pid check alone decides
            pass
    return fd


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, overwrite: bool = False,
                sidecars: Sequence[str] = ("-lock",)) -> Iterator[str]:
    """Yield a temporary path beside ``path``; rename it to ``path`` when the block succeeds.

    ``sidecars`` are suffixes of extra files a writer may create next to the temporary path (LMDB's
    ``-lock``); they are removed in every case. An existing ``path`` is refused unless ``overwrite``.
    The temporary file exists (empty, locked) when the block starts; the writer opens it by name.
    Temporary files of writers of ``path`` that were killed are removed first.
    """
    target = check_target(path, overwrite)
    remove_stale_temporaries(target, sidecars)
    folder, name = os.path.split(os.path.abspath(target))
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    lock = _lock_new_file(tmp)
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
        if lock is not None:
            os.close(lock)
