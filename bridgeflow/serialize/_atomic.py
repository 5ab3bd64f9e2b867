"""Write a file under a temporary name beside its target and rename it into place only on success.

An exception or Ctrl-C while writing deletes the temporary file (and the sidecar files some formats
create next to it) and re-raises, so the target directory ends exactly as it was. (``bridgeflow
serialize`` turns SIGTERM into the same clean exit.) The file is flushed to disk (``fsync``) before the
rename and the folder after it, so a crash or power cut leaves the old file or the whole new one at the
target's name, never a half-written one.

A write that fails raises :class:`DatasetWriteError` naming the *target* (not the hidden temporary file)
and the real cause: :func:`write_error` takes the ``errno`` a library reports, or, when the library hides
it (LMDB says "Input/output error" for a short write on a full disk or past ``ulimit -f``), finds it by
asking for the space the write needed (``posix_fallocate``) and by the file-size limit.

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
import errno
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Sequence

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locks, stale files are kept
    fcntl = None  # type: ignore[assignment]  # not POSIX: the module is absent, checked before use

from .._serialize_errors import DatasetWriteError, SerializationError, TargetExistsError

__all__ = ["atomic_path", "check_target", "remove_path", "remove_stale_temporaries", "write_error"]

_HINTS = {
    errno.ENOSPC: "the disk holding {folder} is full",
    errno.EDQUOT: "the disk quota of {folder} is exhausted",
    errno.EFBIG: "the file would grow past the file-size limit of this process ({limit})",
    errno.EROFS: "{folder} is on a read-only file system",
    errno.EACCES: "no permission to write in {folder}",
    errno.EPERM: "no permission to write in {folder}",
}


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _probe(tmp: str, needed: int) -> int | None:
    """The errno of asking for ``needed`` more bytes at the end of ``tmp`` (None if it was granted)."""
    limit = _file_size_limit()
    try:
        fd = os.open(tmp, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return exc.errno
    try:
        size = os.fstat(fd).st_size
        if limit is not None and size + max(needed, 1) > limit:
            return errno.EFBIG
        try:
            os.posix_fallocate(fd, size, max(needed, 1))
        except OSError as exc:
            return exc.errno
        os.ftruncate(fd, size)
        return None
    except OSError as exc:
        return exc.errno
    finally:
        os.close(fd)


def write_error(target: str, exc: BaseException, tmp: str | None = None, needed: int = 1 << 20) -> DatasetWriteError:
    """A :class:`DatasetWriteError` for ``exc``, met while writing ``target`` (into ``tmp``): it names the
    target and the cause (``exc.errno`` when the library gave one that says more than "I/O error", else
    what asking ``tmp`` for ``needed`` more bytes answers)."""
    code = getattr(exc, "errno", None)
    if (not isinstance(code, int) or code in (0, errno.EIO)) and tmp is not None:
        code = _probe(tmp, needed) or code
    if not isinstance(code, int) or not code:
        code = errno.EIO
    folder = os.path.dirname(os.path.abspath(target))
    limit = _file_size_limit()
    hint = _HINTS.get(code, "").format(folder=folder, limit=f"ulimit -f: {limit} bytes" if limit else "none")
    reason = os.strerror(code) + (f": {hint}" if hint else "")
    said = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)  # never the temporary name
    said = (said.splitlines() or [type(exc).__name__])[0].split(" (file write failed")[0]  # libhdf5's details
    error = DatasetWriteError(code, f"cannot write {target}: {reason} ({errno.errorcode.get(code, code)}; "
                                    f"{type(exc).__name__}: {said[:200]}); nothing was left at that path")
    error.filename = target
    return error


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY if directory else os.O_RDWR) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if not directory or exc.errno not in (errno.EINVAL, errno.EBADF):  # some file systems refuse a folder
            raise
    finally:
        os.close(fd)

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
        raise TargetExistsError(f"{target} already exists; pass overwrite=True to replace it")
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
    removed: list[str] = []
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
    try:
        lock = _lock_new_file(tmp)
    except OSError as exc:  # a read-only folder, no permission, no inode left: about the target
        raise write_error(target, exc) from exc
    try:
        yield tmp
        if not os.path.lexists(tmp):
            raise SerializationError(f"writing {target}: the writer produced no file at {tmp}")
        try:
            _fsync(tmp, directory=os.path.isdir(tmp))
        except OSError as exc:
            raise write_error(target, exc, tmp) from exc
        if os.path.lexists(target):
            if not overwrite:  # appeared while we were writing
                raise TargetExistsError(f"{target} appeared while it was being written; not replacing it")
            if os.path.isdir(target) or os.path.isdir(tmp):  # os.replace swaps files atomically only
                remove_path(target)
        try:
            os.replace(tmp, target)
        except OSError as exc:
            raise write_error(target, exc) from exc
        try:
            _fsync(folder, directory=True)
        except OSError as exc:  # the file is in place; only the rename's durability is in doubt
            log.warning("wrote %s, but flushing its folder to disk failed (%s)", target, exc)
        log.debug("wrote %s", target)
    except BaseException:
        remove_path(tmp)
        raise
    finally:
        for suffix in sidecars:
            remove_path(tmp + suffix)
        if lock is not None:
            os.close(lock)
