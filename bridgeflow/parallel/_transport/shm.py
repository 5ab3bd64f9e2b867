"""Move datapoints between processes with array bytes in shared memory: one copy, no pickling of bytes.

The worker pickles a result with protocol 5, once. Numpy arrays of at least ``INBAND_LIMIT`` bytes hand
their memory out of band (an array of any other layout than C or Fortran order is made contiguous first,
so a transposed view never travels inside the pickle, whatever numpy's version); the :class:`SlabWriter`
copies those buffers into a *slab*, a shared-memory file under ``/dev/shm`` that the worker owns and
reuses, and the pickle itself too when it is larger than ``PIPE_DATA_LIMIT`` (a batch of many small
arrays, lists, strings). The pipe carries only a head of a few hundred bytes (where the pickle and the
buffers lie), so a worker's send never waits for the consumer to read its pipe; the consumer unpickles
straight from the slab and, when no array of the message lives on in it, frees the slab at once. A result
built in a slab to begin with (:meth:`SlabWriter.alloc`: a batch stacked straight into shared memory) is not
copied at all; the slab it is built in is sized from the bytes the writer's recent messages carried, or from
:meth:`SlabWriter.reserve`.
The :class:`SlabReader` in the consumer maps each slab once and rebuilds the arrays as views of it: the
single copy is the worker's write into the slab. Mappings keep no file descriptor open
(:mod:`bridgeflow.parallel._transport.mapping`), so holding many results never runs into ``ulimit -n``.

Lifetime of received arrays: a received array stays valid for as long as you hold it (or any view of
it). A slab returns to its worker only when every array built from it has been garbage-collected,
through a one-byte flag in a small control segment per pool. So holding arrays is always safe; it
only makes the worker allocate more slabs (up to ``max_slabs``, after which results travel in-band
through the pipe, slower but never blocking). Slabs are not kept at that high-water mark: the writer
frees the unused slabs beyond the most it needed at once over its last results (about
``TRIM_WINDOW`` results of the whole pool), unlinks them, and tells the reader in its next message,
which unmaps them at once; the memory goes back to the system soon after the consumer lets go.

Segments, their names and their ownership are :mod:`bridgeflow.parallel._transport.segments`'s. Without
``/dev/shm`` (not Linux) or when it is full, results travel in-band.
"""

from __future__ import annotations

import collections
import copyreg
import errno
import io
import logging
import os
import pickle
import struct
import threading
import weakref
from typing import Any

import numpy as np

from .mapping import MappingHookSet, SharedMapping
from .segments import (
    CTL_HEADER,
    SHM_DIR,
    ControlSegment,
    SegmentVanishedError,
    create_segment,
    fd_limit,
    forget_inherited_controls,
    open_segment,
    raise_fd_limit,
    shm_available,
    sweep_orphans,
    sweep_segments,
    unlink_segment,
)

# The transport's own names, and the segment helpers the pool and its workers reach through this module.
__all__ = [
    "CTL_HEADER", "SHM_DIR", "ControlSegment", "SegmentVanishedError", "SlabReader", "SlabWriter",
    "create_segment", "fd_limit", "forget_inherited_controls", "open_segment", "raise_fd_limit",
    "shm_available", "sweep_orphans", "sweep_segments", "unlink_segment",
]

log = logging.getLogger(__name__)

INBAND_LIMIT = 32 * 1024  # smaller buffers are cheaper to pickle in-band than to place in a slab
ALIGN = 64
MIN_SLAB = 256 * 1024
FREE, IN_USE, RETIRED = 0, 1, 2  # a slab's flag; RETIRED: unlinked by the writer
TRIM_WINDOW = 64  # results of the whole pool over which a writer judges how many slabs it needs
MIN_TRIM_WINDOW = 16  # results of one worker: no shorter window, or slabs would be freed and remade


EXACT_ABOVE = 64 << 20  # slabs above this size are made to measure (in 2 MiB steps), not to a power of two
PIPE_DATA_LIMIT = 4096  # a pickle up to this size travels in the pipe, after the head; a larger one in the slab
_MAGIC = b"BFm2"
_HEAD = struct.Struct("<4sI")  # the magic, then the size of the pickled head that follows


def _round_size(n: int) -> int:
    """A slab's size for ``n`` bytes: a power of two (reused by results of varying sizes) up to
    ``EXACT_ABOVE``, then ``n`` rounded up to 2 MiB, so a huge datapoint asks for what it needs."""
    if n > EXACT_ABOVE:
        return -(-n // (2 << 20)) * (2 << 20)
    size = MIN_SLAB
    while size < n:
        size *= 2
    return size


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(raws: list[memoryview], used: int, where: list[int | None] | None = None) -> tuple[list, int]:
    """Where each buffer of a message goes in its slab, from offset ``used`` on: ``(offsets, bytes taken
    after used)``. Each starts at an ``ALIGN`` boundary, or stays at ``where[k]`` (built in the slab)."""
    layout: list[tuple[int, int]] = []
    at = used
    for k, r in enumerate(raws):
        built = where[k] if where is not None else None
        if built is not None:
            layout.append((built, r.nbytes))
        else:
            at = _align(at)
            layout.append((at, r.nbytes))
            at += r.nbytes
    return layout, _align(at) - used


def _pairs(layout: list[tuple[int, int]]) -> bytes:
    """The offsets of a message's buffers, as its head carries them: int64 (offset, size) pairs."""
    return struct.pack(f"<{2 * len(layout)}q", *(v for pair in layout for v in pair)) if layout else b""


def _rebuild(region: Any, layout: Any, lease: np.ndarray | None) -> list:
    """The buffers of a message at ``layout``'s flat (offset, size) pairs: views of ``lease`` (the slab), or
    without one (the pipe message's tail) a writable copy each."""
    if lease is not None:
        whole = lease.data  # views of it keep the lease alive
        return [whole[layout[k]:layout[k] + layout[k + 1]] for k in range(0, len(layout), 2)]
    return [bytearray(region[layout[k]:layout[k] + layout[k + 1]]) for k in range(0, len(layout), 2)]


class SlabWriter:
    """Worker side: pickles results, placing large array buffers in reusable slabs.

    ``flags`` is the worker's part of the control segment: byte ``i`` says whether slab ``i`` is held by
    the consumer. ``num_workers`` (of the pool) sets the window over which the writer judges how many
    slabs it needs: about ``TRIM_WINDOW`` results of the whole pool, at least ``MIN_TRIM_WINDOW`` of its own.
    """

    def __init__(self, prefix: str, flags: memoryview | None, max_slabs: int, num_workers: int = 1) -> None:
        self.prefix = prefix
        # no flags: a writer that makes no slab (max_slabs 0), so never reads them; empty, not None, for the types
        self.flags = flags if flags is not None else memoryview(b"")
        self.max_slabs = max_slabs if flags is not None else 0
        self.slabs: list[tuple[str, int, SharedMapping | None]] = []
        self._views: list[memoryview | None] = []  # a byte view of each slab, to copy into at once
        self._arena: list[int] | None = None  # [slab index, bytes used] while a message is being built
        self._warned = False
        self.last_bytes = 0  # of the last message made
        # close() may run on the worker's parent-watch thread while the main thread is making a slab: the
        # lock and flag make sure no segment is created after close() has unlinked the others. Reentrant:
        # a signal handler on the main thread may call close() while that thread holds the lock.
        self._lock = threading.RLock()
        self._closed = False
        window = max(MIN_TRIM_WINDOW, -(-TRIM_WINDOW // max(1, num_workers)))
        self._needed: collections.deque[int] = collections.deque(maxlen=window)  # slabs needed, per message
        self._retired: list[str] = []  # slabs unlinked since the last message: the reader unmaps them
        self._sent: collections.deque[int] = collections.deque(maxlen=window)  # slab bytes of recent messages
        self._opens_arena = True  # alloc() may start a message's slab (not while pickling one for the pipe)
        self.reducers: dict[type, Any] = {}  # type -> reduce function, for the pickles of every message
        # A writer that replaces a dead one (a restarted worker) leaves the slabs the consumer still holds
        # alone: their indices are holes, taken again once their flags say the consumer let go.
        held = bytes(self.flags[:self.max_slabs]).rfind(IN_USE) + 1 if self.max_slabs else 0
        self.slabs += [("", 0, None)] * held
        self._views += [None] * held

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
        self._views[index] = None
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
                self._views[index] = None
            return -1
        if index == len(self.slabs):
            self.slabs.append((name, size, m))
            self._views.append(m.array().data)
        else:
            self.slabs[index] = (name, size, m)
            self._views[index] = m.array().data
        return index

    def reserve(self, nbytes: int) -> None:
        """Start the next message in a slab of at least ``nbytes``; :meth:`alloc` carves arrays from it.

        Arrays built in place (a batch stacked straight into shared memory) then cost no copy at all.
        Optional: without it, the first :meth:`alloc` of a message starts its slab, sized as the recent
        messages needed.
        """
        if self.max_slabs == 0 or self._arena is not None:  # one arena per message: keep the open one
            return
        index = self._acquire(nbytes)
        if index >= 0:
            self.flags[index] = IN_USE  # not ours to reuse until this message is sent and released
            self._arena = [index, 0]

    def alloc(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialized array inside the message's slab, or in ordinary memory if it does not fit (or
        is smaller than ``INBAND_LIMIT``). The first array of a message starts the slab: big enough for it
        and for the most the writer's recent messages placed in shared memory (see :meth:`reserve`)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < INBAND_LIMIT:
            return np.empty(shape, dtype)
        if self._arena is None and self._opens_arena:
            self.reserve(max(_align(nbytes), max(self._sent, default=0)))
        arena = self._arena
        if arena is not None:
            index, used = arena
            size, view = self.slabs[index][1], self._views[index]
            if used + nbytes <= size:
                assert view is not None  # the arena's slab is a live one
                arena[1] = used + -(-nbytes // ALIGN) * ALIGN
                return np.frombuffer(view, dtype, nbytes // dtype.itemsize, used).reshape(shape)
        return np.empty(shape, dtype)

    def _reduce_array(self, a: np.ndarray) -> Any:
        """How a numpy array is pickled here: as numpy does (its memory out of band when it is contiguous),
        except that a large array in any other layout (a transposed or sliced view, channels-last) is first
        copied into the message's slab (or ordinary memory), contiguous: numpy < 2.3 would copy it into the
        pickle itself, through the pipe, and copy it again in the consumer. It arrives contiguous. A small
        array is pickled in numpy's protocol-4 form, in the pickle: built and rebuilt in C (protocol 5's
        in-band form is rebuilt through a Python function, and hands the buffer callback a buffer per
        array), which makes a batch of many small arrays about a third cheaper to pickle and unpickle."""
        if a.nbytes < INBAND_LIMIT:
            return a.__reduce_ex__(4)
        if not (a.flags.c_contiguous or a.flags.f_contiguous) and not a.dtype.hasobject:
            out = self.alloc(a.shape, a.dtype)
            np.copyto(out, a)
            a = out
        return a.__reduce_ex__(5)

    def _pickle(self, obj: Any, buffer_callback: Any = None) -> bytes:
        out = io.BytesIO()
        pickler = pickle.Pickler(out, protocol=5, buffer_callback=buffer_callback)
        pickler.dispatch_table = {**copyreg.dispatch_table, **self.reducers, np.ndarray: self._reduce_array}
        pickler.dump(obj)
        return out.getvalue()

    def _frame(self, head: tuple, data: Any, extra: int = 0) -> bytearray:
        """The pipe message: its head (where the pickle and the buffers lie, the retired slabs), then the
        pickle itself when it travels in the pipe (``data``; empty when it lies in the slab)."""
        retired, self._retired = self._retired, []
        packed = pickle.dumps((*head, retired), protocol=5)
        out = bytearray(_HEAD.size + len(packed) + len(data))
        _HEAD.pack_into(out, 0, _MAGIC, len(packed))
        out[_HEAD.size:_HEAD.size + len(packed)] = packed
        out[_HEAD.size + len(packed):] = data
        self.last_bytes = len(out) + extra  # what the message occupies, its shared memory included
        return out

    def _inband(self, obj: Any) -> bytearray:
        """The whole message for the pipe, when no slab can be had: the head, the pickle, then the large
        buffers, each copied once into the message (a pickle would copy them into itself, then again)."""
        self._arena = None
        raws: list[memoryview] = []

        def keep(pb: pickle.PickleBuffer) -> bool:
            if pb.raw().nbytes < INBAND_LIMIT:
                return True
            raws.append(pb.raw())
            return False

        self._opens_arena = False
        try:
            data = self._pickle(obj, keep)
        finally:
            self._opens_arena = True
        layout, total = _layout(raws, 0)
        retired, self._retired = self._retired, []
        packed = pickle.dumps((None, (0, len(data)) if raws else None, _pairs(layout), retired), protocol=5)
        start = _align(_HEAD.size + len(packed) + len(data))
        out = bytearray(start + total)
        _HEAD.pack_into(out, 0, _MAGIC, len(packed))
        view = memoryview(out)  # assigning to a bytearray's slice would copy a non-bytearray source first
        view[_HEAD.size:_HEAD.size + len(packed)] = packed
        view[_HEAD.size + len(packed):_HEAD.size + len(packed) + len(data)] = data
        for (off, n), r in zip(layout, raws):
            view[start + off:start + off + n] = r.cast("B")
        view.release()
        self.last_bytes = len(out)
        return out

    def dumps(self, obj: Any) -> bytes | bytearray:
        """Serialize ``obj`` in one pickling pass; the returned message goes to :meth:`SlabReader.loads` in
        the consumer. Large array buffers go into a slab, and so does the pickle unless it is small (up to
        ``PIPE_DATA_LIMIT`` bytes): the pipe carries a head of a few hundred bytes, so a send does not wait
        for the consumer to read (a pipe holds 64 KiB), and nothing is pickled twice."""
        if self.max_slabs == 0:
            return self._inband(obj)
        raws: list[memoryview] = []

        def keep(pb: pickle.PickleBuffer) -> bool:
            raw = pb.raw()
            if raw.nbytes < INBAND_LIMIT:
                return True  # pickle it in-band
            raws.append(raw)
            return False

        try:  # arrays made contiguous while pickling go into the message's slab (started then if need be)
            data = self._pickle(obj, keep)
        except BaseException:
            if self._arena is not None:  # the message will not be sent: its reserved slab is free again
                self.flags[self._arena[0]] = FREE
            raise
        finally:
            arena, self._arena = self._arena, None
        if not raws and len(data) <= PIPE_DATA_LIMIT:
            if arena is not None:
                self.flags[arena[0]] = FREE
            return self._frame((None, None, b""), data)
        inline = len(data) <= PIPE_DATA_LIMIT
        placed = self._place(raws, data, inline, arena) if arena is not None else None
        if placed is None:  # no arena, or it cannot take what was not built in it: a slab for it all
            _, total = _layout(raws, 0)
            index = self._acquire(total + (0 if inline else len(data)))
            if arena is not None:
                self.flags[arena[0]] = FREE  # after the acquire: the new slab is another one
            if index < 0:  # no shared memory to be had: everything through the pipe
                return self._inband(obj)
            placed = self._place(raws, data, inline, [index, 0], in_place=False)
            assert placed is not None  # the slab was acquired for all of it
        index, layout, data_at, nbytes = placed
        self._sent.append(nbytes)
        self.flags[index] = IN_USE
        return self._frame(((self.slabs[index][0], index), data_at, _pairs(layout)),
                           data if inline else b"", nbytes)

    def _place(self, raws: list[memoryview], data: bytes, inline: bool, arena: list[int],
               in_place: bool = True) -> Any:
        """Lay out ``raws`` (and ``data``, the pickle, unless it goes ``inline`` in the pipe) in the
        ``arena`` slab (``[index, bytes used]``): buffers built in it stay where they are (``in_place``),
        the others are copied after its used bytes. ``(index, offsets, data's (offset, size) or None, bytes
        used)``; None when it does not fit."""
        index, used = arena
        _, size, m = self.slabs[index]
        view = self._views[index]
        assert m is not None and view is not None  # _acquire and the arena hand out live slabs only
        base = m.address
        where: list[int | None] = [None] * len(raws)
        if in_place:
            for k, r in enumerate(raws):
                off = np.frombuffer(r, np.uint8).__array_interface__["data"][0] - base
                if 0 <= off <= size - r.nbytes:
                    where[k] = off
        layout, total = _layout(raws, used, where)
        end = used + total + (0 if inline else len(data))
        if end > size:
            return None
        for (off, n), r, built in zip(layout, raws, where):
            if built is None:
                view[off:off + n] = r.cast("B")
        data_at = None
        if not inline:
            data_at = (used + total, len(data))
            view[used + total:end] = data
        return index, layout, data_at, end - used

    def reader_gone(self) -> None:
        """The worker reading these slabs died: nothing holds them any more, so every one is free again."""
        for i, (_, _, m) in enumerate(self.slabs):
            if m is not None and self.flags[i] == IN_USE:
                self.flags[i] = FREE

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for name, _, m in list(self.slabs):
            if m is not None:  # arrays built in place that are still alive keep their mapping
                unlink_segment(name)
        self.slabs = []
        self._views = []


def _release(flags: memoryview, index: int, pid: int) -> None:
    if os.getpid() != pid:  # a forked child's copy of the array: the slab is still the parent's to release
        return
    try:
        flags[index] = FREE
    except (ValueError, IndexError):  # the flags were released: the pool has closed
        pass


class SlabReader:
    """Consumer side for one worker: maps its slabs (once each) and rebuilds arrays as views of them.

    ``hooks`` (a :class:`~bridgeflow.parallel._transport.mapping.MappingHookSet`) is told of every mapping.
    """

    def __init__(self, flags: memoryview | None, hooks: MappingHookSet | None = None) -> None:
        # no flags: a reader of a writer that makes no slab (see SlabWriter), so it never releases one
        self.flags = flags if flags is not None else memoryview(b"")
        self.hooks = hooks
        self._pid = os.getpid()
        self._maps: dict[int, tuple[str, memoryview]] = {}  # slab index -> (name, byte view of its mapping)
        self._leases: dict[int, weakref.finalize] = {}  # slab index -> the release of the arrays received in it
        self.last_bytes = 0  # of the last message read

    def loads(self, message: bytes | bytearray) -> Any:
        self.last_bytes = len(message)  # what the message occupies, its shared memory included
        view = memoryview(message)
        magic, n = _HEAD.unpack_from(view, 0)
        if magic != _MAGIC:
            raise ValueError(f"not a message of bridgeflow's transport (it starts with {bytes(view[:4])!r})")
        slab, data_at, pairs, retired = pickle.loads(view[_HEAD.size:_HEAD.size + n])
        if retired:
            self._unmap(retired)
        layout = memoryview(pairs).cast("q") if pairs else ()
        after = _HEAD.size + n
        if slab is None:  # everything in the pipe: the pickle, then (no slab could be had) the buffers
            if data_at is None:
                return pickle.loads(view[after:])
            end = after + data_at[1]
            return pickle.loads(view[after:end], buffers=_rebuild(view[_align(end):], layout, None))
        name, index = slab
        known = self._maps.get(index)
        if known is None or known[0] != name:  # a new slab, or the worker replaced this one
            known = self._maps[index] = (name, open_segment(name, self.hooks).array().data)
        mapping = known[1]
        self.last_bytes += sum(layout[k + 1] for k in range(0, len(layout), 2)) + (data_at[1] if data_at else 0)
        lease = None
        if layout:  # the arrays are views of the slab: it goes back to the worker when the last has gone
            lease = np.frombuffer(mapping, np.uint8, max(layout[k] + layout[k + 1] for k in range(0, len(layout), 2)))
            self._leases[index] = weakref.finalize(lease, _release, self.flags, index, self._pid)
        try:
            data = mapping[data_at[0]:data_at[0] + data_at[1]] if data_at else view[after:]
            return pickle.loads(data, buffers=_rebuild(mapping, layout, lease))
        finally:
            if lease is None:  # nothing of the slab is kept (the pickle is read): it is free again now
                _release(self.flags, index, self._pid)

    def _unmap(self, names: list[str]) -> None:
        """Forget the slabs the writer retired; each is unmapped once no array of it is left (none is)."""
        gone = set(names)
        for index in [i for i, (name, _) in self._maps.items() if name in gone]:
            del self._maps[index]

    def writer_replaced(self) -> None:
        """The worker died and a new one takes its place: forget its slabs (they were unlinked; arrays still
        held keep their mappings, and their flags, until they go), and free the flags that no array holds:
        the slab of a message it was building or sending when it died. The new writer keeps off the others."""
        self._maps.clear()
        self._leases = {i: lease for i, lease in self._leases.items() if lease.alive}
        flags = self.flags
        for i in range(len(flags)):
            if flags[i] != FREE and i not in self._leases:
                flags[i] = FREE

    @property
    def mapped(self) -> int:
        """How many of the worker's slabs this reader has mapped."""
        return len(self._maps)

    def close(self) -> None:
        # Arrays the consumer still holds keep their slab's mapping alive; drop only our references.
        self._maps.clear()
