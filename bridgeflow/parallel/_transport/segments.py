"""Shared-memory segments under ``/dev/shm``: creating, mapping, removing them, and who owns them.

Segments are named ``bf<pid>_<pool>_...`` so a pool can sweep everything it created, even slabs of a
worker that was killed. Ownership does not rely on the pid, which another pid namespace (a container
sharing ``/dev/shm``: Docker ``--ipc=host``, pods sharing a volume) cannot see: the pool holds a shared
``flock`` on its :class:`ControlSegment` for its whole life, and so does each of its workers. The kernel
keeps the lock on the file, whatever namespace the holder runs in, so :func:`sweep_orphans` removes a
pool's segments only when it can take that lock itself: when the pool and all its workers have exited.

Mappings keep no descriptor open (:mod:`bridgeflow.parallel._transport.mapping`), so a process needs one only for
a moment per segment, and one per pool for the lock. :func:`raise_fd_limit` lifts the soft limit of open
files to the hard one at pool start all the same.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import time
import weakref

from .mapping import MappingHookSet, SharedMapping, map_fd

__all__ = [
    "CTL_HEADER", "SHM_DIR", "ControlSegment", "SegmentVanishedError", "create_segment", "fd_limit",
    "forget_inherited_controls", "open_segment", "raise_fd_limit", "shm_available", "sweep_orphans",
    "sweep_segments", "unlink_segment",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
CTL_MAGIC = b"BFCTL\x01\x00\x00"  # a control segment whose owner holds a lock on it for its lifetime
CTL_HEADER = 64  # bytes before the workers' flags in a control segment
_NEW_CTL_GRACE_S = 60.0  # an unlocked control segment still being created is left alone this long


class SegmentVanishedError(FileNotFoundError):
    """A shared-memory segment of a running pool was removed by someone else."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def fd_limit() -> str:
    """This process's limit of open files, for messages: ``"ulimit -n 64 (hard limit 64)"``."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return "ulimit -n unknown"
    show = lambda n: "unlimited" if n == resource.RLIM_INFINITY else str(n)
    return f"ulimit -n {show(soft)} (hard limit {show(hard)})"


_fd_limit_raised = False


def raise_fd_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit, once (as many data loaders do).

    Workers inherit the limit. Where the hard limit is unlimited, the soft limit goes to 1,048,576 (the
    kernel's default ``nr_open``).
    """
    global _fd_limit_raised
    if _fd_limit_raised:
        return
    _fd_limit_raised = True
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("raised the soft limit of open files from %d to %d", soft, target)
    except (ImportError, OSError, ValueError) as exc:
        log.debug("cannot raise the limit of open files: %s", exc)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def create_segment(name: str, size: int) -> SharedMapping:
    """Create ``/dev/shm/name`` with ``size`` bytes reserved up front and map it (no descriptor kept).

    Reserving with ``posix_fallocate`` turns a full ``/dev/shm`` into an ``OSError`` here instead of a
    SIGBUS later, when a page is first written.
    """
    path = _path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
            return map_fd(fd, size, name)
        except OSError:
            os.unlink(path)
            raise
    finally:
        os.close(fd)


def open_segment(name: str, hooks: MappingHookSet | None = None) -> SharedMapping:
    """Map the existing segment ``name``; a missing one raises :class:`SegmentVanishedError`."""
    try:
        fd = os.open(_path(name), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SegmentVanishedError(
            errno.ENOENT, f"the shared-memory segment {_path(name)} vanished while its pool was running: another "
            "process removed it (a cleanup script, or an older bridgeflow sharing /dev/shm from another "
            "container)") from None
    except OSError as exc:
        if exc.errno == errno.EMFILE:
            raise OSError(errno.EMFILE, f"cannot map the shared-memory segment {_path(name)}: this process has "
                          f"reached its limit of open files ({fd_limit()}); raise it") from exc
        raise
    try:
        return map_fd(fd, os.fstat(fd).st_size, name, hooks)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def sweep_segments(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix``; returns how many were removed."""
    n = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            unlink_segment(name)
            n += 1
    return n


_owned_controls: weakref.WeakSet = weakref.WeakSet()  # control segments this process created


class ControlSegment:
    """A pool's control segment: the flags and counters its workers share, plus its ownership lock.

    The pool creates it with :meth:`create` and holds a shared ``flock`` on it until :meth:`close`;
    each worker opens it with :meth:`open` and holds a shared lock too. A lock works across pid
    namespaces (the kernel keeps it on the file), so :func:`sweep_orphans` in another container sees
    that the pool is alive, where a pid check would not.
    """

    def __init__(self, name: str, fd: int, mapping: SharedMapping) -> None:
        self.name, self.fd, self.mapping = name, fd, mapping
        self.view = mapping.array().data

    @classmethod
    def create(cls, name: str, size: int) -> ControlSegment:
        # Made under a temporary name, locked, then renamed: a sweeper never sees it unlocked.
        tmp = f"bfnew{os.getpid()}_{os.urandom(4).hex()}"
        fd = os.open(_path(tmp), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            size += CTL_HEADER
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, CTL_MAGIC, 0)
            mapping = map_fd(fd, size, name)
            os.rename(_path(tmp), _path(name))
        except BaseException:
            os.close(fd)
            unlink_segment(tmp)
            raise
        ctl = cls(name, fd, mapping)
        _owned_controls.add(ctl)
        return ctl

    @classmethod
    def open(cls, name: str) -> ControlSegment:
        fd = os.open(_path(name), os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            mapping = map_fd(fd, os.fstat(fd).st_size, name)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, fd, mapping)

    def close(self) -> None:
        """Release the lock and drop the mapping (unmapped once no flag view of it is left)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        self.view = None  # type: ignore[assignment]  # closed: neither is read after close()
        self.mapping = None  # type: ignore[assignment]  # (same)


def forget_inherited_controls() -> None:
    """In a forked child: close the descriptors (and so the locks) of the parent's control segments,
    which the child does not own."""
    for ctl in list(_owned_controls):
        fd, ctl.fd = ctl.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    _owned_controls.clear()


def _owner_state(ctl: str, *, new: bool = False) -> str:
    """``"alive"``, ``"dead"`` or ``"gone"`` (no such segment) for the owner of control segment ``ctl``.

    ``new``: a control segment still under its temporary name, dead once nobody holds its lock.
    """
    try:
        fd = os.open(_path(ctl), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return "gone"
    except OSError:
        return "alive"  # cannot tell: never remove what might be in use
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: the owner, or one of its workers, holds its lock
            return "alive"
        if new or os.pread(fd, len(CTL_MAGIC), 0) == CTL_MAGIC:
            return "dead"
        # A control segment of a bridgeflow that took no lock: judge by the pid in its name, as it did.
        try:
            os.kill(int(ctl[2:ctl.index("_")]), 0)
        except ProcessLookupError:
            return "dead"
        except (PermissionError, ValueError):
            pass
        return "alive"
    finally:
        os.close(fd)


def sweep_orphans() -> int:
    """Unlink segments left by bridgeflow pools whose owner is gone (crashed or killed outright).

    A pool's segments share the prefix ``bf<pid>_<pool>_``. They are removed when the pool's control
    segment is unlocked (its owner and workers have all exited) or missing, never while anyone holds
    its lock, whatever pid namespace the owner runs in. Returns how many segments were removed.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    groups: dict[str, list[str]] = collections.defaultdict(list)
    now = time.time()
    n = 0
    for name in names:
        if name.startswith("bfnew"):  # a control segment being created: removed only if long abandoned
            try:
                if now - os.stat(_path(name)).st_mtime > _NEW_CTL_GRACE_S and _owner_state(name, new=True) == "dead":
                    unlink_segment(name)
                    n += 1
            except (OSError, ValueError):
                pass
            continue
        if not name.startswith("bf"):
            continue
        parts = name.split("_", 2)
        if len(parts) < 3 or not parts[0][2:].isdigit():
            continue
        groups[f"{parts[0]}_{parts[1]}_"].append(name)
    for prefix, members in groups.items():
        state = _owner_state(prefix + "ctl")  # looked at after the listing: a live pool's is there by now
        if state == "alive":
            continue
        for name in members:
            unlink_segment(name)
            n += 1
    return n
