"""What travels between a :class:`~bridgeflow.parallel.WorkerPool` and its workers, and how it is laid out.

A task message is a chunk, a list of ``(task_id, payload)``; the reply to a chunk is one list of
``(kind, task_id, value)``, ``kind`` being :data:`OK`, :data:`RAN_OUT` (the task function raised
``StopIteration``) or :data:`ERROR` (the value is ``pack_exception``'s tuple). Two task ids are not tasks:
:data:`INIT` carries the error of a failed ``init_fn``, :data:`FATAL` an error after which a process worker
exits (its tasks are lost). An empty message, :data:`STOP`, tells a process worker to exit. A
:class:`Retry` instead of a chunk is one task of a dead worker sent again to its replacement
(:mod:`bridgeflow.parallel._transport.supervision`): run alone, its items marked as they start.

A pool of process workers shares one control segment (:mod:`bridgeflow.parallel._transport.shm`); worker ``w``'s part
starts at :func:`ctl_base` ``(w)`` and holds :data:`MAX_SLABS` result-slab flags, as many task-slab flags,
then two unsigned 64-bit counters: the results it completed and the nanoseconds it spent in its task
function; then the *mark* of the message the worker is running, two signed 64-bit numbers that the consumer
reads when the worker dies: the task id (of its first task) plus one (0: none yet), and the item of the task
being run: -2 in a chunk (items not marked), and in a :class:`Retry` the item starting (-1: the task as a
whole, a task that is its own item or a group being finished).
"""

from __future__ import annotations

from . import shm

__all__ = [
    "BUSY_AT", "COMPLETED_AT", "CTL_STRIDE", "ERROR", "FATAL", "INIT", "LIVENESS_INTERVAL", "MARK_AT", "MAX_SLABS",
    "OK", "RAN_OUT", "STOP", "Retry", "ctl_base",
]

OK, RAN_OUT, ERROR = 0, 1, 2  # the kinds of a result
INIT = -1  # task id of an error raised by init_fn
FATAL = -2  # task id of an error after which the worker exits (its tasks are lost)
STOP = b""  # the message that tells a process worker to exit
LIVENESS_INTERVAL = 0.5  # seconds between checks that the workers (or the parent) are alive

MAX_SLABS = 128
COMPLETED_AT = 2 * MAX_SLABS  # offset, in a worker's part of the control segment, of its completed results
BUSY_AT = COMPLETED_AT + 8  # and of the nanoseconds it spent working
MARK_AT = BUSY_AT + 8  # and of the mark of the message in progress: (task id + 1, item)
CTL_STRIDE = MARK_AT + 16  # bytes per worker: result slab flags, task slab flags, the counters, the mark


class Retry:
    """A task of a dead worker, sent again to the worker that replaces it, alone in its message.

    The worker marks in the control segment which item of it is starting (a task function with a
    ``careful(payload, mark, avoid)`` method calls ``mark(i)`` before item ``i`` of a group; a plain task is
    its own item), so that a second death names the item. ``avoid`` maps items not to run (found to kill
    workers, under a skip policy) to why.
    """

    __slots__ = ("avoid", "payload", "task_id")

    def __init__(self, task_id: int, payload: object, avoid: dict[int, str] | None = None) -> None:
        self.task_id, self.payload, self.avoid = task_id, payload, avoid or {}

    def __reduce__(self) -> tuple:
        return Retry, (self.task_id, self.payload, self.avoid)


def ctl_base(worker_id: int) -> int:
    """Where worker ``worker_id``'s part of the pool's control segment starts."""
    return shm.CTL_HEADER + worker_id * CTL_STRIDE
