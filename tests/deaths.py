"""Worker deaths on purpose, with bounds that hold even when the code under test is wrong.

A test of supervised restarts kills the workers it runs (SIGKILL, a ctypes segfault). Should the pool restart
without end (a budget not honoured, a poison sample run again for ever), such a test would make processes as
fast as the machine forks them. So every death here goes through :func:`die`, which counts the deaths in a
file and, past ``limit``, raises instead of dying: a runaway becomes a test failure after a few processes.
A killer running beside the pool (a thread, the fuzz script) signals only :func:`kill_child`: a process of its
own that it holds by a pidfd, never a pid that a reaped worker left free for another process on the machine.
"""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import os
import signal

__all__ = ["DEATHS_LIMIT", "die", "kill_child", "once"]

DEATHS_LIMIT = 12  # deaths per tally file: several times what any test here makes


def once(flag: str) -> bool:
    """True the first time it is asked for ``flag`` (a file), in any process."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def die(how: str, tally: str, limit: int = DEATHS_LIMIT) -> None:
    """End this process by ``how`` ("kill": SIGKILL, "segv": a segfault through ctypes), the ``limit``-th
    death counted in the file ``tally`` at most; past it, raise a RuntimeError instead."""
    fd = os.open(tally, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, b".")  # one byte a death: appends are atomic, the size counts them across processes
        count = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if count > limit:
        raise RuntimeError(f"{count} deaths counted in {tally}, over this test's bound of {limit}: the pool is "
                           "restarting workers without end")
    if how == "segv":
        faulthandler.disable()  # a crash report on stderr is noise here
        ctypes.string_at(0)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_child(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to ``pid`` if it is a live child of this process (False otherwise). The process is held by
    a pidfd before its parent is checked, so a pid freed and taken by another process is never signalled."""
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return False
        raise
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] == "Z" or int(fields[1]) != os.getpid():
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except (OSError, ProcessLookupError):
        return False
    finally:
        os.close(fd)
