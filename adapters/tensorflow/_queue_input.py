"""QueueInput: a TensorFlow FIFOQueue filled from a DataFlow by a background thread.

The training step dequeues tensors from the queue while a Python thread prepares the next datapoints,
so data preparation and training overlap and the throughput becomes that of the slower side. The
average fill of the queue tells which side that is: near empty means the input is the bottleneck, near
full means the model is.

Eager TF2 (the queue is used inside a ``tf.function`` step)::

    qi = QueueInput(BatchData(df, 256))

    @tf.function
    def step():
        x, y = qi.dequeue()
        ...

    with qi:
        steps = qi.run_until_end(step)   # OutOfRangeError at the end of the data is a normal end

Graph mode (``tf.compat.v1``)::

    with tf.Graph().as_default():
        x, y = qi.dequeue()              # the model is built on these tensors
        train_op = ...
        with tf.compat.v1.Session() as sess, qi:
            qi.start(sess)
            steps = qi.run_until_end(train_op, sess=sess)

End of data closes the queue: the consumer drains what is queued, then gets
``tf.errors.OutOfRangeError``. An exception in the flow closes the queue the same way and is re-raised,
with its own type and message, by ``run_until_end``, by eager ``dequeue()``/iteration, and by
``raise_if_failed()`` for hand-written loops; a ``with`` block that ends without having seen it (a
graph-mode loop that took the ``OutOfRangeError`` for the end of the data) raises it on exit, and the
producer logs it as a warning when it happens.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import tensorflow as tf

from bridgeflow import DatapointError
from bridgeflow.engine import Producer, not_a_flow

from ._flow import END, close_iterator, dynamic_batch_for, reset_once
from ._signature import Signature
from ._source import InputSource, InputSourceError, graph_mode, not_autographed

__all__ = ["QueueInput"]

log = logging.getLogger(__name__)

class QueueInput(InputSource):
    """Prefetch datapoints of ``df`` into a ``tf.queue.FIFOQueue`` of ``queue_size`` from a thread.

    Args:
        df: a DataFlow (or any iterable of datapoints); the thread calls its ``reset_state()`` if needed.
        queue_size: capacity of the queue, in datapoints (batches when ``df`` batches).
        signature: a tuple/list/dict of ``tf.TensorSpec``; inferred from the first datapoint when None.
        epochs: how many passes over ``df`` before the end of data; ``None`` repeats forever.
        dynamic_batch: with an inferred signature, leave the first dimension unknown (smaller last batch);
            None (default): unknown when ``df`` batches with ``remainder=True``.
        log_every_s: period of the INFO log line with the average queue fill; ``None`` turns it off.
        name: name scope of the graph ops and prefix of the log lines.
        join_timeout_s: how long ``close()`` waits for the thread (a flow stuck in ``next()``).
    """

    def __init__(self, df: Any, queue_size: int = 50, signature: Any = None, *, epochs: int | None = 1,
                 dynamic_batch: bool | None = None, log_every_s: float | None = 60.0, name: str = "QueueInput",
                 join_timeout_s: float = 10.0) -> None:
        if not hasattr(df, "__iter__"):
            raise not_a_flow(df, "QueueInput needs a DataFlow or iterable of datapoints")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"QueueInput queue_size must be a positive integer, got {queue_size!r}")
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"QueueInput epochs must be a positive integer or None, got {epochs!r}")
        if log_every_s is not None and log_every_s <= 0:
            raise ValueError(f"QueueInput log_every_s must be > 0 or None, got {log_every_s!r}")
        self.df = df
        self.queue_size = queue_size
        self.epochs = epochs
        self.dynamic_batch = dynamic_batch_for(df, dynamic_batch)
        self.log_every_s = log_every_s
        self.name = name
        self.join_timeout_s = join_timeout_s
        self._sig: Signature | None = None if signature is None else Signature.from_structure(signature)
        self._cv = threading.Condition()
        self._go = threading.Event()
        self._sig_ready = threading.Event()
        self._thread: Producer | None = None  # the producer thread, once started
        self._error: BaseException | None = None
        self._error_reported = False  # raised to the consumer at least once
        self._finished = False
        self._mode: str | None = None  # "eager" or "graph" once the queue exists
        self._queue: Any = None
        self._graph: Any = None
        self._sess: Any = None
        self._placeholders: list = []
        self._enqueue_op = self._close_op = self._size_op = None
        self._graph_calls: tuple | None = None  # Session callables of the producer (graph mode)
        # statistics (guarded by self._cv)
        self._enqueued = 0
        self._fill_sum = 0
        self._read_s = self._enqueue_s = self._consumer_s = 0.0
        self._dequeued_eager = 0
        self._window = [0, 0, time.monotonic()]  # items, fill sum, start of the log window

    # --- signature and graph construction -------------------------------------------------------
    @property
    def signature(self) -> Signature:
        """The datapoint's signature (waits for the first datapoint when it is inferred)."""
        if self._sig is not None:
            return self._sig
        self._ensure_thread()  # the thread reads the first datapoint
        while self._sig is None and not self._sig_ready.wait(0.1):
            pass
        if self._sig is None:
            self.raise_if_failed()
            raise InputSourceError(f"{self.name}: closed before the first datapoint came")
        return self._sig

    def _ensure_thread(self) -> None:
        if self._closed:
            raise InputSourceError(f"{self.name} is closed")
        if self._thread is None:
            if self._sig is not None:
                self._sig_ready.set()
            self._thread = Producer(functools.partial(_producer_loop, self), depth=0, name=f"bf-{self.name}")

    def _build(self, want_graph: bool) -> None:
        self._ensure_thread()
        sig = self.signature
        shapes = sig.shapes if sig.fully_defined() else None
        if want_graph:
            g = tf.compat.v1.get_default_graph()
            if self._mode == "eager":
                raise InputSourceError(f"{self.name} was first used in eager mode; make one per mode")
            if self._queue is not None:
                if g is not self._graph:
                    raise InputSourceError(f"{self.name}'s queue belongs to another graph")
                return
            with tf.name_scope(self.name):
                self._queue = tf.queue.FIFOQueue(self.queue_size, sig.dtypes, shapes=shapes, name="queue")
                self._placeholders = [tf.compat.v1.placeholder(s.dtype, s.shape, name=f"{s.name}_in")
                                      for s in sig.specs]
                self._enqueue_op = self._queue.enqueue(self._placeholders, name="enqueue")
                self._close_op = self._queue.close(cancel_pending_enqueues=True, name="close")
                self._size_op = self._queue.size(name="size")
            self._graph, self._mode = g, "graph"
            return
        if self._mode == "graph":
            raise InputSourceError(f"{self.name} was built in a tf.compat.v1 graph; use it there, "
                                   "with start(sess)")
        if self._queue is None:
            with tf.init_scope():
                self._queue = tf.queue.FIFOQueue(self.queue_size, sig.dtypes, shapes=shapes)
            self._mode = "eager"
        self._go.set()  # eager: nothing more to wait for

    @not_autographed
    def dequeue(self) -> tuple | dict:
        """Tensors of the next datapoint, as a tuple or dict like the datapoint.

        Inside a ``tf.function`` (or while building a graph) this adds a dequeue op; the eager producer
        starts at the first call. Called eagerly it returns the next values, and at the end of the data
        re-raises the flow's exception if there was one, else ``tf.errors.OutOfRangeError``.
        """
        self._build(graph_mode())
        sig = self.signature
        if tf.executing_eagerly():
            t0 = time.perf_counter()
            try:
                flat = self._queue.dequeue()
            except tf.errors.OutOfRangeError:
                self.raise_if_failed()
                raise
            with self._cv:
                self._consumer_s += time.perf_counter() - t0
                self._dequeued_eager += 1
            flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
            return sig.pack(flat)
        flat = self._queue.dequeue(name=f"{self.name}_dequeue" if self._mode == "graph" else None)
        flat = list(flat) if isinstance(flat, (list, tuple)) else [flat]
        return sig.pack(sig.set_shapes(flat))

    def start(self, sess: Any = None) -> None:
        """Let the thread fill the queue. Graph mode needs the Session that runs the graph."""
        if self._closed:
            raise InputSourceError(f"{self.name} is closed")
        if sess is not None or self._mode == "graph" or (self._mode is None and graph_mode()):
            if sess is None:
                raise InputSourceError(f"{self.name} is used in graph mode: call start(sess) with the "
                                       "Session")
            if self._sess is not None and sess is not self._sess:
                raise InputSourceError(f"{self.name} was started with another Session")
            with sess.graph.as_default():
                self._build(True)
            if sess.graph is not self._graph:
                raise InputSourceError(f"{self.name}: the Session runs another graph than the queue's")
            self._sess = sess
        else:
            self._build(False)
        self._go.set()

    def __iter__(self) -> Iterator[tuple | dict]:
        """Eager mode: yield datapoints as tensors until the data ends."""
        self.start()
        while True:
            try:
                yield self.dequeue()
            except tf.errors.OutOfRangeError:
                return

    def _dequeue_flat(self) -> list:
        """Eager: the next datapoint as a flat list of tensors, or ``OutOfRangeError`` at the end. For
        StagingInput's thread: the flow's error stays unreported, for the consumer's loop to raise."""
        self._build(False)
        flat = self._queue.dequeue()
        return list(flat) if isinstance(flat, (list, tuple)) else [flat]

    # --- errors, end and close ------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """Re-raise the flow's exception (same object, type and message) if the producer died of one."""
        if self._error is not None:
            self._error_reported = True
            raise self._error

    def _unreported_error(self) -> BaseException | None:
        return None if self._error_reported else self._error

    def wait_for_item(self, index: int, timeout: float | None = None) -> bool:
        """Wait until datapoint number ``index`` (0-based, counted since the start) was enqueued.

        Returns False when the data ends (or fails, or the input closes) before it: a consumer can learn
        whether a datapoint will come without taking it.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._enqueued <= index and not self._finished and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(0.1 if left is None else min(left, 0.1))
            return self._enqueued > index

    def _cancel_queue(self) -> None:
        """Close the queue, cancelling a blocked enqueue; queued items stay for the consumer to drain."""
        try:
            if self._mode == "eager":
                self._queue.close(cancel_pending_enqueues=True)
            elif self._mode == "graph" and self._sess is not None:
                self._sess.run(self._close_op)
        except (tf.errors.OpError, RuntimeError) as exc:  # a Session closed by the user already cancelled
            log.debug("%s: closing the queue: %s", self.name, exc)

    def close(self) -> None:
        """Stop the thread (a blocked enqueue is cancelled), join it and close the flow (its workers stop; a
        later ``QueueInput(df)`` or loop over it starts them again). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.stop.set()
        self._cancel_queue()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            if not self._thread.close(self.join_timeout_s):
                log.warning("%s: the producer thread did not stop within %.1fs (stuck in the flow's next()?)",
                            self.name, self.join_timeout_s)
        close = getattr(self.df, "close", None)
        if callable(close):
            close()

    # --- statistics -----------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters to find the bottleneck: average queue fill (sampled before each enqueue), items,
        seconds the producer spent reading the flow and waiting in enqueue (queue full), and seconds the
        consumer waited in eager ``dequeue()`` calls (steps in a ``tf.function`` cannot be timed apart)."""
        with self._cv:
            n = self._enqueued
            avg = self._fill_sum / n if n else 0.0
            return {
                "items": float(n),
                "queue_capacity": float(self.queue_size),
                "queue_fill_avg": avg,
                "queue_fill_frac": avg / self.queue_size,
                "producer_read_s": self._read_s,
                "producer_wait_s": self._enqueue_s,
                "consumer_wait_s": self._consumer_s,
                "consumer_eager_dequeues": float(self._dequeued_eager),
            }

    def _record(self, fill: int, read_s: float, enqueue_s: float) -> None:
        with self._cv:
            self._enqueued += 1
            self._fill_sum += fill
            self._read_s += read_s
            self._enqueue_s += enqueue_s
            self._window[0] += 1
            self._window[1] += fill
            self._cv.notify_all()
            now = time.monotonic()
            if self.log_every_s is None or now - self._window[2] < self.log_every_s:
                return
            items, fills, t0 = self._window
            self._window = [0, 0, now]
        log.info("%s: queue fill %.1f/%d on average over the last %.0fs (%d datapoints); near empty means "
                 "the input is the bottleneck", self.name, fills / items, self.queue_size, now - t0, items)


# --- the producer thread ------------------------------------------------------------------------

def _epochs(qi: QueueInput) -> Generator[tuple[Any, float], None, None]:
    """Datapoints of every epoch with the seconds spent reading each; the first is read before the
    queue exists, to infer the signature."""
    flow = qi.df
    reset_once(flow)
    epoch = 0
    while qi.epochs is None or epoch < qi.epochs:
        it = iter(flow)
        count = 0
        try:
            while True:
                t0 = time.perf_counter()
                dp = next(it, END)
                if dp is END:
                    break
                count += 1
                yield dp, time.perf_counter() - t0
        finally:
            close_iterator(it)
        if count == 0 and (qi._sig is None or qi.epochs is None):
            raise DatapointError(f"{qi.name}: {type(flow).__name__} yielded no datapoint in epoch {epoch}"
                                 + ("; pass signature= to allow an empty flow" if qi._sig is None else ""))
        epoch += 1


def _producer_loop(qi: QueueInput, thread: Any) -> None:
    """Infer the signature, wait for start, then enqueue every datapoint; close the queue at the end."""
    stop = thread.stop
    stream = _epochs(qi)
    try:
        first = next(stream, None)
        if qi._sig is None and first is not None:
            qi._sig = Signature.from_datapoint(first[0], qi.dynamic_batch, who=f"{qi.name}: first datapoint")
        qi._sig_ready.set()
        while not qi._go.wait(0.1):
            if stop.is_set():
                return
        pending = [first] if first is not None else []
        for dp, read_s in _chain(pending, stream):
            if stop.is_set():
                return
            _enqueue(qi, dp, read_s)
        log.info("%s: end of data after %d datapoints", qi.name, qi._enqueued)
    except BaseException as exc:
        if stop.is_set():
            log.debug("%s: producer stopped: %r", qi.name, exc)
        elif isinstance(exc, _ConsumerGone):
            log.debug("%s: the consumer's Session or queue went away: %s", qi.name, exc.__cause__)
        else:
            log.warning("%s: the flow raised %s: %s; the queue is closed, and the consumer's "
                        "run_until_end(), raise_if_failed() or with-block exit raises it", qi.name,
                        type(exc).__name__, exc)
            qi._error = exc
    finally:
        stream.close()
        if qi._queue is not None and qi._go.is_set():
            qi._cancel_queue()
        with qi._cv:
            qi._finished = True
            qi._cv.notify_all()
        qi._sig_ready.set()


class _ConsumerGone(Exception):
    """The enqueue failed because the queue was closed or its Session went away: no error of the flow."""


def _chain(first: list, rest: Iterator) -> Iterator:
    yield from first
    yield from rest


def _enqueue(qi: QueueInput, dp: Any, read_s: float) -> None:
    sig = qi._sig
    assert sig is not None  # the producer loop set it (from signature= or the first datapoint) before enqueuing
    arrays = sig.flatten(dp, who=f"{qi.name}: datapoint {qi._enqueued}")
    try:
        fill, enqueue_s = _enqueue_arrays(qi, arrays)
    except tf.errors.CancelledError as exc:  # the queue was closed under a pending enqueue
        raise _ConsumerGone() from exc
    except RuntimeError as exc:  # "Attempted to use a closed Session."
        if "Session" not in str(exc):
            raise
        raise _ConsumerGone() from exc
    qi._record(fill, read_s, enqueue_s)


def _enqueue_arrays(qi: QueueInput, arrays: list) -> tuple[int, float]:
    """The TensorFlow side of one enqueue; returns the queue fill before it and the seconds it waited."""
    if qi._mode == "graph":
        if qi._graph_calls is None:  # callables skip most of Session.run's per-call Python work
            sess = qi._sess
            qi._graph_calls = (sess.make_callable(qi._size_op),
                               sess.make_callable(qi._enqueue_op, feed_list=qi._placeholders))
        size, enqueue = qi._graph_calls
        fill = int(size())
        t0 = time.perf_counter()
        enqueue(*arrays)
    else:
        fill = int(qi._queue.size())
        t0 = time.perf_counter()
        qi._queue.enqueue(arrays)
    return fill, time.perf_counter() - t0
