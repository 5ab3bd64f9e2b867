"""Shared-memory mappings that keep no file descriptor open, and hooks told when one opens and closes.

Python's :class:`mmap.mmap` duplicates the descriptor it maps and keeps the copy until it is closed
(``trackfd=False`` turns that off only from Python 3.13), so a consumer holding many results from
shared-memory slabs would hold one descriptor per slab and run into ``ulimit -n``. A
:class:`SharedMapping` maps the file through the C library's ``mmap`` instead, on every Python version,
and keeps nothing but the address: the descriptor is closed as soon as the file is mapped.

Its memory stays mapped for as long as the mapping object, or any numpy array made from it (views
included), is alive; the last one to go unmaps it. That is the transport's guarantee that a received
array stays valid as long as you hold it, and it also puts the unmap at a known moment, right after
:meth:`MappingHooks.closing` (a ``mmap.mmap`` unmaps itself before its weak references are called).

Hooks let code outside the core act on mappings without the core importing it: the torch adapter
registers each slab as page-locked memory for CUDA copies when it is mapped, and unregisters it before
it is unmapped. See :class:`MappingHooks` for the contract.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import traceback
import weakref
from typing import Any, Protocol

import numpy as np

__all__ = ["MappingHookSet", "MappingHooks", "SharedMapping", "map_fd"]

log = logging.getLogger(__name__)

_libc_calls: Any = None  # (mmap, munmap) from the C library; False where they cannot be had


def _libc() -> Any:
    global _libc_calls
    if _libc_calls is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            c_mmap, c_munmap = libc.mmap, libc.munmap
            c_mmap.restype = ctypes.c_void_p
            c_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
            c_munmap.restype = ctypes.c_int
            c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _libc_calls = (c_mmap, c_munmap)
        except (OSError, AttributeError):  # no C library to call: fall back to mmap.mmap
            _libc_calls = False
    return _libc_calls


class MappingHooks(Protocol):
    """What a consumer-side mapping hook implements (see :meth:`WorkerPool.set_mapping_hooks`).

    ``mapping`` is the segment's name, unique among the mappings open in this process; ``address`` and
    ``nbytes`` give the mapped memory, whose address is stable for the mapping's whole lifetime.

    - ``opened`` is called once per mapping, after it is mapped and before any array of it is handed
      out (for mappings already open when the hooks are installed: at installation).
    - ``closing`` is called exactly once for every mapping whose ``opened`` returned, *before* it is
      unmapped, never after: when nothing refers to it any more (the worker retired the slab, the pool
      closed or restarted, a worker died), or when the hooks are replaced or removed. A mapping whose
      arrays you still hold after the pool has closed stays mapped, and gets ``closing``, until they go.

    Both may run on any thread (the last reference to a mapping can be dropped anywhere) and must not
    block for long. A hook that raises is logged once and is not called for new mappings any more; the
    mappings it opened still get their ``closing``. The pipeline goes on either way.
    """

    def opened(self, mapping: str, address: int, nbytes: int) -> None: ...

    def closing(self, mapping: str, address: int, nbytes: int) -> None: ...


class MappingHookSet:
    """The hooks of one pool, and the mappings they were told about. Thread-safe."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._hooks: Any = None
        self._lock = threading.RLock()  # reentrant: a finalizer may run while this thread holds it
        self._live: weakref.WeakValueDictionary[str, SharedMapping] = weakref.WeakValueDictionary()
        self._opened: dict[str, Any] = {}  # mapping name -> the hooks whose opened() returned for it
        self._warned = False

    @property
    def hooks(self) -> Any:
        return self._hooks

    def set(self, hooks: Any) -> None:
        """Install ``hooks`` (``None`` removes them): the old hooks close what they opened, the new ones
        open every mapping still alive."""
        if hooks is not None and not (callable(getattr(hooks, "opened", None))
                                      and callable(getattr(hooks, "closing", None))):
            raise TypeError(f"{self.owner}: mapping hooks need opened(mapping, address, nbytes) and "
                            f"closing(mapping, address, nbytes) methods, got {hooks!r}")
        with self._lock:
            live = [(name, m) for name, m in list(self._live.items())]
            for name, m in live:
                self._close(name, m.address, m.nbytes)
            self._hooks = hooks
            self._warned = False
            for _, m in live:
                self.opened(m)

    def opened(self, m: SharedMapping) -> None:
        with self._lock:
            self._live[m.name] = m
            hooks = self._hooks
            if hooks is None:
                return
            try:
                hooks.opened(m.name, m.address, m.nbytes)
            except Exception:
                self._failed(hooks, "opened", m.name)
                return
            self._opened[m.name] = hooks

    def _close(self, name: str, address: int, nbytes: int) -> None:
        with self._lock:
            hooks = self._opened.pop(name, None)
            if hooks is None:
                return
            try:
                hooks.closing(name, address, nbytes)
            except Exception:
                self._failed(hooks, "closing", name)

    def _failed(self, hooks: Any, what: str, name: str) -> None:
        if hooks is self._hooks:
            self._hooks = None  # no new mappings for it; those it opened still get closing()
        if not self._warned:
            self._warned = True
            # The traceback as text: a record holding the exception would keep the mapping alive.
            log.warning("%s: the mapping hook %r raised in %s(%s); it is not called for new mappings any "
                        "more, and the pipeline goes on without it\n%s", self.owner, hooks, what, name,
                        traceback.format_exc().rstrip())


def _unmap(hookset: MappingHookSet | None, name: str, address: int, nbytes: int, unmap: bool) -> None:
    if hookset is not None:
        hookset._close(name, address, nbytes)  # before the memory goes, never after
    if unmap:
        _libc()[1](address, nbytes)


class SharedMapping:
    """``nbytes`` of a shared-memory file mapped read-write at ``address``, with no descriptor kept.

    Unmapped when the last reference to it, or to an array made by :meth:`array`, is gone.
    """

    __slots__ = ("name", "address", "nbytes", "__array_interface__", "_mm", "__weakref__")

    def __init__(self, name: str, address: int, nbytes: int, mm: mmap.mmap | None = None) -> None:
        self.name, self.address, self.nbytes, self._mm = name, address, nbytes, mm
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}

    def array(self, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """A writable uint8 view of ``nbytes`` from ``offset``; it keeps the mapping alive.

        Each call gives a new base object: views of the result point to the result (numpy collapses view
        chains only down to the first array whose base is not an array), so a weak reference to it tells
        when every view of it is gone.
        """
        count = self.nbytes - offset if nbytes is None else nbytes
        return np.frombuffer(np.asarray(self).data, np.uint8, count=count, offset=offset)


def map_fd(fd: int, nbytes: int, name: str, hooks: MappingHookSet | None = None) -> SharedMapping:
    """Map ``nbytes`` of the open file ``fd`` (shared, read-write); ``fd`` may be closed right after."""
    calls = _libc()
    if calls and nbytes > 0:
        address = calls[0](None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {name}: {os.strerror(err)}")
        m = SharedMapping(name, address, nbytes)
        unmap = True
    else:  # keeps a duplicated descriptor, as mmap.mmap does before Python 3.13
        mm = mmap.mmap(fd, nbytes)
        address = np.frombuffer(mm, np.uint8).__array_interface__["data"][0] if nbytes else 0
        m = SharedMapping(name, address, nbytes, mm)
        unmap = False
    finalizer = weakref.finalize(m, _unmap, hooks, name, address, nbytes, unmap)
    finalizer.atexit = False  # at exit the process unmaps everything; arrays may outlive the finalizers
    if hooks is not None:
        hooks.opened(m)
    return m
