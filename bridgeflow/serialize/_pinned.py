"""One file per reader: a descriptor held on the file a reader opened, for as long as it reads.

``save(overwrite=True)`` renames a new file over the path while readers may still be reading the old
one. A reader that opened the path twice (once for its length, once for its data), or re-opened it
later, would mix the two versions: a prefix of the old, or false damage. So a reader opens the path
once, here, and everything it reads goes through that one open file: its size comes from ``fstat`` of
the descriptor, and libraries that open files by name (LMDB) are handed ``/proc/self/fd/N``, which opens
the very same file whatever now lies at the path, or read it through a file object made of positioned
reads on the descriptor (h5py's ``fileobj`` driver: libhdf5 resolves ``/proc/self/fd/N`` to a path, which
fails once the file was replaced).

Only a regular file is opened: the path is opened without waiting (``O_NONBLOCK``, so a FIFO does not
block the open until a writer comes) and what was opened is checked with ``fstat`` of that descriptor (no
swap between a check and the open can slip a FIFO, a device or a folder in): anything else is
:class:`CorruptDataError` at once, never a read that waits forever (a FIFO) or without end
(``/dev/zero``).

A process started by ``fork`` inherits the descriptor and keeps reading the same file. A reader sent to
another process by pickling (``spawn``), or used again after ``close()``, opens the path again and
checks it is still the same file (device and inode); if it was replaced meanwhile,
:class:`DatasetChangedError` says so instead of reading a file of another length.

Example:
    >>> with open("data.bin", "wb") as f:
    ...     _ = f.write(b"first")
    >>> pin = PinnedFile("data.bin")
    >>> with open("new.bin", "wb") as f:
    ...     _ = f.write(b"second")
    >>> os.replace("new.bin", "data.bin")  # the path now names another file
    >>> with open(pin.name(), "rb") as f:  # /proc/self/fd/N: the file as it was opened
    ...     f.read()
    b'first'
    >>> pin.close()
"""

from __future__ import annotations

import io
import os
import stat
from typing import Any

from .._serialize_errors import CorruptDataError, DatasetChangedError, DatasetNotFoundError

__all__ = ["PinnedFile", "PinnedReader", "not_a_file"]

_FD_DIRS = ("/proc/self/fd", "/dev/fd")


def _fd_dir() -> str | None:
    for d in _FD_DIRS:
        if os.path.isdir(d):
            return d
    return None


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_file(path: str, what: str, mode: int) -> CorruptDataError | None:
    """The error for a dataset path that is not a regular file (``mode`` from ``fstat``), or ``None``."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), f"not a regular file (mode {oct(mode)})")
    return CorruptDataError(f"{what}: {path} is {kind}, not a regular file: a dataset is read at random "
                            "places and more than once, so only a file is opened (copy the data to one)")


_pid = os.getpid()  # this process's, kept by a fork hook: ensure() runs for every read, os.getpid() is a system call


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


class PinnedFile:
    """A read-only descriptor on ``path`` as it was when opened; see the module doc."""

    __slots__ = ("path", "what", "fd", "ident", "pid")

    def __init__(self, path: str, what: str = "dataset") -> None:
        self.path = path
        self.what = what
        self.fd: int | None = None
        self.pid: int | None = None
        self.ident: tuple[int, int] | None = None
        self._open()

    def _open(self) -> None:
        try:  # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below)
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            if self.ident is None:
                raise DatasetNotFoundError(f"{self.what}: no such file: {self.path}") from None
            raise DatasetChangedError(f"{self.path} was removed after this reader opened it; load it "
                                      "again") from None
        except OSError as exc:  # a socket cannot be opened at all (ENXIO): say what it is
            try:
                refused = not_a_file(self.path, self.what, os.stat(self.path).st_mode)
            except OSError:
                refused = None
            if refused is None:
                raise
            raise refused from exc
        st = os.fstat(fd)
        refused = not_a_file(self.path, self.what, st.st_mode)
        if refused is not None:
            os.close(fd)
            raise refused
        os.set_blocking(fd, True)
        ident = (st.st_dev, st.st_ino)
        if self.ident is not None and ident != self.ident:
            os.close(fd)
            raise DatasetChangedError(f"{self.path} was replaced after this reader opened it (another file "
                                      "now lies at that path); load it again to read the new one")
        self.fd, self.ident, self.pid = fd, ident, _pid

    def ensure(self) -> int:
        """The descriptor, valid in this process: inherited through ``fork`` if it still names this file,
        else the path opened again (it must still be the same file)."""
        if self.fd is not None and self.pid == _pid:
            return self.fd
        if self.fd is not None:  # inherited through fork: same descriptor table entry, same file
            try:
                st = os.fstat(self.fd)
                if (st.st_dev, st.st_ino) == self.ident:
                    self.pid = _pid
                    return self.fd
            except OSError:
                pass
            self.fd = None  # not ours to close: it names something else in this process
        self._open()
        return self.fd  # type: ignore[return-value]  # _open() set it (or raised)

    def size(self) -> int:
        """The file's real size now (``fstat`` of the descriptor, never a new look at the path)."""
        return os.fstat(self.ensure()).st_size

    def stat(self) -> os.stat_result:
        return os.fstat(self.ensure())

    def name(self) -> str:
        """A name that opens this very file, for libraries that open files by name."""
        fd = self.ensure()
        d = _fd_dir()
        if d is not None:
            return f"{d}/{fd}"
        st = os.stat(self.path)  # no descriptor directory: the path, if it still is this file
        if (st.st_dev, st.st_ino) != self.ident:
            raise DatasetChangedError(f"{self.path} was replaced after this reader opened it; load it again")
        return self.path

    def pread(self, n: int, offset: int) -> bytes:
        return os.pread(self.ensure(), n, offset)

    def fileobj(self) -> PinnedReader:
        """A read-only binary file object on this very file, made of positioned reads (no descriptor
        offset is shared with forked processes)."""
        return PinnedReader(self)

    def close(self) -> None:
        """Close the descriptor (in the process that holds it); a later :meth:`ensure` re-opens the path
        and checks it is still the same file."""
        fd, self.fd = self.fd, None
        if fd is not None and self.pid == _pid:
            try:
                os.close(fd)
            except OSError:
                pass

    def __getstate__(self) -> dict[str, Any]:
        # a descriptor number means nothing in another process: the copy re-opens and checks the path
        return {"path": self.path, "what": self.what, "ident": self.ident}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.what, self.ident = state["path"], state["what"], state["ident"]
        self.fd = self.pid = None

    def __repr__(self) -> str:
        return f"PinnedFile({self.path!r}, fd={self.fd})"


class PinnedReader(io.RawIOBase):
    """A read-only, seekable file object over a :class:`PinnedFile`, reading with ``pread``."""

    def __init__(self, pin: PinnedFile) -> None:
        super().__init__()
        self.pin = pin
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self.pos
        elif whence == os.SEEK_END:
            offset += self.pin.size()
        if offset < 0:
            raise OSError(f"negative seek position {offset}")
        self.pos = offset
        return offset

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = os.preadv(self.pin.ensure(), [buffer], self.pos)
        self.pos += n
        return n
