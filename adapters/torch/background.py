"""An iterator whose items are produced ahead, in a background thread.

:class:`BackgroundIterator` reads ``source`` in its own thread, applies ``fn`` to each item there, and
keeps at most ``depth`` finished items waiting; iterating it hands them out in order. An exception raised
by the source or by ``fn`` reaches the consumer after the items produced before it, with its own type.
:meth:`~BackgroundIterator.close` (also run when the iterator ends, fails, or is garbage-collected) stops
the thread, joins it and closes the source from that thread, so no thread outlives it.

The thread holds no reference to the iterator object: dropping the iterator is enough to stop it.

Example:
    >>> from bridgeflow.adapters.torch.background import BackgroundIterator
    >>> list(BackgroundIterator(range(4), lambda x: x * 10, depth=2))
    [0, 10, 20, 30]
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["BackgroundIterator"]

_POLL_S = 0.05


class _End:
    pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Any, fn: Callable[[Any], Any] | None, out: queue.Queue, stop: threading.Event,
             enter_thread: Callable[[], None] | None, close_source: bool) -> None:
    try:
        if enter_thread is not None:
            enter_thread()
        for item in source:
            if stop.is_set():
                return
            if fn is not None:
                item = fn(item)
            if not _put(out, item, stop):
                return
            del item  # hold nothing of an item once it is queued (it may pin a shared-memory slab)
        _put(out, _End(), stop)
    except BaseException as exc:  # handed to the consumer and raised there
        _put(out, _Failure(exc), stop)
    finally:
        close = getattr(source, "close", None) if close_source else None
        if close is not None:
            try:
                close()
            except Exception as exc:  # reported to the consumer unless something else already was
                _put(out, _Failure(exc), stop)


def _shutdown(stop: threading.Event, out: queue.Queue, thread: threading.Thread) -> None:
    stop.set()
    if thread is threading.current_thread():  # fn or the source closed its own iterator: no self-join
        return
    while thread.is_alive():
        try:  # unblock a producer waiting on a full queue
            while True:
                out.get_nowait()
        except queue.Empty:
            pass
        thread.join(_POLL_S)
    try:  # drop items produced but never handed out (they may hold shared memory)
        while True:
            out.get_nowait()
    except queue.Empty:
        pass


class BackgroundIterator:
    """``fn(item)`` for each item of ``source``, computed by a background thread ``depth`` items ahead.

    Args:
        source: any iterable; iterated (and closed, when it has ``close``) in the background thread.
        fn: applied to each item in the background thread; ``None`` passes items through.
        depth: finished items kept waiting (>= 1).
        name: the thread's name.
        enter_thread: called first thing in the background thread (e.g. to select a CUDA device).
        close_source: call ``source``'s iterator's ``close()`` when the thread ends.
    """

    def __init__(self, source: Iterable, fn: Callable[[Any], Any] | None = None, *, depth: int = 2,
                 name: str = "bf-background", enter_thread: Callable[[], None] | None = None,
                 close_source: bool = True) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"{type(self).__name__}: depth should be a positive integer, got {depth!r}")
        self._source = source
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        iterator = iter(source)
        self._thread = threading.Thread(
            target=_produce, args=(iterator, fn, self._queue, self._stop, enter_thread, close_source),
            name=name, daemon=True)
        self._finalizer = weakref.finalize(self, _shutdown, self._stop, self._queue, self._thread)
        self._thread.start()

    def __iter__(self) -> BackgroundIterator:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End):
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def __len__(self) -> int:
        return len(self._source)

    @property
    def alive(self) -> bool:
        """Whether the background thread is still running."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop and join the background thread; items not yet handed out are dropped. Idempotent."""
        self._done = True
        self._finalizer()

    def __enter__(self) -> BackgroundIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
