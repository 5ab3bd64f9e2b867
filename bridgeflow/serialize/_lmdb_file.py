"""What every LMDB reader of this package shares: one pinned open of the file, its tree walked once, and
values read with positioned reads, never through a memory map.

A reader opens the path once (:mod:`bridgeflow.serialize._pinned`), so it reads the file it opened for
its whole life, whatever is renamed over the path later. :func:`~bridgeflow.serialize._lmdb_tree.walk_lmdb`
checks the file's pages and finds where every value lies; a value is then one ``pread`` of that range.
Nothing is mapped, so nothing a file can do makes the reader touch memory past its end: a file cut short
in place while it is read (by this process or another) gives a short read, which
:meth:`PinnedLMDB._cut` turns into a :class:`CorruptDataError` naming the file, where a mapped read dies
of SIGBUS. A process that got the reader through ``fork`` reads through the inherited descriptor (no
handle to re-open, nothing that must not cross a fork); a copy sent by pickling opens the path again and
checks it is still the same file.

Example:
    >>> import lmdb
    >>> with lmdb.open("pairs.lmdb", subdir=False) as env, env.begin(write=True) as txn:
    ...     _ = txn.put(b"a", b"123")
    >>> class MyReader(PinnedLMDB):
    ...     def __init__(self, path):
    ...         self._open_pinned(path, "MyReader")
    ...         self.tree = self._walk()
    >>> r = MyReader("pairs.lmdb")
    >>> r.tree.key(0), os.pread(r._fd(), int(r.tree.sizes[0]), int(r.tree.offsets[0]))
    (b'a', b'123')
    >>> r.close()
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from .._rng import RNGDataFlow
from .._serialize_errors import CorruptDataError
from ._common import existing_path
from ._lmdb_tree import LMDBTree, cut_error, walk_lmdb
from ._pinned import PinnedFile

__all__ = ["PinnedLMDB", "check_verify", "new_bytearray", "new_bytearray_function"]


@functools.cache
def new_bytearray_function() -> Callable[[int], bytearray]:
    """:func:`new_bytearray` itself, for a hot loop."""
    try:
        import ctypes

        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
        make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
    except (ImportError, AttributeError):  # not CPython: zero-filled
        return bytearray
    return functools.partial(make, None)


_ZEROED_BELOW = 16384  # bytes: below this, zeroing a bytearray costs less than the ctypes call that skips it


def new_bytearray(n: int) -> bytearray:
    """A ``bytearray`` of ``n`` bytes whose contents are not set (a read fills it): ``bytearray(n)`` zeroes
    them first, which costs as much as a fifth of reading 150 KB from the page cache. Below 16 KiB it is
    ``bytearray(n)`` all the same: the ctypes call costs 2-3 µs, zeroing 300 B a tenth of that."""
    return bytearray(n) if n < _ZEROED_BELOW else new_bytearray_function()(n)


def check_verify(verify: bool | None, who: str) -> None:
    """``verify=`` is accepted for compatibility: reads no longer depend on it (see the module doc)."""
    if verify is not None:
        warnings.warn(f"{who}: verify= is deprecated and does nothing: the file's pages are always checked, and "
                      "reads can no longer crash the process (nothing is memory-mapped)", DeprecationWarning,
                      stacklevel=3)


class PinnedLMDB(RNGDataFlow):
    """Base of the LMDB readers: ``path``, the one pinned open of it, positioned reads, ``close()``.

    A subclass calls :meth:`_open_pinned` first in its ``__init__`` (and :meth:`_abandon` if it fails
    after that); :meth:`_fd` gives the descriptor to ``pread`` in the calling process.
    """

    path: str
    shuffle: bool = True

    def _open_pinned(self, path: str | os.PathLike, who: str) -> None:
        """Open ``path`` (a single-file LMDB or an LMDB folder), once."""
        self.path = existing_path(path, who)
        data = os.path.join(self.path, "data.mdb") if os.path.isdir(self.path) else self.path
        self._pin = PinnedFile(data, who)  # the one open of the path
        self._finalizer = weakref.finalize(self, self._pin.close)  # a reader dropped without close()

    def _walk(self) -> LMDBTree:
        """The file's tree, its pages checked (see :mod:`bridgeflow.serialize._lmdb_tree`)."""
        return walk_lmdb(self._pin, self.path)

    def _abandon(self) -> None:
        """Release what the constructor opened (it failed after :meth:`_open_pinned`)."""
        self._pin.close()

    def _fd(self) -> int:
        """The descriptor to read with, valid in this process (see :meth:`PinnedFile.ensure`)."""
        return self._pin.ensure()

    def _cut(self, offset: int, size: int, what: str) -> CorruptDataError:
        """The error for a read of ``size`` bytes at ``offset`` that came back short."""
        return cut_error(self._pin, self.path, offset, size, what)

    def _on_reset(self) -> None:
        super()._on_reset()
        self._fd()

    def close(self) -> None:
        self._pin.close()
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_finalizer", None)  # the copy's descriptor is opened, and closed, in its own process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._finalizer = weakref.finalize(self, self._pin.close)
