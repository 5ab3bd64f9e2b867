"""Move datapoints between processes with array bytes in shared memory: one copy, no pickling of bytes.

The worker pickles a result with protocol 5. Numpy arrays of at least ``INBAND_LIMIT`` bytes hand
their memory out of band; the :class:`SlabWriter` copies those buffers into a *slab*, a shared-memory
file under ``/dev/shm`` that the worker owns and reuses, and sends only the small pickle plus offsets.
The :class:`SlabReader` in the consumer maps each slab once and rebuilds the arrays as views of it: the
single copy is the worker's write into the slab.

Lifetime of received arrays: a received array stays valid for as long as you hold it (or any view of
it). A slab returns to its worker only when every array built from it has been garbage-collected,
through a one-byte flag in a small control segment per worker. So holding arrays is always safe; it
only makes the worker allocate more slabs (up to ``max_slabs``, after which results travel in-band
through the pipe, slower but never blocking). Slabs are not kept at that high-water mark: every
``TRIM_EVERY`` messages the writer frees the unused slabs beyond the most it needed at once in that
window (unlinks them and flags them ``RETIRED``), and the reader drops its mappings of retired slabs, so
the memory goes back to the system once the consumer lets go of what it held.

Segments are named ``bf<pid>_<pool>_...`` so the pool can sweep everything it created, even slabs of a
worker that was killed. Without ``/dev/shm`` (not Linux) or when it is full, results travel in-band.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["SHM_DIR", "SlabReader", "SlabWriter", "create_segment", "sweep_orphans", "sweep_segments"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
INBAND_LIMIT = 32 * 1024  # smaller buffers are cheaper to pickle in-band than to place in a slab
ALIGN = 64
MIN_SLAB = 256 * 1024
FREE, IN_USE, RETIRED = 0, 1, 2  # a slab's flag; RETIRED: unlinked by the writer, to be unmapped by the reader
TRIM_EVERY = 64  # messages between two trims of unused slabs


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def create_segment(name: str, size: int) -> mmap.mmap:
    """Create ``/dev/shm/name`` with ``size`` bytes reserved up front and map it.

    Reserving with ``posix_fallocate`` turns a full ``/dev/shm`` into an ``OSError`` here instead of a
    SIGBUS later, when a page is first written.
    """
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.unlink(path)
            raise
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def open_segment(name: str) -> mmap.mmap:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
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


def sweep_orphans() -> int:
    """Unlink segments left by bridgeflow processes that no longer exist (crashed or killed outright).

    Segment names start with ``bf<pid>_``; a segment whose pid is not running anymore has no owner.
    """
    n = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith("bf") or "_" not in name:
            continue
        pid = name[2:name.index("_")]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            unlink_segment(name)
            n += 1
        except PermissionError:  # alive, someone else's
            pass
    return n


def _round_size(n: int) -> int:
    size = MIN_SLAB
    while size < n:
        size *= 2
    return size


class SlabWriter:
    """Worker side: pickles results, placing large array buffers in reusable slabs.

    ``flags`` is the worker's control segment: byte ``i`` says whether slab ``i`` is held by the consumer.
    """

    def __init__(self, prefix: str, flags: memoryview | None, max_slabs: int) -> None:
        self.prefix = prefix
        self.flags = flags
        self.max_slabs = max_slabs if flags is not None else 0
        self.slabs: list[tuple[str, int, mmap.mmap | None]] = []
        self._bases: list[int] = []  # address of each slab in this process
        self._arena: list[int] | None = None  # [slab index, bytes used] while a message is being built
        self._warned = False
        # close() may run on the worker's parent-watch thread while the main thread is making a slab: the
        # lock and flag make sure no segment is created after close() has unlinked the others. Reentrant:
        # a signal handler on the main thread may call close() while that thread holds the lock.
        self._lock = threading.RLock()
        self._closed = False
        self._acquired = 0  # slabs handed out since the last trim
        self._peak = 0  # the most slabs in use at once since the last trim

    def _acquire(self, nbytes: int) -> int:
        """Index of a free slab of at least ``nbytes``, or -1 when none can be had."""
        flags = self.flags
        best = -1
        in_use = 0
        for i, (_, size, _) in enumerate(self.slabs):
            if flags[i] == IN_USE:
                in_use += 1
            elif size >= nbytes and (best < 0 or size < self.slabs[best][1]):
                best = i
        self._peak = max(self._peak, in_use + 1)
        self._acquired += 1
        if self._acquired >= TRIM_EVERY:
            self._trim(keep=self._peak + 1, spare=best)
            self._acquired, self._peak = 0, in_use + 1
        if best >= 0:
            return best
        hole = next((i for i, (_, _, mm) in enumerate(self.slabs) if mm is None and flags[i] != IN_USE), -1)
        if hole >= 0:  # the index of a retired (or failed) slab is free for a new one
            return self._create(nbytes, hole)
        if len(self.slabs) >= self.max_slabs:
            # Free the smallest unused slab to make room for a bigger one, if there is one.
            free = [i for i, s in enumerate(self.slabs) if flags[i] == FREE]
            if not free:
                return -1
            i = free[0]
            name, _, mm = self.slabs[i]
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # an array of ours still points into it: leave it be
                    return -1
                unlink_segment(name)
            return self._create(nbytes, i)
        return self._create(nbytes, len(self.slabs))

    def _trim(self, keep: int, spare: int) -> None:
        """Free unused slabs beyond ``keep`` live ones, the last first (never ``spare``, about to be used)."""
        excess = sum(mm is not None for _, _, mm in self.slabs) - keep
        for i in reversed(range(len(self.slabs))):
            if excess <= 0:
                break
            name, _, mm = self.slabs[i]
            if mm is None or i == spare or self.flags[i] != FREE:
                continue
            try:
                mm.close()
            except BufferError:  # an array built in place still points into it: keep it
                continue
            unlink_segment(name)
            self.slabs[i] = ("", 0, None)
            self.flags[i] = RETIRED  # the reader unmaps its view when it next looks
            excess -= 1

    def _create(self, nbytes: int, index: int) -> int:
        size = _round_size(nbytes)
        name = f"{self.prefix}{index}_{os.urandom(3).hex()}"
        try:
            with self._lock:
                if self._closed:  # shutting down: the rest of this worker's results go in-band
                    return -1
                mm = create_segment(name, size)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot allocate %d bytes of shared memory in %s (%s); results travel through "
                            "the pipe instead, which is slower", size, SHM_DIR, exc)
                self._warned = True
            if index < len(self.slabs):
                self.slabs[index] = ("", 0, None)  # a hole: keeps the indices of the other slabs
            return -1
        base = _address(memoryview(mm))
        if index == len(self.slabs):
            self.slabs.append((name, size, mm))
            self._bases.append(base)
        else:
            self.slabs[index] = (name, size, mm)
            self._bases[index] = base
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
            _, size, mm = self.slabs[index]
            if used + nbytes <= size:
                arena[1] = used + -(-nbytes // ALIGN) * ALIGN
                return np.frombuffer(mm, dtype=dtype, count=nbytes // dtype.itemsize, offset=used).reshape(shape)
        return np.empty(shape, dtype)

    def dumps(self, obj: Any) -> bytes:
        """Serialize ``obj``; the returned message goes to :meth:`SlabReader.loads` in the consumer."""
        if self.max_slabs == 0:
            return pickle.dumps((None, pickle.dumps(obj, protocol=5)), protocol=5)
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
            return pickle.dumps((None, data), protocol=5)
        raws = [pb.raw() for pb in buffers]
        if arena is not None:
            index, used = arena
            name, size, mm = self.slabs[index]
            base = self._bases[index]
        else:
            total = sum(-(-r.nbytes // ALIGN) * ALIGN for r in raws)
            index, used = self._acquire(total), 0
            if index < 0:  # no shared memory to be had: pickle the bytes in-band
                return pickle.dumps((None, pickle.dumps(obj, protocol=5)), protocol=5)
            name, size, mm = self.slabs[index]
            base = self._bases[index]
        offsets = []
        for r in raws:
            off = _address(r) - base
            if not 0 <= off <= size - r.nbytes:  # not built in place: copy it in
                off = used
                if off + r.nbytes > size:
                    self.flags[index] = FREE
                    return pickle.dumps((None, pickle.dumps(obj, protocol=5)), protocol=5)
                mm[off:off + r.nbytes] = r
                used += -(-r.nbytes // ALIGN) * ALIGN
            offsets.append((off, r.nbytes))
        self.flags[index] = IN_USE
        return pickle.dumps(((name, index, offsets), data), protocol=5)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for name, _, mm in list(self.slabs):
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # an array built in place is still alive; unmapped when it goes
                    pass
                unlink_segment(name)
        self.slabs = []
        self._bases = []


def _address(buf: memoryview) -> int:
    """Address of the first byte of a (non-empty) buffer."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


def _release(flags: memoryview, index: int) -> None:
    try:
        flags[index] = FREE
    except (ValueError, IndexError):  # the control segment is already unmapped: the pool has closed
        pass


class SlabReader:
    """Consumer side for one worker: maps its slabs (once each) and rebuilds arrays as views of them."""

    def __init__(self, flags: memoryview | None) -> None:
        self.flags = flags
        self._maps: dict[int, tuple[str, mmap.mmap]] = {}  # slab index -> (name, mapping)
        self._received = 0

    def loads(self, message: bytes) -> Any:
        slab, data = pickle.loads(message)
        if slab is None:
            return pickle.loads(data)
        self._received += 1
        if self._received % TRIM_EVERY == 0:
            self._unmap_retired()
        name, index, offsets = slab
        known = self._maps.get(index)
        if known is None or known[0] != name:  # a new slab, or the worker replaced this one
            known = self._maps[index] = (name, open_segment(name))
        mm = known[1]
        lease = np.frombuffer(mm, dtype=np.uint8, count=max(off + n for off, n in offsets))
        weakref.finalize(lease, _release, self.flags, index)
        return pickle.loads(data, buffers=[lease[off:off + n] for off, n in offsets])

    def _unmap_retired(self) -> None:
        flags = self.flags
        for index in [i for i in self._maps if flags[i] == RETIRED]:
            _, mm = self._maps.pop(index)
            try:
                mm.close()
            except BufferError:  # cannot happen for a retired slab (no array of it is alive); be safe
                pass

    @property
    def mapped(self) -> int:
        """How many of the worker's slabs this reader has mapped."""
        return len(self._maps)

    def close(self) -> None:
        # Arrays the consumer still holds keep their slab's mapping alive; drop only our references.
        self._maps.clear()
