"""What runs in a worker, thread or process: the task loop, the process entry point, errors as data.

Both kinds of worker run :func:`worker_loop`; only its ``recv``/``send`` channels differ. A thread's are
queues; a process's are two pipes plus :mod:`~bridgeflow.parallel._transport.shm` (array bytes in shared
memory),
wired up by :func:`process_main`. Everything here runs on the worker's side; the consumer's side is
:class:`~bridgeflow.parallel.WorkerPool` and its channels
(:mod:`~bridgeflow.parallel._transport.channels`), which
send tasks and turn the messages back into results. The messages are :mod:`bridgeflow.parallel._transport.wire`'s.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

# numpy loads numpy.random on first use (numpy.__getattr__), and workers seed it first thing (the torch
# adapter's seeding, RNG flows, map functions that draw numbers). A forked worker that imports it while
# another thread of its parent held that module's import lock at the fork waits for the lock forever (the
# thread is not in the child), so it is imported here, before any pool exists.
import numpy.random  # noqa: F401

from ..._errors import BridgeflowError
from . import forensics, shm
from .wire import (
    COMPLETED_AT,
    ERROR,
    FATAL,
    INIT,
    LIVENESS_INTERVAL,
    MARK_AT,
    MAX_SLABS,
    OK,
    RAN_OUT,
    STOP,
    Retry,
    ctl_base,
)

__all__ = [
    "EXHAUSTED", "RemoteError", "RemoteTraceback", "WorkerContext", "pack_exception", "process_main",
    "unpack_exception", "worker_loop",
]


class _Exhausted:
    def __repr__(self) -> str:
        return "EXHAUSTED"

    def __reduce__(self) -> str:
        return "EXHAUSTED"


EXHAUSTED = _Exhausted()
"""The result of a task whose function raised ``StopIteration`` (a worker's own source has run out)."""


@dataclass(frozen=True)
class WorkerContext:
    """What a worker knows about itself; passed to ``init_fn``."""

    worker_id: int
    num_workers: int
    seed: int
    stage: str
    writer: shm.SlabWriter | None = field(default=None, compare=False, repr=False)
    """The result writer of a process worker (``None`` in threads). ``writer.reserve(n)`` then
    ``writer.alloc(shape, dtype)`` builds arrays of the next result directly in shared memory."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback; set as ``__cause__`` of the re-raised exception."""

    def __str__(self) -> str:
        return "\n\nTraceback in the worker:\n" + str(self.args[0])


class RemoteError(BridgeflowError, RuntimeError):
    """A worker raised an exception that could not be sent back as itself (not picklable)."""


def pack_exception(exc: BaseException, by_pickle: bool) -> tuple:
    """``(exception or None, type name, message, formatted traceback)`` ready to send to the consumer.

    The exception itself travels only when it is an ``Exception`` and (with ``by_pickle``) survives a pickle
    round trip; otherwise its name and message go as text. Shared with the Ray executor.
    """
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if not isinstance(exc, Exception):  # SystemExit, KeyboardInterrupt...: never re-raised as themselves
        return None, type(exc).__name__, f"the worker's function raised {type(exc).__name__}{exc.args!r}", tb
    if by_pickle:
        try:
            pickle.loads(pickle.dumps(exc, protocol=5))
        except Exception:
            return None, type(exc).__name__, str(exc), tb
    return exc, type(exc).__name__, str(exc), tb


def unpack_exception(packed: tuple, where: str) -> BaseException:
    """The exception to raise in the consumer for ``pack_exception``'s tuple, with the worker traceback."""
    exc, type_name, message, tb = packed
    if exc is None:
        exc = RemoteError(f"{type_name} in {where}: {message}")
    exc.__cause__ = RemoteTraceback(tb)
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised in {where})")
    return exc


_forks = 0  # forks this process came out of since forks were first counted in its line (see _count_forks)
_counting = False


def _forked() -> None:
    global _forks
    _forks += 1


def _count_forks() -> None:
    """Count forks from now on (registered once, inherited by children): a child forked by a task function
    then finds ``_forks`` changed, a global read per task (``os.getpid()`` is a system call)."""
    global _counting
    if not _counting:
        os.register_at_fork(after_in_child=_forked)
        _counting = True


def _leave_forked_child(exc: BaseException | None) -> NoReturn:
    """A task function forked, and the child came back into the worker loop: raising (``sys.exit(0)``, as
    code written for a main process ends a child) or returning. The child is not the worker: it leaves
    at once, as it would have left a main program, and never touches the pool's pipes (its message
    would pass for the worker's, and it would then wait for tasks forever, holding its parent's stdout)."""
    code = 0
    if isinstance(exc, SystemExit):
        if isinstance(exc.code, int):
            code = exc.code & 0xFF
        elif exc.code is not None:
            print(exc.code, file=sys.stderr)
            code = 1
    elif exc is not None:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to say
            pass
    os._exit(code)


def worker_loop(ctx: WorkerContext, init_fn: Callable, recv: Callable[[], Any],
                send: Callable[[list, float], None], by_pickle: bool,
                mark: Callable[[int, int], None] | None = None) -> None:
    """The loop every worker runs, thread or process: init, then answer tasks until told to stop.

    ``recv()`` returns a chunk, a list of ``(task_id, payload)``, or ``None`` to stop. The results of a
    chunk go back together, ``send([(kind, task_id, value), ...], busy)``: one message per chunk is what
    makes small tasks cheap. ``busy`` is the seconds spent in the task function so far (the stages'
    ``workers_busy``). A :class:`~bridgeflow.parallel._transport.wire.Retry` instead of a chunk is a dead
    worker's task, run with ``mark(task_id, item)`` called as each of its items starts.

    A child forked by the task function (or ``init_fn``) that comes back here (``sys.exit`` in it raises,
    or it returns) leaves with ``os._exit`` at once (:func:`_leave_forked_child`): its end is its own business, not the
    worker's error.
    """
    _count_forks()
    me, born = os.getpid(), _forks
    try:
        task_fn = init_fn(ctx)
    except BaseException as exc:  # reported to the consumer, which raises it
        if _forks != born or os.getpid() != me:  # ... unless raised in a child init_fn forked
            _leave_forked_child(exc)
        try:
            send([(ERROR, INIT, pack_exception(exc, by_pickle))], 0.0)
        except (BrokenPipeError, EOFError, ConnectionError):
            return  # the consumer is gone
        while recv() is not None:  # stay until told to stop, so tasks sent meanwhile find us alive
            pass
        return
    if _forks != born:  # a child init_fn forked, returning
        _leave_forked_child(None)
    busy = 0.0
    clock = time.perf_counter
    while True:
        chunk = recv()
        if chunk is None:
            return
        out = []
        t0 = clock()
        run = task_fn
        if type(chunk) is Retry:  # a dead worker's task, alone: its items are marked as they start
            run = _retried(task_fn, chunk, mark)
            chunk = [(chunk.task_id, chunk.payload)]
        for task_id, payload in chunk:
            try:
                out.append((OK, task_id, run(payload)))
            except StopIteration:
                out.append((RAN_OUT, task_id, None))
            except BaseException as exc:  # any failure, even SystemExit, goes to the consumer
                if _forks != born or os.getpid() != me:  # ... unless raised in a child the task forked
                    _leave_forked_child(exc)
                out.append((ERROR, task_id, pack_exception(exc, by_pickle)))
            if _forks != born:  # a child the task forked, returning
                _leave_forked_child(None)
        busy += clock() - t0
        try:
            send(out, busy)
        except (BrokenPipeError, EOFError, ConnectionError):
            return  # the consumer is gone
        except Exception as exc:  # a result cannot be sent, e.g. not picklable: say which
            send(_unsent(task_fn, chunk, out, exc, by_pickle), busy)


def _retried(task_fn: Callable, retry: Retry, mark: Callable[[int, int], None] | None) -> Callable[[Any], Any]:
    """The task function for a retried task: ``task_fn.careful(payload, mark, avoid)`` when it has that method
    (it marks each item of a group as it starts, and leaves out those in ``avoid``), else ``task_fn`` with
    the task marked as item -1 (the task is its own item)."""
    task_id = retry.task_id

    def marks(item: int) -> None:
        if mark is not None:
            mark(task_id, item)

    careful = getattr(task_fn, "careful", None)
    if careful is not None:
        return lambda payload: careful(payload, marks, retry.avoid)

    def plain(payload: Any) -> Any:
        marks(-1)
        return task_fn(payload)

    return plain


def _unsent(task_fn: Callable, chunk: list, out: list, exc: Exception, by_pickle: bool) -> list:
    """The error results of a chunk whose results could not be sent (``exc``). A task function with an
    ``explain_unsendable(payload, result, exc)`` method names what could not be sent in each result (it
    returns an exception, or None when it finds nothing): the check is made only once sending failed."""
    explain = getattr(task_fn, "explain_unsendable", None)
    errors = []
    for (task_id, payload), (kind, _, value) in zip(chunk, out):
        err = None
        if kind == OK and callable(explain):
            try:
                err = explain(payload, value, exc)
            except Exception:  # the diagnosis failed: the plain error below still says what happened
                err = None
        if err is None:
            err = TypeError(f"a result cannot be sent to the consumer: {exc!r}")
        errors.append((ERROR, task_id, pack_exception(err, by_pickle)))
    return errors


# --- process workers ------------------------------------------------------------------------------


def _parent_alive(ppid: int, consumer_pid: int) -> bool:
    if os.getppid() != ppid:
        return False
    try:
        os.kill(consumer_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _watch_parent(ppid: int, consumer_pid: int, on_orphan: Callable[[], None]) -> None:
    """Exit the worker (even one stuck in a task) once the consumer is gone, cleaning up for it."""
    while True:
        time.sleep(LIVENESS_INTERVAL)
        if not _parent_alive(ppid, consumer_pid):
            on_orphan()
            os._exit(0)


def _pump_tasks(conn: Any, inbox: queue.SimpleQueue, stop_requested: threading.Event) -> None:
    """Move task messages from the pipe to ``inbox`` as they arrive; ``None`` once the pipe closes.

    The consumer sends tasks without reading results in between, and a worker sends a chunk's results
    before it reads the next chunk. Were the worker to read its pipe only between chunks, a worker blocked
    writing results that fill its result pipe and a consumer blocked writing tasks that fill the task pipe
    would wait for each other forever. This thread keeps the task pipe drained instead (the consumer
    bounds the tasks in flight, so ``inbox`` stays bounded too).
    """
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            inbox.put(None)
            return
        if data == STOP:
            stop_requested.set()
            inbox.put(None)  # wakes the main thread if it waits for a task
            return
        inbox.put(data)


def _lead_own_group() -> bool:
    """Make this worker the leader of a process group of its own, which every process it starts joins
    unless it leaves on purpose (``setsid``): the consumer ends that group when it closes the pool
    (:func:`~bridgeflow.parallel._transport.channels.end_groups`), and so does the worker when its
    consumer is gone. Whether it leads one."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    return os.getpgid(0) == os.getpid()


# glibc's malloc gives freed memory back to the system once more than M_TRIM_THRESHOLD of it lies at the top of
# the heap, and serves blocks larger than M_MMAP_THRESHOLD from mappings of their own. Both start at 128 KiB
# and rise only as large blocks are freed, so a fresh worker whose samples are freed a batch at a time (64
# values of 150 KB, read or decoded into memory of their own) gives the batch's memory back and faults every
# page of it in again for the next batch: 37 page faults a sample, half a worker's CPU over an LMDB dataset
# of 150 KB arrays. A worker starts where a process that has run a while ends up: blocks up to 32 MiB from
# the heap, up to 64 MiB of freed memory kept for reuse. mallopt's parameter numbers (malloc.h):
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mapping thresholds in this (worker) process (see above); False where the
    C library is not glibc or the user set malloc's thresholds in the environment (theirs stand)."""
    if any(k in os.environ for k in _MALLOC_ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    import ctypes

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):  # type: ignore[union-attr]
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):  # no such name here (not glibc)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 64 << 20))


def process_main(ctx: WorkerContext, init_fn: Callable, task_conn: Any, result_conn: Any, ctl_name: str,
                 prefix: str, consumer_pid: int, dump_conn: Any = None) -> None:
    leader = _lead_own_group()  # first: before anything the task function starts
    keep_freed_memory()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the consumer's to handle; it stops us
    shm.forget_inherited_controls()  # a forked worker holds no other pool's lock, nor its consumer's copy
    if dump_conn is not None:  # the consumer asks for our stack with a signal when we seem stuck
        forensics.install_stack_dumps(dump_conn.fileno())
    try:
        ctl = shm.ControlSegment.open(ctl_name) if ctl_name else None
    except FileNotFoundError:
        err = shm.SegmentVanishedError(f"the control segment {shm.SHM_DIR}/{ctl_name} of this pool vanished "
                                       "before the worker started: another process removed it")
        try:
            result_conn.send_bytes(shm.SlabWriter("", None, 0).dumps([(ERROR, FATAL, pack_exception(err, True))]))
        except OSError:  # the consumer closed the pool while this (spawned, slow) worker was starting
            pass
        return
    base = ctl_base(ctx.worker_id)
    view = ctl.view if ctl is not None else None
    writer = shm.SlabWriter(f"{prefix}r{ctx.worker_id}_", view[base:base + MAX_SLABS] if view else None,
                            MAX_SLABS, ctx.num_workers)
    reader = shm.SlabReader(view[base + MAX_SLABS:base + 2 * MAX_SLABS] if view else None)
    ctx = replace(ctx, writer=writer)

    def on_orphan() -> None:
        """The consumer is gone and cannot clean up: remove the whole pool's segments, and end this worker's
        process group (the processes its tasks started, and this worker with them)."""
        writer.close()
        shm.sweep_segments(prefix)
        if leader:
            os.killpg(os.getpid(), signal.SIGKILL)

    ppid = os.getppid()
    threading.Thread(target=_watch_parent, args=(ppid, consumer_pid, on_orphan),
                     name="bridgeflow-parent-watch", daemon=True).start()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    stop_requested = threading.Event()
    threading.Thread(target=_pump_tasks, args=(task_conn, inbox, stop_requested),
                     name="bridgeflow-task-pump", daemon=True).start()
    # A restarted worker goes on with the counters of the one it replaces (the pool's statistics add them up)
    completed, busy_before = struct.unpack_from("<QQ", view, base + COMPLETED_AT) if view is not None else (0, 0)
    stopped = False  # the consumer said stop; otherwise the task pipe closed because the consumer is dying

    def recv() -> Any:
        nonlocal stopped
        data = None if stop_requested.is_set() else inbox.get()
        if stop_requested.is_set():  # tasks still queued behind the stop are dropped
            stopped = True
            return None
        if data is None:  # the pipe closed without a stop
            return None
        try:
            tasks = reader.loads(data)
        except shm.SegmentVanishedError as exc:  # the tasks cannot be read: say why, and stop
            send([(ERROR, FATAL, pack_exception(exc, True))], 0.0)
            stopped = True  # the consumer is alive and cleans up: do not sweep its other workers' memory
            return None
        if view is not None and type(tasks) is list:  # the chunk starting: a death from now on is its (-2: no
            struct.pack_into("<qq", view, base + MARK_AT, tasks[0][0] + 1, -2)  # item marked)
        return tasks

    def send(msg: list, busy: float) -> None:
        nonlocal completed
        result_conn.send_bytes(writer.dumps(msg))
        completed += len(msg)
        if view is not None:
            struct.pack_into("<QQ", view, base + COMPLETED_AT, completed, busy_before + int(busy * 1e9))

    def mark(task_id: int, item: int) -> None:  # which item of a retried task is starting
        if view is not None:
            struct.pack_into("<qq", view, base + MARK_AT, task_id + 1, item)

    def on_sigterm(signum: int, frame: Any) -> None:
        # The pool's own terminate() comes after a stop, and the pool then sweeps. Any other SIGTERM may
        # have gone to the consumer as well (Slurm's job step, a `kill` of several pids): the consumer is
        # then dying too, without cleaning up, so give it a moment to go and clean up for it. A consumer
        # still alive may yet read our last results: it reports our death and sweeps when it closes the pool.
        if not stop_requested.is_set():
            deadline = time.monotonic() + 2 * LIVENESS_INTERVAL
            while _parent_alive(ppid, consumer_pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if not _parent_alive(ppid, consumer_pid):
                on_orphan()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # die of SIGTERM, so the consumer reports the real cause

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        worker_loop(ctx, init_fn, recv, send, by_pickle=True, mark=mark)
    finally:
        writer.close()
        # A consumer that closes the pool always says stop first. Without it, the consumer is dying: its
        # pipes close before the kernel reparents us, so _parent_alive can still say yes at this point.
        if not stopped or not _parent_alive(ppid, consumer_pid):
            shm.sweep_segments(prefix)
