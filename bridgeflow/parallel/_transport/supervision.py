"""Supervised restarts of a process pool's workers: what each worker holds, the restart budget and its history,
and the tasks that kill every worker they meet.

A :class:`~bridgeflow.parallel.WorkerPool` with ``max_restarts > 0`` keeps, per worker, the payloads of the tasks
it sent and has no result of yet, in the order sent (:meth:`Supervisor.sent`, :meth:`Supervisor.answered`). When
a worker dies (a signal, an exit without reporting an error, the OOM killer), the pool files what it sent before
it died (a message cut short by the death ends in the middle and is discarded), then, within the budget, starts
a new process with the same worker id, seed and init function, and sends it the dead worker's tasks again, each
alone in its message (:class:`~bridgeflow.parallel._transport.wire.Retry`). Results it delivered are not redone;
the others come back under their old task ids, so an ordered pool gives the order, and an unordered one the
multiset, of an undisturbed run.

Blame (:meth:`Supervisor.blame`): a worker runs its messages in the order sent, so the task it was running when
it died is the first it held, if its mark (in the control segment) says it started it. When that message held
the task alone, the death is the task's; a retried task's worker also marks which item of it starts (a
datapoint of a batch stacked in the worker, a sample of a DataLoader batch), so a death there names the item.
A task that killed :data:`POISON_DEATHS` workers while running alone is *poison* and is not run again: under a
skip policy (:attr:`FaultPolicy.skip`) the item is left out of the task, which is sent once more without it,
or a task that is its own item is answered as skipped (:meth:`FaultPolicy.skipped`); otherwise the pool
raises a :class:`~bridgeflow.WorkerError` naming it (:meth:`FaultPolicy.describe`). Every death counts against
the budget; past it, the pool raises the death's :class:`~bridgeflow.WorkerError` with the history of the
restarts before it.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from ..._errors import WorkerError
from .wire import Retry

__all__ = ["POISON_DEATHS", "FaultPolicy", "Supervisor", "check_max_restarts", "ending", "oom_kills"]

log = logging.getLogger("bridgeflow.parallel._transport.pool")

POISON_DEATHS = 2  # deaths of workers running a task alone that make it a poison task


def ending(exitcode: int | None) -> str:
    """How a worker process ended, in a few words: ``"killed by SIGKILL"``, ``"exited with code 3"``."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def oom_kills() -> int | None:
    """How many processes the OOM killer has killed in this process's memory cgroup (v2 ``memory.events``, v1
    ``memory.oom_control``), None when that cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    paths = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.events")
        elif "memory" in controllers.split(","):
            paths.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control")
    for path in paths + ["/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"]:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def check_max_restarts(value: Any, who: str) -> int:
    """``max_restarts``: an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{who}: max_restarts must be an integer >= 0 (0: a dead worker is an error), got {value!r}")
    return value


class FaultPolicy:
    """How a pool's owner names its tasks in errors and logs, and whether it skips the items that kill workers.
    This default names tasks by number and raises; the parallel stages and the torch DataLoader name their
    datapoints and samples."""

    skip = False  # a poison item is left out (True) or raised (False)
    hint = ""  # what the error about a poison task adds, e.g. how to skip it

    def describe(self, task_id: int, payload: Any, item: int | None) -> str:
        """``task_id``'s ``item`` (None: the whole task) in words, e.g. ``"the sample at index 17"``."""
        return f"task #{task_id}" + ("" if item is None else f" (its item {item})")

    def skipped(self, task_id: int, payload: Any, why: str) -> Any:
        """The result to give for a poison task that is its own item, when :attr:`skip` (``why``: the deaths)."""
        raise NotImplementedError


class Supervisor:
    """The bookkeeping of a pool's restarts (see the module doc); the pool acts on what it says."""

    def __init__(self, name: str, num_workers: int, max_restarts: int, policy: FaultPolicy | None) -> None:
        self.name = name
        self.max_restarts = max_restarts
        self.policy = policy if policy is not None else FaultPolicy()
        self.held: list[dict[int, tuple[Any, bool]]] = [{} for _ in range(num_workers)]  # id -> (payload, alone)
        self.deaths: dict[int, list[str]] = {}  # task id -> the deaths of workers running it alone
        self.avoid: dict[int, dict[int, str]] = {}  # task id -> its items left out (poison, skipped), and why
        self.history: list[str] = []  # each restart's cause, oldest first

    @property
    def restarts(self) -> int:
        return len(self.history)

    def sent(self, worker: int, chunk: list) -> None:
        """``chunk`` (``[(task id, payload), ...]``) went to ``worker``."""
        held, alone = self.held[worker], len(chunk) == 1
        for task_id, payload in chunk:
            held[task_id] = (payload, alone)

    def answered(self, worker: int, task_id: int) -> None:
        self.held[worker].pop(task_id, None)
        if self.deaths:
            self.deaths.pop(task_id, None)

    def lost(self, worker: int) -> dict[int, Any]:
        """The tasks ``worker`` held when it died (in the order sent), now held by nobody."""
        held, self.held[worker] = self.held[worker], {}
        return {task_id: payload for task_id, (payload, _) in held.items()}

    def blame(self, worker: int, cause: str, mark: tuple[int, int] | None) -> tuple[int, int | None, bool] | None:
        """Note ``worker``'s death (``cause``: how it ended): ``(task id, item, poison)`` of the task it was
        running when that task was alone in its message (the item from the worker's mark, None if unmarked),
        None when the death cannot be put on one task: it ran a chunk of several, or had not started the first
        task it held (its mark names another; or it has none: no control segment)."""
        held = self.held[worker]
        if not held:
            return None
        task_id = next(iter(held))
        if not held[task_id][1] or mark is None or mark[0] != task_id:
            return None
        item = mark[1] if mark[1] >= 0 else None
        deaths = self.deaths.setdefault(task_id, [])
        deaths.append(cause)
        return task_id, item, len(deaths) >= POISON_DEATHS

    def replace(self, worker: int, text: str, code: int | None, pid: int | None, mark: tuple[int, int] | None,
                discard_below: int) -> tuple[list[Retry], dict[int, Any], int]:
        """``worker`` died (``text``: the pool's words for it): raise its WorkerError past the budget, or for a
        poison task not to skip; else note the restart and return what to do once a new worker takes its
        place: the tasks to send it again (the dead one's, less those discarded below ``discard_below``), the
        results of tasks answered as skipped, and how many tasks the dead worker held."""
        cause = f"worker {worker} (pid {pid}) {ending(code)}"
        culprit = self.blame(worker, cause, mark)
        policy = self.policy
        poison, what = None, ""
        if culprit is not None and culprit[2]:
            task_id, item, _ = culprit
            poison = (task_id, item, self.poison_text(task_id))
            what = self.policy.describe(task_id, self.held[worker][task_id][0], item)
            if not policy.skip:
                raise WorkerError(f"{self.name}: {what}: {poison[2]}, and is not run again{policy.hint}"
                                  f"{self.history_text()}", stage=self.name, worker=worker, pid=pid, exitcode=code)
        if self.restarts >= self.max_restarts:
            named = f"; {what}: {poison[2]}" if poison is not None else ""
            raise WorkerError(text + named + self.history_text(), stage=self.name, worker=worker, pid=pid,
                              exitcode=code)
        self.history.append(f"{cause} at {time.strftime('%H:%M:%S')}")
        lost = self.lost(worker)
        log.warning("%s; restarting it (restart %d of max_restarts=%d) and running the %d task(s) it held again",
                    text.removesuffix(" without reporting an error"), self.restarts, self.max_restarts, len(lost))
        retries, answered = [], {}
        for task_id, payload in lost.items():
            if task_id < discard_below:  # discarded: its result would be dropped anyway
                continue
            avoid = self.avoid.get(task_id)
            if poison is not None and task_id == poison[0]:
                why = poison[2]
                if poison[1] is None:  # the task is its own item: answered as skipped, not run again
                    log.info("%s: %s: %s; skipped", self.name, what, why)
                    answered[task_id] = policy.skipped(task_id, payload, why)
                    continue
                log.info("%s: %s: %s; its task is sent again without it", self.name, what, why)
                avoid = self.leave_out(task_id, poison[1], why)
            self.sent(worker, [(task_id, payload)])
            retries.append(Retry(task_id, payload, avoid))
        return retries, answered, len(lost)

    def leave_out(self, task_id: int, item: int, why: str) -> dict[int, str]:
        """Skip ``item`` of ``task_id`` from now on; returns every item left out of it."""
        self.deaths.pop(task_id, None)  # the task without that item starts a new count
        avoid = self.avoid.setdefault(task_id, {})
        avoid[item] = why
        return avoid

    def poison_text(self, task_id: int) -> str:
        """Why a poison task is not run again: the deaths it caused."""
        deaths = self.deaths.get(task_id, [])
        return f"it killed {len(deaths)} worker processes in turn ({', then '.join(deaths)})"

    def history_text(self) -> str:
        if not self.history:
            return ""
        return (f" (after {self.restarts} restart{'s' * (self.restarts != 1)} of max_restarts={self.max_restarts}: "
                f"{'; '.join(self.history)})")
