"""StagingInput: keep ``nr_stage`` batches of another input already on the device.

A background thread moves batches from the wrapped input (a QueueInput) into a TensorFlow
``StagingArea`` of capacity ``nr_stage`` on the device; each step takes one batch from the area, and the
thread refills it while the step runs, so the host-to-device copy of the next batches overlaps the
step. When the input's data ends, the thread raises an end-of-data flag and stages a marker behind the
last batch, then exits: a step that takes the marker, or finds the flag raised and the area empty,
raises ``tf.errors.OutOfRangeError``. Nothing runs in Python per step, and the end of the data never
interrupts a step that got a batch, so every loop shape gets every batch exactly once::

    si = StagingInput(QueueInput(BatchData(df, 256, remainder=True)), nr_stage=1)

    @tf.function
    def step():
        x, y = si.dequeue()      # the next staged batch
        ...

    with si:                     # eager: starts on entry (the thread stages nr_stage batches first)
        si.run_until_end(step)   # or: while True: try: step() except tf.errors.OutOfRangeError: break
                                 # or: for _ in range(len(df)): step()
    for x, y in StagingInput(QueueInput(df)):   # iterating yields the staged tensors
        ...

Graph mode: ``x, y = si.dequeue()`` while building, ``si.start(sess)``, then any loop of
``sess.run(train_op)`` (until ``OutOfRangeError``, or ``run_until_end(train_op, sess=sess)``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from bridgeflow.engine import Producer

from ._compat import default_device, staging_area_class
from ._signature import Signature
from ._source import InputSource, InputSourceError, graph_mode, not_autographed

__all__ = ["StagingInput"]

log = logging.getLogger(__name__)

_ids = itertools.count()


class _Stopped(Exception):
    """The staging thread was asked to stop while it waited for room in the area."""


class _Next:
    """What ``for x in si`` runs: one dequeue. A callable object rather than a function, so TensorFlow
    counts each StagingInput's traces apart (several inputs print no retracing warning)."""

    def __init__(self, si: StagingInput) -> None:
        self.si = si

    def __call__(self) -> tuple | dict:
        return self.si.dequeue()


class StagingInput(InputSource):
    """Prefetch ``nr_stage`` batches of ``input`` onto ``device`` with a StagingArea.

    Args:
        input: the input to stage from: a QueueInput, or any InputSource whose ``dequeue()`` works
            eagerly (DummyConstantInput).
        nr_stage: batches kept on the device ahead of the step.
        device: where the area lives; default ``/gpu:0`` when TensorFlow sees a GPU, else ``/cpu:0``.
        name: name scope of the graph ops and of the staging thread.
        join_timeout_s: how long ``close()`` waits for the staging thread.
    """

    def __init__(self, input: InputSource, nr_stage: int = 1, device: str | None = None,
                 name: str = "StagingInput", join_timeout_s: float = 10.0) -> None:
        if not callable(getattr(input, "dequeue", None)):
            raise TypeError(f"StagingInput wraps an input with dequeue() (e.g. QueueInput), got "
                            f"{type(input).__name__}")
        if isinstance(nr_stage, bool) or not isinstance(nr_stage, int) or nr_stage < 1:
            raise ValueError(f"StagingInput nr_stage must be a positive integer, got {nr_stage!r}")
        self.input = input
        self.nr_stage = nr_stage
        self._device = device
        self.name = name
        self.join_timeout_s = join_timeout_s
        self._shared_name = f"bf_{name}_{next(_ids)}"
        self._area_cls = staging_area_class()
        self._mode: str | None = None
        self._started = False
        self._sess: Any = None
        self._cv = threading.Condition()
        self._thread: Producer | None = None  # the staging thread, once started
        self._data_puts = 0  # batches staged so far
        self._marker_puts = 0  # end-of-data markers staged (or being staged) so far
        self._ended = False  # the input has no more data
        self._end_queue: Any = None  # a closed, empty queue: dequeuing it raises OutOfRangeError
        self._ended_var: Any = None  # True once the thread has staged its last batch
        self._graph_ops: dict[str, Any] = {}
        self._graph_out: Any = None
        self._next_fn: Any = None

    @property
    def device(self) -> str:
        if self._device is None:
            self._device = default_device()
        return self._device

    @property
    def signature(self) -> Signature:
        return self.input.signature

    def _area(self) -> Any:
        """A StagingArea object for the graph (or eager context) in use; all share one resource by name.
        Components: the datapoint's, then a bool that marks the end of the data."""
        with tf.device(self.device):
            return self._area_cls([*self.signature.dtypes, tf.bool], capacity=self.nr_stage,
                                  shared_name=self._shared_name)

    def _marker(self) -> list:
        """The end-of-data element: empty components of the right dtypes, and True."""
        values = []
        for spec in self.signature.specs:
            shape = [0 if d is None else d for d in spec.shape.as_list()] if spec.shape.rank is not None else [0]
            values.append(tf.fill(shape, "") if spec.dtype == tf.string else tf.zeros(shape, spec.dtype))
        return [*values, tf.constant(True)]

    def _new_flags(self) -> None:
        """The closed queue that raises OutOfRangeError in-graph, and the end-of-data flag."""
        self._end_queue = tf.queue.FIFOQueue(1, [tf.int32], shapes=[[]], name=f"{self.name}_end_of_data")
        with tf.device("/cpu:0"):
            self._ended_var = tf.Variable(False, trainable=False, name=f"{self.name}_ended")

    def _take(self) -> tuple | dict:
        """The ops of one step: OutOfRangeError if the data has ended and the area is empty, else get an
        element, and OutOfRangeError if it is the end marker."""
        sig = self.signature
        area, end_queue = self._area(), self._end_queue
        with tf.device(self.device):
            empty = tf.equal(area.size(), 0)
        done = tf.logical_and(self._ended_var.read_value(), empty)
        check = tf.cond(done, lambda: end_queue.dequeue(), lambda: tf.constant(0))
        with tf.control_dependencies([check]), tf.device(self.device):
            got = area.get()
        got = list(got) if isinstance(got, (list, tuple)) else [got]
        *flat, is_end = got
        check = tf.cond(is_end, lambda: end_queue.dequeue(), lambda: tf.constant(0))
        with tf.control_dependencies([check]), tf.device(self.device):
            flat = [tf.identity(t) for t in flat]
        return sig.pack(sig.set_shapes(flat))

    # --- building -------------------------------------------------------------------------------
    @not_autographed
    def dequeue(self) -> tuple | dict:
        """The staged tensors of this step (on the device).

        Call it once per step inside a ``tf.function``, or once while building a graph (later calls in
        the same graph return the same tensors). At the end of the data the step raises
        ``tf.errors.OutOfRangeError``.
        """
        if graph_mode():
            if self._mode == "eager":
                raise InputSourceError(f"{self.name} was first used in eager mode; make one per mode")
            if self._graph_out is None:
                self._build_graph()
            return self._graph_out
        if tf.executing_eagerly():
            raise InputSourceError(f"{self.name}.dequeue() works inside a tf.function step (TensorFlow's "
                                   "StagingArea get() fails in plain eager code); iterate the input to get "
                                   "batches eagerly")
        if self._mode == "graph":
            raise InputSourceError(f"{self.name} was built in a tf.compat.v1 graph; use it there")
        if not self._started:
            raise InputSourceError(f"call {self.name}.start(), enter `with {self.name}` or use run_until_end "
                                   f"before the first step: the area must hold {self.nr_stage} batch(es) before "
                                   "a step takes one")
        return self._take()

    def _build_graph(self) -> None:
        self._mode = "graph"
        with tf.name_scope(self.name):
            self._new_flags()
            flat_in = self.signature.unpack(self.input.dequeue())
            area = self._area()
            with tf.device(self.device):
                ops = {"put": area.put([*flat_in, tf.constant(False)]), "marker": area.put(self._marker()),
                       "clear": area.clear(), "size": area.size()}
            ops["close_end"] = self._end_queue.close()
            ops["init_ended"] = self._ended_var.initializer
            ops["set_ended"] = self._ended_var.assign(True)
            self._graph_ops = ops
            self._graph_out = self._take()

    # --- the staging thread ---------------------------------------------------------------------
    def _stage_loop(self, thread: Any) -> None:
        """Move batches into the area (each put waits while it is full); at the end of the data raise
        the flag, then stage the marker (it wakes a step waiting in get)."""
        stop = thread.stop
        try:
            if self._mode == "graph":
                sess, ops = self._sess, self._graph_ops

                free = 0  # puts known not to wait: this thread is the area's only producer

                def room() -> None:
                    # A StagingArea put that waits for room cannot be cancelled: a Session closed under it
                    # (before this input) waits for it forever. So wait here, where a closed Session raises
                    # and a stop is seen; the put itself then never waits.
                    nonlocal free
                    delay = 0.0001
                    while free <= 0:
                        free = self.nr_stage - int(sess.run(ops["size"]))
                        if free <= 0 and stop.wait(delay):
                            raise _Stopped
                        delay = min(2 * delay, 0.002)
                    free -= 1

                def put_data() -> None:
                    room()
                    sess.run(ops["put"])

                def put_marker() -> None:
                    room()
                    sess.run(ops["marker"])

                set_ended = lambda: sess.run(ops["set_ended"])
            else:
                area, marker, ended_var = self._area(), self._marker(), self._ended_var
                take = getattr(self.input, "_dequeue_flat", None) or (
                    lambda: self.signature.unpack(self.input.dequeue()))

                def put_data() -> None:
                    flat = take()
                    with tf.device(self.device):
                        area.put([*flat, tf.constant(False)])

                def put_marker() -> None:
                    with tf.device(self.device):
                        area.put(marker)

                def set_ended() -> None:
                    ended_var.assign(True)

            while not stop.is_set():
                try:
                    put_data()
                except tf.errors.OutOfRangeError:  # the input's data ended (or its flow failed)
                    break
                with self._cv:
                    self._data_puts += 1
                    self._cv.notify_all()
            if not stop.is_set():
                set_ended()
                with self._cv:
                    self._ended = True
                    self._cv.notify_all()
                with self._cv:  # counted before the put, so stats() never finds an uncounted marker staged
                    self._marker_puts += 1
                put_marker()
        except Exception as exc:  # the input was closed, its Session went away, or the input itself failed
            if stop.is_set():
                log.debug("%s: staging thread stopped: %r", self.name, exc)
            else:
                log.warning("%s: staging thread ended with %s: %s", self.name, type(exc).__name__, exc)
        finally:
            with self._cv:
                self._ended = True
                self._cv.notify_all()

    # --- running --------------------------------------------------------------------------------
    def start(self, sess: Any = None) -> None:
        """Start the wrapped input and the staging thread; returns once ``nr_stage`` batches are staged
        (or the data ended)."""
        if self._closed:
            raise InputSourceError(f"{self.name} is closed")
        if self._started:
            return
        graph = sess is not None or self._mode == "graph" or (self._mode is None and graph_mode())
        if graph:
            if sess is None:
                raise InputSourceError(f"{self.name} is used in graph mode: call start(sess) with the "
                                       "Session")
            if self._graph_out is None:
                with sess.graph.as_default():
                    self.dequeue()
            self._sess = sess
            self.input.start(sess)
            sess.run([self._graph_ops["close_end"], self._graph_ops["init_ended"]])
        else:
            self._mode = "eager"
            self.input.start()
            with tf.init_scope():
                self._new_flags()
                self._end_queue.close()
        self._thread = Producer(self._stage_loop, depth=0, name=f"bf-{self.name}")
        self._started = True
        with self._cv:
            while self._data_puts < self.nr_stage and not self._ended:
                self._cv.wait(0.1)
        log.debug("%s: staged %d batch(es) on %s", self.name, self._data_puts, self.device)

    def __enter__(self) -> StagingInput:
        if not graph_mode():  # graph mode needs the Session: start(sess)
            self.start()
        return self

    def __iter__(self) -> Iterator[tuple | dict]:
        """Eager mode: yield the staged batches as tensors until the data ends."""
        self.start()
        if self._next_fn is None:
            self._next_fn = tf.function(_Next(self), autograph=False)
        while True:
            try:
                out = self._next_fn()
            except tf.errors.OutOfRangeError:
                self.raise_if_failed()
                return
            yield out

    def raise_if_failed(self) -> None:
        self.input.raise_if_failed()

    def _unreported_error(self) -> BaseException | None:
        unreported = getattr(self.input, "_unreported_error", None)
        return unreported() if unreported is not None else None

    def _clear(self) -> None:
        try:
            if self._mode == "graph" and self._sess is not None:
                self._sess.run(self._graph_ops["clear"])
            elif self._mode == "eager":
                with tf.device(self.device):
                    self._area().clear()
        except (tf.errors.OpError, RuntimeError) as exc:  # a Session closed by the user already
            log.debug("%s: clearing the staging area: %s", self.name, exc)

    def close(self) -> None:
        """Stop the staging thread, empty the area and close the wrapped input. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.stop.set()
        self._clear()  # wakes a put waiting for room
        self.input.close()  # wakes a dequeue waiting for data
        if self._thread is not None:
            if not self._thread.close(self.join_timeout_s):
                log.warning("%s: the staging thread did not stop within %.1fs", self.name, self.join_timeout_s)
        self._clear()  # what it put before it saw the stop

    def _area_size(self) -> int | None:
        try:
            if self._mode == "graph" and self._sess is not None:
                return int(self._sess.run(self._graph_ops["size"]))
            if self._mode == "eager":
                with tf.device(self.device):
                    return int(self._area().size())
        except (tf.errors.OpError, RuntimeError):
            return None
        return None

    def stats(self) -> dict[str, float]:
        """The wrapped input's statistics plus ``staged`` (batches on the device now) and ``steps``
        (batches taken by steps)."""
        out = dict(self.input.stats())
        size = None if self._closed else self._area_size()
        with self._cv:
            data, markers = self._data_puts, self._marker_puts
        taken = data + markers - size if size is not None else data
        steps = min(max(taken, 0), data)
        out.update({"staged": float(data - steps), "nr_stage": float(self.nr_stage), "steps": float(steps)})
        return out
