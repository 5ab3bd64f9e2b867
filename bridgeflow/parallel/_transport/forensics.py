"""Hang forensics: where is a worker that returns nothing, and in what state is it?

A process worker installs :mod:`faulthandler` on ``SIGUSR1`` (:func:`install_stack_dumps`), writing to
a pipe whose other end the consumer holds, then writes one byte there (:data:`READY`) to say it can
answer. When the consumer has waited ``stall_warning`` seconds for a result, :func:`describe_worker`
signals the worker that holds the oldest task and reads its Python stack back, but only once the worker
said it is ready (:class:`DumpPipe`): SIGUSR1 kills a process without a handler, and a ``spawn`` or
``forkserver`` worker spends its first seconds (minutes, with heavy imports on a busy machine) importing
the main module before any of bridgeflow's code runs in it; such a worker is reported as starting, with
how long it has been starting (a thread worker's comes from ``sys._current_frames()``), together with its state from
``/proc/PID/stat``: a stopped process (SIGSTOP, a debugger) or one in uninterruptible sleep (a stuck disk
or NFS read) cannot dump its stack, and the state says so instead. ``SIGUSR1`` is the workers' for
this: a map function that installs its own handler for it takes the request instead (and no stack
comes back).
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import sys
import threading
import time
from typing import Any

__all__ = [
    "DUMP_SIGNAL", "READY", "DumpPipe", "Wait", "check_seconds", "describe_thread", "describe_worker", "innermost",
    "install_stack_dumps", "process_state", "stall_text",
]

DUMP_SIGNAL = signal.SIGUSR1
READY = b"\x06"  # the first byte on a dump pipe: the worker's handler is installed

_STATES = {
    "R": "running", "S": "sleeping", "D": "in uninterruptible sleep (D: a stuck disk or network file system read?)",
    "T": "stopped (SIGSTOP?)", "t": "stopped by a debugger", "Z": "a zombie (it has exited)", "X": "dead",
    "I": "idle",
}


def install_stack_dumps(fd: int) -> None:
    """In a worker process: dump every thread's Python stack to ``fd`` on :data:`DUMP_SIGNAL`.

    The descriptor is made non-blocking, so a consumer that stops reading can never block the worker
    inside the signal handler (the rest of that dump is lost instead).
    """
    os.set_blocking(fd, False)
    faulthandler.register(DUMP_SIGNAL, file=fd, all_threads=True, chain=False)
    os.write(fd, READY)  # only now may the consumer signal this process


class DumpPipe:
    """The consumer's end of one worker's dump pipe: whether the worker is ready to be asked for its
    stack (its first byte arrived), and since when it has been starting."""

    __slots__ = ("fd", "started", "ready")

    def __init__(self, fd: int) -> None:
        self.fd, self.started, self.ready = fd, time.monotonic(), False

    def is_ready(self) -> bool:
        if not self.ready and select.select([self.fd], [], [], 0)[0]:
            try:
                self.ready = os.read(self.fd, 1) == READY  # b"": the worker died before it was ready
            except BlockingIOError:
                pass
        return self.ready

    def starting(self) -> str:
        """The state of a worker not yet ready, in words."""
        return (f"starting (for {time.monotonic() - self.started:.0f} s: not yet running bridgeflow's worker code; a "
                "'spawn' or 'forkserver' worker first imports your main module and what it imports)")


def process_state(pid: int) -> str:
    """The state of process ``pid`` in words (``"sleeping"``, ``"stopped (SIGSTOP?)"``...), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return _STATES.get(code, f"in state {code}")


def _drain(fd: int) -> None:
    while select.select([fd], [], [], 0)[0]:
        try:
            if not os.read(fd, 65536):
                return
        except BlockingIOError:
            return


def _read_dump(fd: int, wait: float) -> str:
    """What arrives on ``fd`` until it has been quiet for 0.1 s after some data, or ``wait`` s pass."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = select.select([fd], [], [], min(left, 0.1) if chunks else left)[0]
        if not ready:
            if chunks:
                break
            continue
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode("utf-8", "replace")


def _worker_thread(dump: str) -> str:
    """Of a faulthandler dump of every thread, the block of the thread that runs tasks (in worker_loop)."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) or not blocks:
            blocks.append([])
        if line.strip():
            blocks[-1].append(line)
    for block in blocks:
        if any(" in worker_loop" in line for line in block):
            return _down_to_worker_loop(block)
    return dump.strip()


def _down_to_worker_loop(lines: list[str]) -> str:
    """The frames of a stack (most recent call first) down to the worker loop: the rest is start-up."""
    for i, line in enumerate(lines):
        if line.endswith(" in worker_loop"):
            return "\n".join(lines[:i + 1])
    return "\n".join(lines)


def innermost(stack: str) -> str:
    """The innermost frame of a stack printed most recent call first: ``"fn (file.py, line 3)"``."""
    for line in stack.splitlines():
        line = line.strip()
        if line.startswith('File "') and " in " in line:
            where, _, fn = line[5:].rpartition(" in ")
            return f"{fn} ({where})"
    return ""


def describe_worker(pid: int, dump: DumpPipe | None, wait: float = 1.0) -> tuple[str, str]:
    """``(state, stack)`` of worker process ``pid``: its state in words, and the Python stack of its task
    thread (most recent call first), or ``""`` when it cannot dump one (stopped, not ready yet, or no
    answer in ``wait`` s). A worker is signalled only once ``dump`` says it is ready (never with
    ``wait=0``)."""
    state = process_state(pid)
    if dump is None or state.startswith(("stopped", "in uninterruptible", "a zombie", "dead", "gone")):
        return state, ""  # what the kernel says comes first: a worker stopped while starting is stopped
    if not dump.is_ready():
        return dump.starting(), ""
    if wait <= 0:
        return state, ""
    dump_fd = dump.fd
    _drain(dump_fd)  # the tail of an earlier dump that came too late
    try:
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return process_state(pid), ""
    return state, _worker_thread(_read_dump(dump_fd, wait))


def describe_thread(thread: threading.Thread) -> str:
    """The Python stack of a live thread, most recent call first, in faulthandler's format."""
    frame: Any = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    lines = [f"Thread {thread.name} (most recent call first):"]
    while frame is not None:
        code = frame.f_code
        lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
        frame = frame.f_back
    return _down_to_worker_loop(lines) if len(lines) > 1 else ""


def stall_text(stage: str, waited: float, worker: int, pid: int | None, task: int, state: str, stack: str) -> str:
    """The stall warning: who holds the oldest task, in what state, and where it is."""
    if stack:
        how = f"Its stack, most recent call first:\n{stack}"
    elif state.startswith(("stopped", "in uninterruptible")):
        how = "A process in this state cannot dump its stack."
    else:
        how = f"It did not answer the request for its stack ({DUMP_SIGNAL.name})."
    who = f"worker {worker}" + (f" (pid {pid})" if pid is not None else " (a thread)")
    return f"{stage}: no result for {waited:.0f} s: {who} holds the oldest task (#{task}) and is {state}. {how}"


class Wait:
    """One ``get()``'s wait: when it started, its time limit and when to report a stall next."""

    __slots__ = ("started", "limit", "stall_at")

    def __init__(self, started: float, limit: float | None, stall_warning: float | None) -> None:
        self.started, self.limit = started, limit
        self.stall_at = None if stall_warning is None else started + stall_warning


def check_seconds(value: Any, what: str, who: str) -> float | None:
    """A positive number of seconds, or ``None`` for never (``0`` too, as torch's ``timeout=0``)."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{who}: {what} must be a positive number of seconds or None, got {value!r}")
    return float(value)
