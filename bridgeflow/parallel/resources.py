"""What a :class:`~bridgeflow.parallel.pool.WorkerPool` must release, and how it releases it.

Kept apart from the pool so that ``weakref.finalize`` can shut a pool down without holding the pool
itself: a pool that is garbage-collected without ``close()`` still stops its workers and frees its
shared memory.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

from . import shm
from .worker import _STOP

__all__ = ["PoolResources"]


class PoolResources:
    """Everything the pool must release; kept apart from the pool so ``weakref.finalize`` can close it."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.threads: list[threading.Thread] = []
        self.task_conns: list[Any] = []
        self.result_conns: list[Any] = []
        self.task_queues: list[queue.SimpleQueue] = []
        self.stop = threading.Event()  # thread workers: stop before the next chunk, not after the backlog
        self.ctl: shm.ControlSegment | None = None
        self.dump_conns: list[Any] = []  # per process worker: where its stack arrives when asked for
        self.prefix = ""
        self.writers: list[shm.SlabWriter] = []
        self.owner_pid = os.getpid()

    def shutdown(self) -> None:
        if os.getpid() != self.owner_pid:
            # A forked copy (a flow that runs in another pool's worker): the workers and the shared memory
            # belong to the process that started them. Close our copies of the pipes and forget the rest.
            for conn in self.task_conns + self.result_conns + self.dump_conns:
                conn.close()
            self.procs, self.task_conns, self.result_conns, self.writers = [], [], [], []
            self.task_queues, self.threads, self.prefix, self.dump_conns = [], [], "", []
            if self.ctl is not None:  # our copy of the lock's descriptor; the owner keeps the lock
                self.ctl.close()
                self.ctl = None
            return
        for conn in self.task_conns:
            try:
                # Never block here: a worker that reads no more (stopped, stuck) is terminated below.
                os.set_blocking(conn.fileno(), False)
                conn.send_bytes(_STOP)
            except (OSError, ValueError):
                pass
        for conn in self.result_conns:  # a worker blocked writing results gets EPIPE and exits at once
            conn.close()
        self.stop.set()
        for q in self.task_queues:
            q.put(None)
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
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for conn in self.task_conns + self.result_conns + self.dump_conns:
            conn.close()
        for w in self.writers:
            w.close()
        if self.prefix:
            shm.sweep_segments(self.prefix)
        if self.ctl is not None:  # unlocked only now that every segment of the pool is gone
            self.ctl.close()
            self.ctl = None
        self.procs, self.task_conns, self.result_conns, self.writers = [], [], [], []
        self.task_queues, self.threads, self.dump_conns = [], [], []
