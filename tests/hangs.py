"""What keeps the test command from hanging, used by conftest.py's hooks.

- :func:`stacks_of_everything`: every thread's stack in this process and in every process under it, for the
  report of a test that ran out of time (pytest-timeout fails it; conftest.py adds these).
- :func:`process_limit`: a bound on the processes a subprocess and everything under it can start, for tests
  that start Ray or restart workers, so that a runaway fork in the code under test cannot take the machine.
- :class:`CrashTolerantLoadGroup`: pytest-xdist's ``--dist loadgroup`` scheduler, less three faults of 3.8.0
  that left a run waiting forever once a worker crashed ("node down"): it put every unit the dead worker had
  *finished* back on the queue, and sending such a unit (nothing left to run in it) to a worker, or a single
  test to a fresh one, leaves that worker waiting for a second test that never comes; it also ran the test the
  worker died on again (already reported failed), which can kill the replacement the same way; and a worker
  crashing while a replacement was still collecting ended the run in an INTERNALERROR (KeyError in
  ``_assign_work_unit``). Upstream: pytest-xdist issues 1323, 1327 and 1378 and pull requests 1324, 1328 and
  1371, not released in 3.8.0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

from procs import processes

try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # no pytest-xdist: no scheduler to fix
    LoadGroupScheduling = object  # type: ignore[assignment,misc]

from bridgeflow.parallel._transport.forensics import process_state

__all__ = ["CrashTolerantLoadGroup", "descendants", "process_limit", "stacks_of_everything"]

_MAX_PROCESSES = 24  # dumped at most: a test that started more is summed up


def descendants(pid: int | None = None) -> list[int]:
    """The live processes under ``pid`` (this process by default), children first, from /proc."""
    children: dict[int, list[int]] = {}
    for proc in processes():
        children.setdefault(proc.ppid, []).append(proc.pid)
    out, todo = [], [os.getpid() if pid is None else pid]
    while todo:
        for child in sorted(children.get(todo.pop(0), [])):
            out.append(child)
            todo.append(child)
    return out


def _threads_here() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    blocks = []
    for ident, frame in sys._current_frames().items():
        if ident != me:  # this thread is the one reporting
            blocks.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                          + "".join(traceback.format_stack(frame)))
    return "\n".join(blocks) or "(no other thread)"


def _py_spy() -> str | None:
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


def _dump(pid: int, py_spy: str | None) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return f"pid {pid}: gone"
    head = f"pid {pid} ({process_state(pid)}): {cmdline[:300]}"
    if py_spy is None:
        return head + "\n  (no stack: py-spy is not installed; it is in the test extra)"
    try:
        out = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return head + "\n  (py-spy did not answer in 10 s)"
    text = out.stdout.strip() if out.returncode == 0 else f"(py-spy: {(out.stderr or out.stdout).strip()[:500]})"
    return f"{head}\n{text}"


def stacks_of_everything() -> str:
    """Every thread's Python stack in this process, then each process under it with its state and, through
    py-spy (which reads any Python process, however stuck, without its help), every thread's stack."""
    parts = [f"this process (pid {os.getpid()}), every thread but the main one, whose stack is the traceback "
             f"above:\n{_threads_here()}"]
    pids = descendants()
    py_spy = _py_spy()
    for pid in pids[:_MAX_PROCESSES]:
        parts.append(_dump(pid, py_spy))
    if len(pids) > _MAX_PROCESSES:
        parts.append(f"... and {len(pids) - _MAX_PROCESSES} more processes: {pids[_MAX_PROCESSES:]}")
    return "\n\n".join(parts)


def _own_pids_cgroup() -> str | None:
    """This process's pids cgroup folder, where it can make one under it (cgroup v1, or v2 with pids enabled)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "pids" in controllers.split(","):
            folder = "/sys/fs/cgroup/pids" + path
            break
    else:  # v2: the unified hierarchy, if it has the pids controller
        folder = "/sys/fs/cgroup" + next((path for n, c, path in lines if n == "0"), "/")
        try:
            with open(os.path.join(folder, "cgroup.subtree_control")) as f:
                if "pids" not in f.read().split():
                    return None
        except OSError:
            return None
    return folder if os.access(folder, os.W_OK) else None


@contextlib.contextmanager
def process_limit(max_tasks: int) -> Iterator[Callable[[], None] | None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that puts the child in a pids cgroup of its own (under
    this process's) where it and every process under it can have at most ``max_tasks`` tasks, threads
    included: past it, fork fails in the child, not on the machine. On leaving, whatever is still in the group
    (a Ray raylet whose driver was killed, say) is killed and the group removed. ``None`` where no cgroup can
    be made (no permission, no pids controller): the caller's other bounds (timeouts, its run's cap) remain."""
    parent = _own_pids_cgroup()
    folder = None
    if parent is not None:
        folder = os.path.join(parent, f"bridgeflow-test-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.mkdir(folder)
            with open(os.path.join(folder, "pids.max"), "w") as f:
                f.write(str(max_tasks))
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
            folder = None
    procs = None if folder is None else os.path.join(folder, "cgroup.procs")

    def enter() -> None:  # in the child, between fork and exec: async-signal-safe calls only
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")  # 0: the writing process itself
        finally:
            os.close(fd)

    try:
        yield None if procs is None else enter
    finally:
        if procs is not None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    with open(procs) as f:
                        left = [int(p) for p in f.read().split()]
                except OSError:
                    break
                if not left:
                    break
                for pid in left:
                    with contextlib.suppress(OSError):
                        os.kill(pid, 9)
                time.sleep(0.1)
            with contextlib.suppress(OSError):
                os.rmdir(folder)


class CrashTolerantLoadGroup(LoadGroupScheduling):
    """``--dist loadgroup`` where a crashed worker is a reported failure and the run goes on (module doc)."""

    def remove_node(self, node):  # type: ignore[no-untyped-def]
        workload = self.assigned_work.pop(node)
        left = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items() if not done]
        if not left:
            return None
        scope, crashed = left[0]  # a worker runs its tests in the order sent: the first not done is the one
        workload[scope][crashed] = True  # reported failed by xdist (handle_crashitem); not run again
        for scope, unit in workload.items():
            if not all(unit.values()):  # only what is left to run goes back on the queue
                self.workqueue[scope] = unit
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _assign_work_unit(self, node):  # type: ignore[no-untyped-def]
        if node in self.registered_collections:  # else a replacement still collecting: see _reschedule
            super()._assign_work_unit(node)

    def _reschedule(self, node):  # type: ignore[no-untyped-def]
        # A worker runs a test once it knows the next one (or that none comes): keep two pending, else shut it
        # down so that it runs what it has. xdist 3.8.0 gave a worker one unit here, so a replacement given one
        # test waited for a second forever. A replacement that has not sent its collection yet gets its work
        # from schedule() once it has: xdist 3.8.0 gave it work when another worker crashed or finished
        # collecting, and died of a KeyError (INTERNALERROR in _assign_work_unit).
        if node.shutting_down or node not in self.registered_collections:
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:  # xdist keeps 3 when it can
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()
