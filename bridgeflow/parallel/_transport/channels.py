"""The two ways a :class:`~bridgeflow.parallel.WorkerPool` reaches its workers: threads or processes.

Both channels run :func:`~bridgeflow.parallel._transport.worker.worker_loop` in every worker and offer the pool one
small interface; the pool keeps the order of results, the chunks, the timeouts, the statistics and the
forensics, and never asks which kind it has:

- ``start(contexts, init_fn)`` starts one worker per context; a process channel's ``restart(ctx, init_fn)``
  replaces a dead worker (see :mod:`bridgeflow.parallel._transport.supervision`), and ``mark(worker)`` says
  which task (and item of it) it was running when it died;
- ``send(worker, chunk)`` sends a chunk of tasks (False: the worker is gone);
- ``receive(wait_for, worker)`` waits up to ``wait_for`` seconds for the next message, from ``worker`` or
  any: ``(worker, results)``, ``(worker, None)`` when that worker died, or ``None``;
- liveness and identity: ``alive()``, ``pids``, ``worker_processes``, ``where(worker)``, ``death(worker)``
  (how it ended, and its exit code), ``inspect(worker, wait)`` (its state and Python stack);
- for statistics: ``unread(received)`` (results finished and not yet received) and ``busy()`` (seconds the
  workers spent in their task function);
- ``shutdown()`` stops the workers and frees what they shared. It is what ``weakref.finalize`` calls when a
  pool is collected without ``close()``, so a channel never refers to its pool;
- ``forked_from``: None, or the pid of the process that owns the workers when this is a forked child's
  copy of the channel, which must not be used (:mod:`bridgeflow.parallel._transport.forking`).

Thread workers share one result queue. Process workers each get a task pipe, a result pipe, a pipe for
their stack dumps and slabs of shared memory for array bytes (:mod:`bridgeflow.parallel._transport.shm`); the consumer
polls the result pipes together with the processes' sentinels, so a worker's death is seen at once.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import queue
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..._errors import BridgeflowError, WorkerError
from . import forensics, forking, shm
from .mapping import MappingHookSet
from .pickling import describe_unpicklable, dumps_as_launched
from .supervision import oom_kills
from .wire import BUSY_AT, COMPLETED_AT, CTL_STRIDE, MARK_AT, MAX_SLABS, STOP, ctl_base
from .worker import WorkerContext, process_main, worker_loop

__all__ = ["ProcessChannel", "ThreadChannel", "end_groups"]

log = logging.getLogger("bridgeflow.parallel._transport.pool")

_pool_ids = itertools.count()


class ThreadChannel:
    """Workers as threads of this process: a task queue each, one result queue for all."""

    processes = False
    sent_bytes = received_bytes = 0  # nothing is copied: the read-ahead budget does not apply

    def __init__(self, name: str, num_workers: int) -> None:
        self.name = name
        self.threads: list[threading.Thread] = []
        self.task_queues: list[queue.SimpleQueue] = []
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = threading.Event()  # stop before the next chunk, not after the backlog
        self._busy = [0.0] * num_workers
        self.forked_from: int | None = None
        self.owner_pid = os.getpid()

    def start(self, contexts: list[WorkerContext], init_fn: Any) -> None:
        forking.track(self)
        results, busy = self.results, self._busy
        for ctx in contexts:
            tasks: queue.SimpleQueue = queue.SimpleQueue()
            self.task_queues.append(tasks)

            def send(msg: list, seconds: float, w: int = ctx.worker_id) -> None:
                busy[w] = seconds
                results.put((w, msg))

            recv = lambda q=tasks, stop=self.stop: None if stop.is_set() else q.get()
            t = threading.Thread(target=worker_loop, args=(ctx, init_fn, recv, send, False),
                                 name=f"{self.name}-worker-{ctx.worker_id}", daemon=True)
            self.threads.append(t)
            t.start()

    def send(self, worker: int, chunk: list) -> bool:
        self.task_queues[worker].put(chunk)
        return True

    def receive(self, wait_for: float, worker: int | None = None) -> tuple[int, list | None] | None:
        try:
            return self.results.get(timeout=wait_for)
        except queue.Empty:
            for w, t in enumerate(self.threads):
                if not t.is_alive():  # what it put before it ended is queued by now: that comes first
                    try:
                        return self.results.get_nowait()
                    except queue.Empty:
                        return w, None
            return None

    def leftover(self, worker: int) -> list | None:
        """Nothing: a thread's task queue never closes, so the pool never asks (see ProcessChannel's)."""
        return None

    def alive(self) -> bool:
        return bool(self.threads) and all(t.is_alive() for t in self.threads)

    @property
    def pids(self) -> list[int]:
        return []

    @property
    def worker_processes(self) -> list:
        return []

    def pid(self, worker: int) -> int | None:
        return None

    def where(self, worker: int) -> str:
        return f"worker {worker} of {self.name}"

    def death(self, worker: int) -> tuple[str, int | None]:
        return f"thread {worker} of {self.name} stopped unexpectedly", None

    def inspect(self, worker: int, wait: float = 1.0) -> tuple[str, str]:
        thread = self.threads[worker]
        return ("running" if thread.is_alive() else "finished"), forensics.describe_thread(thread)

    def unread(self, received: int) -> int:
        return self.results.qsize()

    def busy(self) -> float | None:
        return sum(self._busy)

    def after_fork_in_child(self) -> None:
        self.forked_from = self.owner_pid  # the threads did not come along

    def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.stop.set()
        for q in self.task_queues:
            q.put(None)
        deadline = time.monotonic() + 1.0
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.task_queues, self.threads = [], []


class ProcessChannel:
    """Workers as processes: three pipes each (tasks, results, stack dumps), slabs of shared memory for
    array bytes, and one control segment (:mod:`bridgeflow.parallel._transport.wire`) for the slabs' flags and the
    workers' counters."""

    processes = True

    def __init__(self, name: str, num_workers: int, start_method: str | None, hooks: MappingHookSet) -> None:
        self.name = name
        self.num_workers = num_workers
        self.start_method = start_method
        self.hooks = hooks
        self.procs: list[Any] = []
        self.task_conns: list[Any] = []
        self.result_conns: list[Any] = []
        self.dump_conns: list[Any] = []  # where a worker's stack arrives when asked for
        self.dumps: list[forensics.DumpPipe] = []  # ... and whether it is ready to be asked
        self.readers: list[shm.SlabReader] = []
        self.writers: list[shm.SlabWriter] = []  # the consumer's side of the task slabs
        self.ctl: shm.ControlSegment | None = None
        self.prefix = ""
        self.owner_pid = os.getpid()
        self.forked_from: int | None = None
        self.sent_bytes = 0  # the last message sent occupies (shared memory included)
        self.received_bytes = 0  # ... and the last one received
        self._context: Any = None
        self._ctl_name = ""
        self._oom_kills = oom_kills()  # the cgroup's OOM kills so far: a SIGKILL with one more was the OOM killer

    def start(self, contexts: list[WorkerContext], init_fn: Any) -> None:
        current = mp.current_process()
        if getattr(current, "_inheriting", False):  # multiprocessing's own test for this (spawn's child)
            raise BridgeflowError(
                f"{self.name} was asked to start worker processes while this process is itself starting as a "
                "worker, re-running your main module: put the code that builds and iterates the pipeline under "
                "`if __name__ == \"__main__\":` (the 'spawn' and 'forkserver' start methods import that module "
                "in every worker)")
        if current.daemon:  # multiprocessing forbids it; say where, and what to do instead
            raise BridgeflowError(
                f"{self.name} cannot start worker processes inside {current.name}, itself a worker process: put "
                "the process stage outside the other one, or use threads inside it (MultiThreadMapData)")
        context = mp.get_context(self.start_method)
        if context.get_start_method() != "fork":
            try:
                dumps_as_launched(init_fn)
            except Exception as exc:
                raise TypeError(
                    f"{self.name}: {describe_unpicklable(init_fn)} cannot be pickled, which the "
                    f"{context.get_start_method()!r} start method needs ({exc}); use a module-level function, "
                    "or start_method='fork'") from exc
        self.start_method = context.get_start_method()
        forking.track(self)  # before the first worker forks: the workers forget this pool too
        shm.raise_fd_limit()
        self.prefix = f"bf{os.getpid()}_{next(_pool_ids)}{os.urandom(2).hex()}_"
        ctl_name = ""
        if shm.shm_available():
            if shm.sweep_orphans():
                log.info("%s: removed shared memory left by bridgeflow pools that no longer run", self.name)
            ctl_name = self.prefix + "ctl"
            try:
                self.ctl = shm.ControlSegment.create(ctl_name, CTL_STRIDE * self.num_workers)
            except OSError as exc:
                log.warning("%s: no shared memory (%s); results travel through pipes", self.name, exc)
                ctl_name = ""
        self._context, self._ctl_name = context, ctl_name
        view = self.ctl.view if self.ctl is not None else None
        # Persistent pollers (one per worker, one for all): waiting costs one system call, and a
        # process sentinel in the same poll turns a worker's death into an error at once.
        self._fd_worker: dict[int, tuple[int, bool]] = {}
        self._pollers: list[Any] = []
        self._poll_all = select.poll()
        self._turn = 0  # the worker whose message is read first when several are waiting (then the next)
        for ctx in contexts:
            base = ctl_base(ctx.worker_id)
            self.readers.append(shm.SlabReader(view[base:base + MAX_SLABS] if view else None, self.hooks))
            self.writers.append(shm.SlabWriter(f"{self.prefix}t{ctx.worker_id}_",
                                               view[base + MAX_SLABS:base + 2 * MAX_SLABS] if view else None,
                                               MAX_SLABS, self.num_workers))
            self._start_one(ctx, init_fn)

    def _start_one(self, ctx: WorkerContext, init_fn: Any) -> None:
        """Start worker ``ctx.worker_id``'s process, its pipes and its pollers: the next worker of the pool, or
        in the place of a dead one."""
        w = ctx.worker_id
        task_r, task_w = self._context.Pipe(duplex=False)
        result_r, result_w = self._context.Pipe(duplex=False)
        dump_r, dump_w = self._context.Pipe(duplex=False)
        proc = self._context.Process(
            target=process_main, name=f"{self.name}-worker-{w}",
            args=(ctx, init_fn, task_r, result_w, self._ctl_name, self.prefix, os.getpid(), dump_w), daemon=True)
        try:
            proc.start()
        except Exception:
            for conn in (task_r, task_w, result_r, result_w, dump_r, dump_w):
                conn.close()
            raise
        task_r.close()
        result_w.close()
        dump_w.close()
        poller = select.poll()
        parts = (proc, task_w, result_r, dump_r, forensics.DumpPipe(dump_r.fileno()), poller)
        for lst, part in zip((self.procs, self.task_conns, self.result_conns, self.dump_conns, self.dumps,
                              self._pollers), parts):
            if w < len(lst):
                lst[w] = part
            else:
                lst.append(part)
        for fd, is_conn in ((result_r.fileno(), True), (proc.sentinel, False)):
            poller.register(fd, select.POLLIN)
            self._poll_all.register(fd, select.POLLIN)
            self._fd_worker[fd] = (w, is_conn)

    def restart(self, ctx: WorkerContext, init_fn: Any) -> None:
        """Replace worker ``ctx.worker_id``, which died and whose messages have all been read: its pipes close,
        the processes its tasks started are ended, its result slabs are unlinked (arrays the consumer holds
        keep their mappings until they go; their flags keep the new worker off those slabs), the task slabs
        it held are free, and a new process takes its place with the same id, the counters of the control
        segment going on from the dead one's."""
        w = ctx.worker_id
        old = self.procs[w]
        for fd in (self.result_conns[w].fileno(), old.sentinel):
            self._poll_all.unregister(fd)
            self._fd_worker.pop(fd, None)
        for conn in (self.task_conns[w], self.result_conns[w], self.dump_conns[w]):
            conn.close()
        old.join(0.1)
        end_groups([old])  # what the dead worker's tasks started goes with it (issue 40's orphans)
        if self.prefix:
            shm.sweep_segments(f"{self.prefix}r{w}_")
        self.readers[w].writer_replaced()
        self.writers[w].reader_gone()
        if self.ctl is not None:
            struct.pack_into("<qq", self.ctl.view, ctl_base(w) + MARK_AT, 0, 0)
        self._start_one(ctx, init_fn)

    def mark(self, worker: int) -> tuple[int, int] | None:
        """``(task id, item)`` of the message ``worker`` marked last as starting (see ``wire``), or None."""
        if self.ctl is None:
            return None
        task, item = struct.unpack_from("<qq", self.ctl.view, ctl_base(worker) + MARK_AT)
        return (task - 1, item) if task > 0 else None

    def send(self, worker: int, chunk: list) -> bool:
        writer = self.writers[worker]
        data = writer.dumps(chunk)
        self.sent_bytes = writer.last_bytes
        try:
            self.task_conns[worker].send_bytes(data)
        except (BrokenPipeError, OSError):
            return False
        return True

    def receive(self, wait_for: float, worker: int | None = None) -> tuple[int, list | None] | None:
        """One message, from ``worker`` if given (ordered mode knows who owns the next task) or any."""
        conns = self.result_conns
        poller = self._poll_all if worker is None else self._pollers[worker]
        events = poller.poll(wait_for * 1000)
        dead, first, n = [], None, len(self.procs)
        for fd, _ in events:
            w, is_conn = self._fd_worker[fd]
            if not is_conn:
                dead.append(w)
            elif first is None or (w - self._turn) % n < (first - self._turn) % n:
                first = w
        if first is not None:  # in turns: poll lists the fds in their order, and a worker that always has a
            # message waiting would keep the next one's unread (an unordered pool then never gives its results)
            self._turn = first + 1
            return first, self._read(first)
        for w in dead:  # a sentinel: the process ended; what it sent before is in the pipe, then end-of-file
            return w, self._read(w) if conns[w].poll(0) else None
        if not events and worker is not None:
            # Only the owner of the next task was watched. Check the others now: a sibling that died would
            # otherwise surface only after the owner's (possibly endless) task. A dead worker's pipe gives
            # its last results, then end-of-file.
            for w, proc in enumerate(self.procs):
                if proc.exitcode is not None:
                    return w, self._read(w)
        return None

    def leftover(self, worker: int) -> list | None:
        """A message a worker that has gone (its task pipe closed) sent before it went, or None: at the pipe's
        end-of-file, or nothing there. Its process has closed every end it held, so nothing more comes."""
        if not self.result_conns[worker].poll(0):
            return None
        return self._read(worker)

    def _read(self, worker: int) -> list | None:
        """The next message of a worker whose pipe is readable; None at end-of-file (it died)."""
        try:
            data = self.result_conns[worker].recv_bytes()
        except (EOFError, OSError):
            return None
        reader = self.readers[worker]
        try:
            results = reader.loads(data)
        except shm.SegmentVanishedError as exc:  # this message's results cannot be read: they are lost
            raise WorkerError(f"cannot read a result of {self.where(worker)}: {exc}", stage=self.name,
                              worker=worker, pid=self.pid(worker)) from exc
        self.received_bytes = reader.last_bytes
        return results

    def alive(self) -> bool:
        return bool(self.procs) and all(p.exitcode is None for p in self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def worker_processes(self) -> list:
        return list(self.procs)

    def pid(self, worker: int) -> int | None:
        return self.procs[worker].pid if worker < len(self.procs) else None

    def where(self, worker: int) -> str:
        if worker < len(self.procs):
            return f"worker {worker} (pid {self.procs[worker].pid}) of {self.name}"
        return f"worker {worker} of {self.name}"

    def death(self, worker: int) -> tuple[str, int | None]:
        proc = self.procs[worker]
        proc.join(0.1)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            if code == -signal.SIGKILL:
                kills = oom_kills()
                if kills is not None and self._oom_kills is not None and kills > self._oom_kills:
                    how += " from the OOM killer (this cgroup's count of OOM kills went up): it ran out of memory"
                else:
                    how += " (possibly the OOM killer, which sends SIGKILL: check memory)"
                self._oom_kills = kills
        else:
            how = f"exited with code {code}"
        text = f"{self.where(worker)} {how} without reporting an error"
        if code and code > 0 and self.start_method != "fork":
            script = unguarded_main()
            if script is not None:
                text += (f": it started by re-running your script {script} (the {self.start_method!r} start "
                         "method does so in every worker), which has no `if __name__ == \"__main__\":` guard; "
                         "put the code that builds and iterates the pipeline under one")
        return text, code

    def inspect(self, worker: int, wait: float = 1.0) -> tuple[str, str]:
        dump = self.dumps[worker] if worker < len(self.dumps) else None
        return forensics.describe_worker(self.procs[worker].pid, dump, wait)

    def _counters(self, at: int) -> int | None:
        if self.ctl is None:
            return None
        view = self.ctl.view
        return sum(struct.unpack_from("<Q", view, ctl_base(w) + at)[0] for w in range(len(self.procs)))

    def unread(self, received: int) -> int:
        done = self._counters(COMPLETED_AT)
        return 0 if done is None else max(0, done - received)

    def busy(self) -> float | None:
        ns = self._counters(BUSY_AT)
        return None if ns is None else ns / 1e9

    def after_fork_in_child(self) -> None:
        """In a forked child: leave the parent's workers, pipes and segments to the parent."""
        forking.forget_children(self.procs)  # or multiprocessing's exit handler in the child terminates them
        self.forked_from = self.owner_pid
        self._drop_copies()

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.shutdown()

    def shutdown(self) -> None:
        if os.getpid() != self.owner_pid:
            self._drop_copies()
            return
        self._stop_workers()

    def _drop_copies(self) -> None:
        """In a forked copy (a flow that runs in another pool's worker, or any forked child): the workers and
        the shared memory belong to the process that started them. Close our copies of the pipes and of the
        control segment's descriptor (the owner keeps its lock) and forget the rest."""
        for conn in self.task_conns + self.result_conns + self.dump_conns:
            conn.close()
        self.procs, self.task_conns, self.result_conns, self.writers = [], [], [], []
        self.prefix, self.dump_conns, self.dumps = "", [], []
        if self.ctl is not None:  # our copy of the lock's descriptor; the owner keeps the lock
            self.ctl.close()
            self.ctl = None

    def _stop_workers(self) -> None:
        with _interrupts_deferred():  # a second Ctrl-C must not leave the pool's segments behind
            self._stop_workers_now()

    def _stop_workers_now(self) -> None:
        for conn in self.task_conns:
            try:
                # Never block here: a worker that reads no more (stopped, stuck) is terminated below.
                os.set_blocking(conn.fileno(), False)
                conn.send_bytes(STOP)
            except (OSError, ValueError):
                pass
        for conn in self.result_conns:  # a worker blocked writing results gets EPIPE and exits at once
            conn.close()
        deadline = time.monotonic() + 1.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()
        for p in self.procs:
            p.join(0.5)
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        end_groups(self.procs)
        for conn in self.task_conns + self.result_conns + self.dump_conns:
            conn.close()
        for w in self.writers:
            w.close()
        if self.prefix:
            shm.sweep_segments(self.prefix)
        if self.ctl is not None:  # unlocked only now that every segment of the pool is gone
            self.ctl.close()
            self.ctl = None
        self.procs, self.task_conns, self.result_conns, self.writers, self.dump_conns = [], [], [], [], []
        self.dumps = []


def end_groups(procs: list[Any], grace: float = 0.5) -> None:
    """End what is left of the process groups that the worker processes ``procs`` lead (each worker leads
    one: :func:`~bridgeflow.parallel._transport.worker.process_main`): the processes their tasks started,
    orphans that would otherwise outlive the flow (and hold its stdout open). SIGTERM, then SIGKILL after
    ``grace`` seconds for those still there. A worker's pid names its group only while the worker is not
    reaped or the group still has members (Linux reuses no pid a group holds): a reaped worker's pid that
    names a live process now is another process's, whose group is left alone."""
    groups = []
    for p in procs:
        pid = p.pid
        if pid is None:
            continue
        if p.exitcode is not None:  # reaped: its pid is free, or another process's now
            try:
                os.kill(pid, 0)
                continue  # another process has the pid: its group is not ours
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        try:
            os.killpg(pid, signal.SIGTERM)
            groups.append(pid)
        except (ProcessLookupError, PermissionError):
            pass  # no such group: the worker left nothing behind (or never led one)
    deadline = time.monotonic() + grace
    while groups and time.monotonic() < deadline:
        time.sleep(0.01)
        groups = [g for g in groups if _group_alive(g)]
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """In the main thread: a SIGINT (Ctrl-C) that arrives inside the block is raised when it ends, so the
    cleanup it guards (a few seconds at most) runs to its end. Elsewhere, or with another SIGINT handler
    than Python's, nothing changes."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def unguarded_main() -> str | None:
    """The path of the ``__main__`` script when it has no ``if __name__ == "__main__":`` at its top level
    (a worker started by ``spawn`` re-runs it), else None."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            return None
    return path
