"""What travels between a :class:`~bridgeflow.parallel.WorkerPool` and its workers, and how it is laid out.

A task message is a chunk, a list of ``(task_id, payload)``; the reply to a chunk is one list of
``(kind, task_id, value)``, ``kind`` being :data:`OK`, :data:`RAN_OUT` (the task function raised
``StopIteration``) or :data:`ERROR` (the value is ``pack_exception``'s tuple). Two task ids are not tasks:
:data:`INIT` carries the error of a failed ``init_fn``, :data:`FATAL` an error after which a process worker
exits (its tasks are lost). An empty message, :data:`STOP`, tells a process worker to exit.

A pool of process workers shares one control segment (:mod:`bridgeflow.parallel._transport.shm`); worker ``w``'s part
starts at :func:`ctl_base` ``(w)`` and holds :data:`MAX_SLABS` result-slab flags, as many task-slab flags,
then two unsigned 64-bit counters: the results it completed and the nanoseconds it spent in its task
function.
"""

from __future__ import annotations

from . import shm

__all__ = [
    "BUSY_AT", "COMPLETED_AT", "CTL_STRIDE", "ERROR", "FATAL", "INIT", "LIVENESS_INTERVAL", "MAX_SLABS", "OK",
    "RAN_OUT", "STOP", "ctl_base",
]

OK, RAN_OUT, ERROR = 0, 1, 2  # the kinds of a result
INIT = -1  # task id of an error raised by init_fn
FATAL = -2  # task id of an error after which the worker exits (its tasks are lost)
STOP = b""  # the message that tells a process worker to exit
LIVENESS_INTERVAL = 0.5  # seconds between checks that the workers (or the parent) are alive

MAX_SLABS = 128
COMPLETED_AT = 2 * MAX_SLABS  # offset, in a worker's part of the control segment, of its completed results
BUSY_AT = COMPLETED_AT + 8  # and of the nanoseconds it spent working
CTL_STRIDE = BUSY_AT + 8  # bytes per worker: result slab flags, task slab flags, the two counters


def ctl_base(worker_id: int) -> int:
    """Where worker ``worker_id``'s part of the pool's control segment starts."""
    return shm.CTL_HEADER + worker_id * CTL_STRIDE
