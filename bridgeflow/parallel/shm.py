"""Move datapoints between processes with array bytes in shared memory: one copy, no pickling of bytes.

The worker pickles a result with protocol 5. Numpy arrays of at least ``INBAND_LIMIT`` bytes hand
their memory out of band; the :class:`SlabWriter` copies those buffers into a *slab*, a shared-memory
file under ``/dev/shm`` that the worker owns and reuses, and sends only the small pickle plus offsets.
The :class:`SlabReader` in the consumer maps each slab once and rebuilds the arrays as views of it: the
single copy is the worker's write into the slab. Mappings keep no file descriptor open
(:mod:`bridgeflow.parallel.mapping`), so holding many results never runs into ``ulimit -n``.

Lifetime of received arrays: a received array stays valid for as long as you hold it (or any view of
it). A slab returns to its worker only when every array built from it has been garbage-collected,
through a one-byte flag in a small control segment per pool. So holding arrays is always safe; it
only makes the worker allocate more slabs (up to ``max_slabs``, after which results travel in-band
through the pipe, slower but never blocking). Slabs are not kept at that high-water mark: the writer
frees the unused slabs beyond the most it needed at once over its last results (about
``TRIM_WINDOW`` results of the whole pool), unlinks them, and tells the reader in its next message,
which unmaps them at once; the memory goes back to the system soon after the consumer lets go.

Segments are named ``bf<pid>_<pool>_...`` so the pool can sweep everything it created, even slabs of a
worker that was killed. Ownership does not rely on the pid, which another pid namespace (a container
sharing ``/dev/shm``) cannot see: the pool holds a lock on its control segment for its whole life (its
workers too), and :func:`sweep_orphans` removes a pool's segments only when it can take that lock.
Without ``/dev/shm`` (not Linux) or when it is full, results travel in-band.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import pickle
import threading
import time
import weakref
from typing import Any

import numpy as np

from .mapping import MappingHookSet, SharedMapping, map_fd

__all__ = ["SHM_DIR", "ControlSegment", "SegmentVanishedError", "SlabReader", "SlabWriter", "create_segment",
           "fd_limit", "raise_fd_limit", "sweep_orphans", "sweep_segments"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
INBAND_LIMIT = 32 * 1024  # smaller buffers are cheaper to pickle in-band than to place in a slab
ALIGN = 64
MIN_SLAB = 256 * 1024
FREE, IN_USE, RETIRED = 0, 1, 2  # a slab's flag; RETIRED: unlinked by the writer
TRIM_WINDOW = 64  # results of the whole pool over which a writer judges how many slabs it needs
MIN_TRIM_WINDOW = 16  # results of one worker: no shorter window, or slabs would be freed and remade
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
        self.view = memoryview(mapping.array())

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
        self.view = None  # type: ignore[assignment]
        self.mapping = None  # type: ignore[assignment]


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


def _round_size(n: int) -> int:
    size = MIN_SLAB
    while size < n:
        size *= 2
    return size


class SlabWriter:
    """Worker side: pickles results, placing large array buffers in reusable slabs.

    ``flags`` is the worker's part of the control segment: byte ``i`` says whether slab ``i`` is held by
    the consumer. ``num_workers`` (of the pool) sets the window over which the writer judges how many
    slabs it needs: about ``TRIM_WINDOW`` results of the whole pool, at least ``MIN_TRIM_WINDOW`` of its own.
    """

    def __init__(self, prefix: str, flags: memoryview | None, max_slabs: int, num_workers: int = 1) -> None:
        self.prefix = prefix
        self.flags = flags
        self.max_slabs = max_slabs if flags is not None else 0
        self.slabs: list[tuple[str, int, SharedMapping | None]] = []
        self._arena: list[int] | None = None  # [slab index, bytes used] while a message is being built
        self._warned = False
        # close() may run on the worker's parent-watch thread while the main thread is making a slab: the
        # lock and flag make sure no segment is created after close() has unlinked the others. Reentrant:
        # a signal handler on the main thread may call close() while that thread holds the lock.
        self._lock = threading.RLock()
        self._closed = False
        window = max(MIN_TRIM_WINDOW, -(-TRIM_WINDOW // max(1, num_workers)))
        self._needed: collections.deque[int] = collections.deque(maxlen=window)  # slabs needed, per message
        self._retired: list[str] = []  # slabs unlinked since the last message: the reader unmaps them

    def _acquire(self, nbytes: int) -> int:
        """Index of a free slab of at least ``nbytes``, or -1 when none can be had."""
        flags = self.flags
        best = -1
        in_use = live = 0
        for i, (_, size, m) in enumerate(self.slabs):
            if m is None:
                continue
            live += 1
            if flags[i] == IN_USE:
                in_use += 1
            elif size >= nbytes and (best < 0 or size < self.slabs[best][1]):
                best = i
        needed = self._needed
        needed.append(in_use + 1)
        if live > in_use + 2 and len(needed) == needed.maxlen:  # unused slabs beyond one spare: still needed?
            excess = live - (max(needed) + 1)
            if excess > 0:
                self._trim(excess, spare=best)
        if best >= 0:
            return best
        hole = next((i for i, (_, _, m) in enumerate(self.slabs) if m is None and flags[i] != IN_USE), -1)
        if hole >= 0:  # the index of a retired (or failed) slab is free for a new one
            return self._create(nbytes, hole)
        if len(self.slabs) >= self.max_slabs:
            # Free an unused slab to make room for a bigger one, if there is one.
            free = [i for i, (_, _, m) in enumerate(self.slabs) if flags[i] == FREE and m is not None]
            if not free:
                return -1
            self._retire(free[0])
            return self._create(nbytes, free[0])
        return self._create(nbytes, len(self.slabs))

    def _retire(self, index: int) -> None:
        """Unlink slab ``index`` and tell the reader; arrays of ours still in it keep it mapped here."""
        name = self.slabs[index][0]
        unlink_segment(name)
        self.slabs[index] = ("", 0, None)
        self.flags[index] = RETIRED
        self._retired.append(name)

    def _trim(self, excess: int, spare: int) -> None:
        """Free ``excess`` unused slabs, the last first (never ``spare``, about to be used)."""
        for i in reversed(range(len(self.slabs))):
            if excess <= 0:
                break
            if self.slabs[i][2] is None or i == spare or self.flags[i] != FREE:
                continue
            self._retire(i)
            excess -= 1

    def _create(self, nbytes: int, index: int) -> int:
        size = _round_size(nbytes)
        name = f"{self.prefix}{index}_{os.urandom(3).hex()}"
        try:
            with self._lock:
                if self._closed:  # shutting down: the rest of this worker's results go in-band
                    return -1
                m = create_segment(name, size)
        except OSError as exc:
            if not self._warned:
                why = (f"this process has reached its limit of open files ({fd_limit()})"
                       if exc.errno == errno.EMFILE else str(exc))
                log.warning("cannot allocate %d bytes of shared memory in %s: %s; results travel through "
                            "the pipe instead, which is slower", size, SHM_DIR, why)
                self._warned = True
            if index < len(self.slabs):
                self.slabs[index] = ("", 0, None)  # a hole: keeps the indices of the other slabs
            return -1
        if index == len(self.slabs):
            self.slabs.append((name, size, m))
        else:
            self.slabs[index] = (name, size, m)
        return index

    def reserve(self, nbytes: int) -> None:
        """Start the next message in a slab of at least ``nbytes``; :meth:`alloc` carves arrays from it.

        Arrays built in place (a batch stacked straight into shared memory) then cost no copy at all.
        """
        if self.max_slabs == 0 or self._arena is not None:  # one arena per message: keep the open one
            return
        index = self._acquire(nbytes)
        if index >= 0:
            self.flags[index] = IN_USE  # not ours to reuse until this message is sent and released
            self._arena = [index, 0]

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialized array inside the reserved slab, or in ordinary memory if it does not fit."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        arena = self._arena
        if arena is not None and nbytes >= INBAND_LIMIT:
            index, used = arena
            _, size, m = self.slabs[index]
            if used + nbytes <= size:
                arena[1] = used + -(-nbytes // ALIGN) * ALIGN
                return m.array(used, nbytes).view(dtype).reshape(shape)
        return np.empty(shape, dtype)

    def _message(self, slab: Any, data: bytes) -> bytes:
        retired, self._retired = self._retired, []
        return pickle.dumps((slab, data, retired), protocol=5)

    def _inband(self, obj: Any) -> bytes:
        return self._message(None, pickle.dumps(obj, protocol=5))

    def dumps(self, obj: Any) -> bytes:
        """Serialize ``obj``; the returned message goes to :meth:`SlabReader.loads` in the consumer."""
        if self.max_slabs == 0:
            return self._inband(obj)
        buffers: list[pickle.PickleBuffer] = []

        def keep(pb: pickle.PickleBuffer) -> bool:
            if pb.raw().nbytes < INBAND_LIMIT:
                return True  # pickle it in-band
            buffers.append(pb)
            return False

        arena, self._arena = self._arena, None
        try:
            data = pickle.dumps(obj, protocol=5, buffer_callback=keep)
        except BaseException:
            if arena is not None:  # the message will not be sent: its reserved slab is free again
                self.flags[arena[0]] = FREE
            raise
        if not buffers:
            if arena is not None:
                self.flags[arena[0]] = FREE
            return self._message(None, data)
        raws = [pb.raw() for pb in buffers]
        if arena is not None:
            index, used = arena
        else:
            total = sum(-(-r.nbytes // ALIGN) * ALIGN for r in raws)
            index, used = self._acquire(total), 0
            if index < 0:  # no shared memory to be had: pickle the bytes in-band
                return self._inband(obj)
        name, size, m = self.slabs[index]
        base = m.address
        offsets = []
        whole = None
        for r in raws:
            src = np.frombuffer(r, np.uint8)
            off = src.__array_interface__["data"][0] - base
            if not 0 <= off <= size - r.nbytes:  # not built in place: copy it in
                off = used
                if off + r.nbytes > size:
                    self.flags[index] = FREE
                    return self._inband(obj)
                if whole is None:
                    whole = m.array()
                whole[off:off + r.nbytes] = src
                used += -(-r.nbytes // ALIGN) * ALIGN
            offsets.append((off, r.nbytes))
        self.flags[index] = IN_USE
        return self._message((name, index, offsets), data)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for name, _, m in list(self.slabs):
            if m is not None:  # arrays built in place that are still alive keep their mapping
                unlink_segment(name)
        self.slabs = []


def _release(flags: memoryview, index: int) -> None:
    try:
        flags[index] = FREE
    except (ValueError, IndexError):  # the flags were released: the pool has closed
        pass


class SlabReader:
    """Consumer side for one worker: maps its slabs (once each) and rebuilds arrays as views of them.

    ``hooks`` (a :class:`~bridgeflow.parallel.mapping.MappingHookSet`) is told of every mapping.
    """

    def __init__(self, flags: memoryview | None, hooks: MappingHookSet | None = None) -> None:
        self.flags = flags
        self.hooks = hooks
        self._maps: dict[int, tuple[str, SharedMapping]] = {}  # slab index -> (name, mapping)

    def loads(self, message: bytes) -> Any:
        slab, data, retired = pickle.loads(message)
        if retired:
            self._unmap(retired)
        if slab is None:
            return pickle.loads(data)
        name, index, offsets = slab
        known = self._maps.get(index)
        if known is None or known[0] != name:  # a new slab, or the worker replaced this one
            known = self._maps[index] = (name, open_segment(name, self.hooks))
        lease = known[1].array(0, max(off + n for off, n in offsets))
        weakref.finalize(lease, _release, self.flags, index)
        return pickle.loads(data, buffers=[lease[off:off + n] for off, n in offsets])

    def _unmap(self, names: list[str]) -> None:
        """Forget the slabs the writer retired; each is unmapped once no array of it is left (none is)."""
        gone = set(names)
        for index in [i for i, (name, _) in self._maps.items() if name in gone]:
            del self._maps[index]

    @property
    def mapped(self) -> int:
        """How many of the worker's slabs this reader has mapped."""
        return len(self._maps)

    def close(self) -> None:
        # Arrays the consumer still holds keep their slab's mapping alive; drop only our references.
        self._maps.clear()
