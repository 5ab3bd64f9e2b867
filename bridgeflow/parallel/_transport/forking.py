"""What a ``fork()`` of the consumer's process does to its worker pools: nothing, in the parent.

A process that forks (``os.fork()``, a ``multiprocessing`` fork worker of some other library, a
``subprocess`` with ``preexec_fn``) copies its pools into the child: their process handles, their pipes,
their shared memory. Left alone, the child's copies act on the parent's workers:
``multiprocessing``'s exit handler in a child that ends normally (``sys.exit(0)``) terminates every
daemon process it believes to be its own (the parent's workers, killed by SIGTERM), and a child that
iterates the parent's pipeline writes tasks into the parent's pipes.

So each live channel is registered here, and one handler, run in every forked child
(``os.register_at_fork``), makes the child forget them: the parent's worker processes leave
``multiprocessing``'s list of the child's children, the child's copies of the pipes and of the control
segment's lock are closed, and the channel is marked :attr:`forked` so that a child that uses the pool gets
a clear :class:`~bridgeflow.BridgeflowError` instead of a corrupt stream. The parent's workers, pipes and
segments are untouched, however the child ends.

``multiprocessing.process._children`` is a private name of the standard library (the set that
``active_children()`` and the exit handler read); :func:`forget_children` is the one place that uses it,
and ``tests/test_parallel_fork.py`` checks it is still there.
"""

from __future__ import annotations

import logging
import multiprocessing.process as mp_process
import os
import threading
import weakref
from typing import Any, Protocol

__all__ = ["Forkable", "forget_children", "track"]

log = logging.getLogger(__name__)


class Forkable(Protocol):
    """A channel that a forked child must forget: ``after_fork_in_child()`` drops the child's copies."""

    def after_fork_in_child(self) -> None: ...


_live: weakref.WeakSet = weakref.WeakSet()
_registered = False
_lock = threading.Lock()


def track(channel: Forkable) -> None:
    """Make every process forked from now on forget ``channel`` (held by a weak reference)."""
    global _registered
    with _lock:
        if not _registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _registered = True
        _live.add(channel)


def forget_children(procs: list[Any]) -> None:
    """Take ``procs`` (``multiprocessing.Process`` objects started by the parent) out of this process's
    list of children, so that ``active_children()`` and the exit handler leave them alone."""
    children = getattr(mp_process, "_children", None)
    if isinstance(children, set):
        children.difference_update(procs)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    channels = list(_live)
    _live.clear()  # the child's own pools register themselves when they start
    for channel in channels:
        try:
            channel.after_fork_in_child()
        except Exception:  # a handler that raises would only be printed; never stop the child for it
            log.debug("forgetting a pool after fork failed", exc_info=True)
