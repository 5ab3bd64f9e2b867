"""The one background-thread primitive: a producer thread, its bounded queue, its stop, its error, its join.

:class:`Producer` runs ``produce(producer)`` in a daemon thread. The function hands items to the consumer
with :meth:`Producer.put`, a bounded put that gives up (returns ``False``) once a stop is asked, so a
producer never blocks a shutdown on a full queue; it checks :attr:`Producer.stop` between long steps.
Whatever the function raises is kept (:attr:`Producer.error`) and, after the items put before it, raised
by the consumer's :meth:`Producer.get` with its own type; its return ends the stream (``get`` raises
``StopIteration``). :meth:`Producer.close` asks the stop, drops the items not taken (they may hold shared
memory), joins the thread and says whether it ended in time. A producer that only works in the background
(a TensorFlow enqueue loop) passes ``depth=0`` and never puts.

:class:`BackgroundIterator` is the common case: ``fn(item)`` for each item of an iterable, computed
``depth`` items ahead. The thread holds no reference to the iterator object, so dropping the iterator
stops and joins the thread. The torch adapter's pin thread and CUDA prefetcher, the ZeroMQ sender and the
TensorFlow producer loops all run on :class:`Producer`.

Example:
    >>> from bridgeflow.engine import BackgroundIterator, Producer
    >>> list(BackgroundIterator(range(4), lambda x: x * 10, depth=2))
    [0, 10, 20, 30]
    >>> def count(p):
    ...     for i in range(3):
    ...         if not p.put(i):
    ...             return
    >>> p = Producer(count, depth=1, name="bf-count")
    >>> [p.get(), p.get(), p.get()]
    [0, 1, 2]
    >>> p.close()
    True
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

from ._errors import BridgeflowError, LengthUnknownError

__all__ = ["BackgroundIterator", "Producer"]

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a blocked put or join looks at the stop


class _End:
    __slots__ = ()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _drain(q: queue.Queue | None) -> None:
    if q is None:
        return
    try:
        while True:
            q.get_nowait()
    except queue.Empty:
        pass


def _put(q: queue.Queue | None, item: Any, stop: threading.Event) -> bool:
    while q is not None and not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _run(produce: Callable[[Any], None], handle: _Handle) -> None:
    try:
        produce(handle)
    except BaseException as exc:  # kept, and raised to the consumer after what came before it
        handle.error = exc
        _put(handle.queue, _Failure(exc), handle.stop)
        return
    _put(handle.queue, _End(), handle.stop)


def _shutdown(handle: _Handle, thread: threading.Thread, timeout: float | None, pid: int) -> bool:
    """Stop, unblock and join the thread; drop what it queued. Returns whether it ended."""
    if os.getpid() != pid:  # a forked child's copy (at its exit): the thread is not here, and its queue's lock
        return True  # may have been held at the fork
    handle.stop.set()
    if thread is threading.current_thread():  # the producer closed itself: no self-join
        return True
    waited = 0.0
    while thread.is_alive() and (timeout is None or waited < timeout):
        _drain(handle.queue)  # a put blocked on a full queue sees the stop at once
        thread.join(POLL_S)
        waited += POLL_S
    _drain(handle.queue)
    return not thread.is_alive()


class _Handle:
    """What the producer thread holds: the queue, the stop and the error (never the Producer itself, so
    dropping the Producer stops the thread)."""

    __slots__ = ("queue", "stop", "error", "__weakref__")

    def __init__(self, depth: int) -> None:
        self.queue: queue.Queue | None = queue.Queue(maxsize=depth) if depth else None
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def put(self, item: Any) -> bool:
        """Queue ``item`` for the consumer, waiting for room; ``False`` once a stop is asked."""
        return _put(self.queue, item, self.stop)


class Producer:
    """``produce(handle)`` in a daemon thread named ``name``, feeding a queue of ``depth`` items.

    ``handle`` has ``put(item) -> bool`` (a bounded put that returns ``False`` once stopped), ``stop``
    (a ``threading.Event``) and ``error``. Garbage collection of the Producer closes it.
    """

    def __init__(self, produce: Callable[[Any], None], *, depth: int = 1, name: str = "bf-producer") -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"{name}: depth should be an integer >= 0, got {depth!r}")
        self._handle = _Handle(depth)
        self._done = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=_run, args=(produce, self._handle), name=name, daemon=True)
        self._finalizer = weakref.finalize(self, _shutdown, self._handle, self._thread, None, self._pid)
        self._thread.start()

    @property
    def stop(self) -> threading.Event:
        return self._handle.stop

    @property
    def error(self) -> BaseException | None:
        """What ``produce`` raised, once it has."""
        return self._handle.error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def in_thread(self) -> bool:
        """Whether the calling thread is this producer's."""
        return threading.current_thread() is self._thread

    def get(self, timeout: float | None = None) -> Any:
        """The next item; ``produce``'s error once the items before it are taken; ``StopIteration`` at
        the end (then and after an error the thread is joined). ``queue.Empty`` after ``timeout``."""
        if self._done or self._handle.queue is None:
            raise StopIteration
        if os.getpid() != self._pid:  # a forked child: the thread did not come along, nothing would ever come
            raise BridgeflowError(f"{self._thread.name}: its thread runs in process {self._pid}, and this process "
                                  f"({os.getpid()}) is a fork of it: a forked child cannot read its parent's "
                                  "background thread; build the pipeline in the child")
        item = self._handle.queue.get(timeout=timeout)
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def join(self, timeout: float | None = None) -> bool:
        """Wait for ``produce`` to return by itself (no stop asked); returns whether the thread has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, timeout: float | None = None) -> bool:
        """Stop the thread, drop what it queued, join it (within ``timeout`` seconds if given); returns
        whether the thread has ended. Idempotent."""
        self._done = True
        if not self._finalizer.alive:
            return not self._thread.is_alive()
        if timeout is None:
            return bool(self._finalizer())
        ended = _shutdown(self._handle, self._thread, timeout, self._pid)
        if ended:
            self._finalizer.detach()
        return ended


def _iterate(it: Iterator, fn: Callable[[Any], Any] | None, enter: Callable[[], None] | None,
             close_source: bool) -> Callable[[Any], None]:
    def produce(handle: Any) -> None:
        try:
            if enter is not None:
                enter()
            for item in it:
                if handle.stop.is_set():
                    return
                if fn is not None:
                    item = fn(item)
                if not handle.put(item):
                    return
                del item  # hold nothing of an item once it is queued (it may pin a shared-memory slab)
        finally:
            close = getattr(it, "close", None) if close_source else None
            if close is not None:
                close()

    return produce


class BackgroundIterator:
    """``fn(item)`` for each item of ``source``, computed by a background thread ``depth`` items ahead.

    Args:
        source: any iterable: ``iter(source)`` is called here, the iterator is read (and closed, when it
            has ``close``) in the thread.
        fn: applied to each item in the thread; ``None`` passes items through.
        depth: finished items kept waiting (>= 1).
        name: the thread's name.
        enter_thread: called first thing in the thread (e.g. to select a CUDA device).
        close_source: close ``source``'s iterator when the thread ends.
    """

    def __init__(self, source: Iterable, fn: Callable[[Any], Any] | None = None, *, depth: int = 2,
                 name: str = "bf-background", enter_thread: Callable[[], None] | None = None,
                 close_source: bool = True) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"{type(self).__name__}: depth should be a positive integer, got {depth!r}")
        self._source = source
        self._producer = Producer(_iterate(iter(source), fn, enter_thread, close_source), depth=depth, name=name)

    def __iter__(self) -> BackgroundIterator:
        return self

    def __next__(self) -> Any:
        return self._producer.get()

    def __len__(self) -> int:
        if not isinstance(self._source, Sized):
            raise LengthUnknownError(f"{type(self).__name__}: its source, a {type(self._source).__name__}, "
                                     "has no length")
        return len(self._source)

    @property
    def alive(self) -> bool:
        """Whether the background thread is still running."""
        return self._producer.alive

    def close(self) -> None:
        """Stop and join the background thread; items not yet handed out are dropped. Idempotent."""
        self._producer.close()

    def __enter__(self) -> BackgroundIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
