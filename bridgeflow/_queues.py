"""Flows around thread queues, under tensorpack's names: ``DataFromQueue`` and ``MultiThreadPrefetchData``.

``DataFromQueue(queue)`` yields what another thread or process puts on a queue (``queue.Queue``,
``multiprocessing.Queue``, anything with ``get()``), forever by default as in tensorpack; ``end=`` names
an item that ends the iteration and ``timeout=`` turns a silent producer into an error instead of a hang.

``MultiThreadPrefetchData(get_df, num_prefetch, num_thread)`` is tensorpack's older name of
:class:`~bridgeflow.MultiThreadRunner`, with tensorpack's argument order (as ``PrefetchData`` keeps it
for :class:`~bridgeflow.MultiProcessRunner`).

Example:
    >>> import queue
    >>> q = queue.Queue()
    >>> for i in range(3):
    ...     q.put([i])
    >>> q.put(None)
    >>> list(DataFromQueue(q, end=None))
    [[0], [1], [2]]
"""

from __future__ import annotations

import queue as _queue
from collections.abc import Iterator
from typing import Any

from ._base import DataFlow
from .parallel import MultiThreadRunner

__all__ = ["DataFromQueue", "MultiThreadPrefetchData"]

_FOREVER = object()
_EQUAL_TYPES = (str, bytes, int, float, type(None))  # an end marker of these types may arrive as a copy


class DataFromQueue(DataFlow):
    """The items of ``queue``, as they are ``get()`` from it; ``len()`` is unknown.

    Args:
        queue: any object with ``get()`` (and ``get(timeout=)`` when ``timeout`` is given).
        end: an item that ends the iteration when it arrives (compared by identity, or by value for
            ``None``, strings, bytes and numbers, which a process queue delivers as copies). By default
            the iteration never ends, as in tensorpack.
        timeout: seconds to wait for each item; past them, ``TimeoutError`` names the wait (default: wait
            forever, as tensorpack does).

    The flow does not own the queue: ``close()`` leaves it alone.
    """

    _fed_from_outside = True  # what arrives is what producers send this process: per rank already

    def __init__(self, queue: Any, *, end: Any = _FOREVER, timeout: float | None = None) -> None:
        if not callable(getattr(queue, "get", None)):
            raise TypeError(f"DataFromQueue needs an object with get(), got {type(queue).__name__}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"DataFromQueue: timeout must be a positive number of seconds or None, got {timeout!r}")
        self.queue = queue
        self.end = end
        self.timeout = timeout

    def _why_not_resumable(self) -> str:
        return ("DataFromQueue cannot save its position: the items it took from the queue are gone; resume "
                "whatever fills the queue instead")

    def _is_end(self, item: Any) -> bool:
        end = self.end
        if end is _FOREVER:
            return False
        if item is end:
            return True
        return type(end) in _EQUAL_TYPES and type(item) is type(end) and item == end

    def _iter_epoch(self) -> Iterator[Any]:
        get, timeout = self.queue.get, self.timeout
        while True:
            if timeout is None:
                item = get()
            else:
                try:
                    item = get(timeout=timeout)
                except _queue.Empty:
                    raise TimeoutError(f"DataFromQueue: nothing arrived on the queue for {timeout:g} s "
                                       "(timeout)") from None
            if self._is_end(item):
                return
            yield item


class MultiThreadPrefetchData(MultiThreadRunner):
    """``MultiThreadPrefetchData(get_df, num_prefetch, num_thread)``: tensorpack's older name of
    :class:`~bridgeflow.MultiThreadRunner`, which takes the same arguments in the same order.

    Example:
        >>> from bridgeflow import DataFromList
        >>> df = MultiThreadPrefetchData(lambda: DataFromList([[i] for i in range(3)]), 16, 4)
        >>> with df:
        ...     len(list(df))  # len(ds) datapoints per epoch, drawn from the four threads' copies
        3
    """
