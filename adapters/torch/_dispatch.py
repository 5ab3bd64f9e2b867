"""Tasks in flight: which worker each task goes to, and how many are out, as torch's iterators decide.

torch keeps ``prefetch_factor * num_workers`` tasks in flight and sends each to the next worker, in turn, that
has not run out (an iterable dataset's worker runs out when its stream ends); with ``in_order=False`` a
map-style task goes to the least busy worker and its batch is handed out as soon as it is ready.
:class:`Dispatcher` does that bookkeeping over a batch source (:mod:`._sources`); the epoch iterator draws the
tasks (:mod:`._draws`) and hands out the results (:mod:`._epoch`).

Example:
    >>> from bridgeflow.adapters.torch._dispatch import Dispatcher
    >>> class Echo:                                         # a batch source answering at once
    ...     def __init__(self): self.out = []
    ...     def put(self, task, worker, seq): self.out.append((worker, seq, task))
    ...     def get(self): return self.out.pop(0)
    >>> d = Dispatcher(Echo(), num_workers=2, depth=4, unordered=False)
    >>> d.start()
    >>> [d.send(task, seq) for seq, task in enumerate("abc")]
    [True, True, True]
    >>> [d.receive()[0] for _ in range(3)]                  # the worker each went to, in turn
    [0, 1, 0]
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from ._result import Result

__all__ = ["Dispatcher"]


class Dispatcher:
    """Sends tasks to ``source``'s workers (round robin over those still running, or the least busy when
    ``unordered``), at most ``depth`` in flight, and receives their results."""

    def __init__(self, source: Any, num_workers: int, depth: int, unordered: bool) -> None:
        self.source = source
        self.num_workers = max(1, num_workers)
        self.depth = depth
        self.unordered = unordered
        self.in_flight = 0
        self.no_more = False  # no task will be sent again this epoch
        self._active: list[bool] = []
        self._turns: Any = None
        self._owners: collections.deque = collections.deque()  # the worker of each task in flight, in order

    def start(self, exhausted: list[bool] | None = None, next_worker: int = 0) -> None:
        """An epoch: every worker running (but those ``exhausted``), the next task to ``next_worker``."""
        n = self.num_workers
        self._active = [True] * n if exhausted is None else [not e for e in exhausted]
        self._turns = itertools.islice(itertools.cycle(range(n)), next_worker % n, None)
        self._owners.clear()
        self.in_flight = 0
        self.no_more = False

    @property
    def wants(self) -> bool:
        """Whether another task may be sent now."""
        return not self.no_more and self.in_flight < self.depth

    def send(self, task: Any, seq: int) -> bool:
        """Send task number ``seq`` of the epoch; False (and no more tasks) when no worker is left to take it."""
        worker = None  # unordered: the pool gives it to the least busy worker
        if not self.unordered:
            for _ in range(self.num_workers):
                worker = next(self._turns)
                if self._active[worker]:
                    break
            else:
                self.no_more = True
                return False
            self._owners.append(worker)
        self.source.put(task, worker, seq)
        self.in_flight += 1
        return True

    def receive(self) -> tuple[int | None, int, Result]:
        """The next result: ``(worker, seq, result)``; the worker is the one the task was sent to (unordered:
        the one that answered, None when the source does not say)."""
        worker, seq, result = self.source.get()
        self.in_flight -= 1
        if self._owners:
            worker = self._owners.popleft()
        return worker, seq, result

    def retire(self, worker: int) -> None:
        """``worker``'s stream ended: it gets no more tasks this epoch."""
        self._active[worker] = False
