"""What every LMDB reader of this package shares: one pinned open of the file, one environment per file
per process, the page check before mapping, and release on ``close()`` or garbage collection.

LMDB allows one environment per file per process, so readers of one file share it, counted, keyed by
the file's ``(device, inode)``: a file renamed over the path is another key, never the old handle. The
environment is opened through the pinned descriptor (:mod:`bridgeflow.serialize._pinned`), never by the
path again, so a reader reads the file it opened for its whole life.

Example:
    >>> class MyReader(PinnedLMDB):
    ...     def __init__(self, path):
    ...         self._open_pinned(path, verify=None, who="MyReader")
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from .._deps import require
from ..rng import RNGDataFlow
from ._common import existing_path
from ._lmdb_check import check_lmdb_file
from ._pinned import PinnedFile
from .errors import CorruptDataError

__all__ = ["PinnedLMDB", "acquire_env", "lmdb_error", "release_env"]


def lmdb_error(path: str, exc: Exception, doing: str, written_by: str = "LMDBSerializer") -> CorruptDataError:
    """An ``lmdb.Error`` met while ``doing`` something with ``path``, as a :class:`CorruptDataError`."""
    return CorruptDataError(f"{path}: {doing} failed ({type(exc).__name__}: {exc}); is it a complete "
                            f"LMDB file written by {written_by}?")


def _open_env(pin: PinnedFile, path: str, readahead: bool = False) -> Any:
    """An LMDB environment on the pinned file (opened through its descriptor, never the path again)."""
    lmdb = require("lmdb", "LMDBSerializer")
    try:
        env = lmdb.open(pin.name(), subdir=False, readonly=True, lock=False, readahead=readahead, meminit=False,
                        max_readers=2048)
    except lmdb.Error as exc:
        raise lmdb_error(path, exc, "opening", "LMDB") from exc
    # A truncated file would make LMDB touch pages past its end (SIGBUS): check the real size first.
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    have = pin.size()
    if have < need:
        env.close()
        raise CorruptDataError(f"{path}: truncated LMDB file ({have} bytes, its pages need {need})")
    return env


_envs: dict[tuple[int, int], list] = {}  # (dev, inode) -> [env, users]
_envs_pid = os.getpid()
_envs_lock = threading.Lock()


def acquire_env(pin: PinnedFile, path: str, readahead: bool) -> Any:
    """This process's shared environment on the pinned file (opened on first use); pair with
    :func:`release_env`."""
    global _envs_pid
    with _envs_lock:
        if _envs_pid != os.getpid():
            # Handles inherited through fork must not be used; closing them is safe here because they
            # are read-only and lock-free (no reader slot to release): it only unmaps this process's
            # copy, and lets py-lmdb open the file again.
            for env, _users in _envs.values():
                env.close()
            _envs.clear()
            _envs_pid = os.getpid()
        pin.ensure()
        entry = _envs.get(pin.ident)  # type: ignore[arg-type]
        if entry is None:
            entry = _envs[pin.ident] = [_open_env(pin, path, readahead), 0]  # type: ignore[index]
        entry[1] += 1
        return entry[0]


def release_env(key: Any, env: Any) -> None:
    """Give back one use of ``env``; the last user closes it."""
    with _envs_lock:
        entry = _envs.get(key)
        if _envs_pid != os.getpid() or entry is None or entry[0] is not env:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _envs[key]
            env.close()


class Held:
    """What one reader holds in one process: its pinned file and its share of the environment. Released
    by ``close()`` or, for a reader dropped without it, by a finalizer (it holds no reference to the
    reader)."""

    __slots__ = ("pin", "env", "pid")

    def __init__(self, pin: PinnedFile) -> None:
        self.pin, self.env, self.pid = pin, None, None

    def environment(self, path: str, readahead: bool) -> Any:
        if self.env is None or self.pid != os.getpid():
            self.env = acquire_env(self.pin, path, readahead)
            self.pid = os.getpid()
        return self.env

    def release(self) -> None:
        env, self.env = self.env, None
        if env is not None and self.pid == os.getpid():
            release_env(self.pin.ident, env)
        self.pin.close()

    def __getstate__(self) -> dict:
        return {"pin": self.pin}

    def __setstate__(self, state: dict) -> None:
        self.pin, self.env, self.pid = state["pin"], None, None


class PinnedLMDB(RNGDataFlow):
    """Base of the LMDB readers: ``path``, the one pinned open of it, the shared environment, ``close()``.

    A subclass calls :meth:`_open_pinned` first in its ``__init__`` (and :meth:`_abandon` if it fails
    after that); :meth:`_environment` gives the environment in the calling process (a process that got
    the reader through ``fork`` opens the same file again through the inherited descriptor; a copy sent
    by pickling re-opens the path and checks it is still the same file).
    """

    path: str
    shuffle: bool = True
    verified: bool = True

    def _open_pinned(self, path: str | os.PathLike, verify: bool | None, who: str) -> None:
        self.path = existing_path(path, who)
        data = os.path.join(self.path, "data.mdb") if os.path.isdir(self.path) else self.path
        self._held = Held(PinnedFile(data, who))  # the one open of the path
        self._finalizer = weakref.finalize(self, self._held.release)  # a reader dropped without close()
        self.verified = verify is not False
        if self.verified:  # every value size now lies inside the file: copying a value cannot fault
            try:
                check_lmdb_file(self._held.pin, self.path)
            except BaseException:
                self._held.release()
                raise

    def _abandon(self) -> None:
        """Release what the constructor opened (it failed after :meth:`_open_pinned`)."""
        self._held.release()

    def _environment(self) -> Any:
        return self._held.environment(self.path, not self.shuffle)

    def _on_reset(self) -> None:
        super()._on_reset()
        self._environment()

    def _check_size(self, env: Any) -> None:
        """The pinned file still holds every page the map will touch: a file cut short in place (not
        replaced) since it was opened would otherwise crash this process with SIGBUS."""
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        have = self._held.pin.size()
        if have < need:
            raise CorruptDataError(f"{self.path}: the file was cut to {have} bytes while open (its pages need "
                                   f"{need}); it is no longer readable")

    def close(self) -> None:
        self._held.release()
        super().close()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_finalizer", None)  # the copy's handles are opened, and released, in its own process
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._finalizer = weakref.finalize(self, self._held.release)
