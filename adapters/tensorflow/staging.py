"""StagingInput: keep ``nr_stage`` batches of another input already on the device.

Each step takes batch k from a TensorFlow ``StagingArea`` on the device and, in the same step, puts
batch k+nr_stage there, so the host-to-device copy of the next batch overlaps the current step (on a GPU
the copy runs beside the kernels). ``start()`` first puts ``nr_stage`` batches (the warm-up).

End of data without losing or repeating a batch: a put happens only when the wrapped input already
holds the batch to stage (QueueInput's ``wait_for_item``), so a step is never interrupted by the end
of the data; once the input is exhausted, the steps only take what is staged (the drain), and the
loop ends when the area is empty. :meth:`run_until_end` drives this; hand-written loops over endless
data work too, as long as ``start()`` ran before the first step.

Eager TF2::

    si = StagingInput(QueueInput(BatchData(df, 256)), nr_stage=1)

    @tf.function
    def step():
        x, y = si.dequeue()      # get batch k, stage batch k+1
        ...

    with si:
        si.run_until_end(step)   # start (warm-up), steps, drain

Graph mode: ``x, y = si.dequeue()`` while building, then ``si.start(sess)`` and
``si.run_until_end(train_op, sess=sess)``, which adds the put to each ``sess.run``.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import tensorflow as tf

from ._compat import default_device, staging_area_class
from .signature import Signature
from .source import InputSource, InputSourceError, graph_mode

__all__ = ["StagingInput"]

log = logging.getLogger(__name__)

_ids = itertools.count()


class StagingInput(InputSource):
    """Prefetch ``nr_stage`` batches of ``input`` onto ``device`` with a StagingArea.

    Args:
        input: the input to stage from (a QueueInput, or any InputSource; one without
            ``wait_for_item`` is treated as endless).
        nr_stage: batches kept on the device ahead of the step.
        device: where the area lives; default ``/gpu:0`` when TensorFlow sees a GPU, else ``/cpu:0``.
    """

    def __init__(self, input: InputSource, nr_stage: int = 1, device: str | None = None,
                 name: str = "StagingInput") -> None:
        if not callable(getattr(input, "dequeue", None)):
            raise TypeError(f"StagingInput wraps an input with dequeue() (e.g. QueueInput), got "
                            f"{type(input).__name__}")
        if isinstance(nr_stage, bool) or not isinstance(nr_stage, int) or nr_stage < 1:
            raise ValueError(f"StagingInput nr_stage must be a positive integer, got {nr_stage!r}")
        self.input = input
        self.nr_stage = nr_stage
        self._device = device
        self.name = name
        self._shared_name = f"bf_{name}_{next(_ids)}"
        self._area_cls = staging_area_class()
        self._mode: str | None = None
        self._started = False
        self._sess: Any = None
        self._staged = 0  # batches in the area
        self._taken = 0  # batches taken from the input (puts so far)
        self._steps = 0
        self._put_now = True
        self._flag: Any = None  # eager: tf.Variable deciding whether a step also stages
        self._warm_fn: Any = None
        self._graph_out: Any = None
        self._put_op = self._clear_op = None

    @property
    def device(self) -> str:
        if self._device is None:
            self._device = default_device()
        return self._device

    @property
    def signature(self) -> Signature:
        return self.input.signature

    def _area(self) -> Any:
        """A StagingArea object for the graph being built; all share one device resource by name."""
        with tf.device(self.device):
            return self._area_cls(self.signature.dtypes, shared_name=self._shared_name)

    def _flat_input(self) -> list:
        return self.signature.unpack(self.input.dequeue())

    # --- building -------------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def dequeue(self) -> tuple | dict:
        """The staged tensors of this step (on the device); also stages the next batch when there is one.

        Call it once per step inside a ``tf.function``, or once while building a graph (later calls in
        the same graph return the same tensors).
        """
        sig = self.signature
        if graph_mode():
            if self._mode == "eager":
                raise InputSourceError(f"{self.name} was first used in eager mode; make one per mode")
            if self._graph_out is None:
                area = self._area()
                flat_in = self._flat_input()
                with tf.device(self.device):
                    self._put_op = area.put(flat_in)
                    got = area.get()
                    self._clear_op = area.clear()
                got = list(got) if isinstance(got, (list, tuple)) else [got]
                self._graph_out = sig.pack(sig.set_shapes(got))
                self._mode = "graph"
            return self._graph_out
        if tf.executing_eagerly():
            raise InputSourceError(f"{self.name}.dequeue() works inside a tf.function step (TensorFlow's "
                                   "StagingArea get() fails in plain eager code)")
        if self._mode == "graph":
            raise InputSourceError(f"{self.name} was built in a tf.compat.v1 graph; use it there")
        if not self._started:
            raise InputSourceError(f"call {self.name}.start() (or run_until_end) before the first step: the "
                                   f"area must hold {self.nr_stage} batch(es) before a step takes one")
        area = self._area()
        with tf.device(self.device):
            got = area.get()
        got = list(got) if isinstance(got, (list, tuple)) else [got]

        def put() -> tf.Tensor:
            flat = self._flat_input()
            with tf.device(self.device):
                area.put(flat)
            return tf.constant(True)

        tf.cond(self._flag.read_value(), put, lambda: tf.constant(False))
        return sig.pack(sig.set_shapes(got))

    # --- running --------------------------------------------------------------------------------
    def _available(self, index: int) -> bool:
        wait = getattr(self.input, "wait_for_item", None)
        return True if wait is None else bool(wait(index))

    def start(self, sess: Any = None) -> None:
        """Start the wrapped input and stage ``nr_stage`` batches (fewer if the data is shorter)."""
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
        if not graph:
            self._mode = "eager"
            with tf.init_scope(), tf.device("/cpu:0"):
                self._flag = tf.Variable(True, trainable=False, name=f"{self.name}_put")

            @tf.function(autograph=False)
            def warm() -> None:
                flat = self._flat_input()
                area = self._area()
                with tf.device(self.device):
                    area.put(flat)

            self._warm_fn = warm
        for _ in range(self.nr_stage):
            if not self._available(self._taken):
                break
            if graph:
                sess.run(self._put_op)
            else:
                self._warm_fn()
            self._taken += 1
            self._staged += 1
        self._started = True
        log.debug("%s: staged %d batch(es) on %s", self.name, self._staged, self.device)

    def _before_step(self, sess: Any) -> bool:
        if self._staged == 0:
            return False
        put_now = self._available(self._taken)
        if put_now != self._put_now:
            self._put_now = put_now
            if self._flag is not None:
                self._flag.assign(put_now)
        return True

    def _run_kwargs(self) -> tuple[list, dict | None]:
        return ([self._put_op] if self._put_now else []), None

    def _after_step(self) -> None:
        self._staged -= 1
        self._steps += 1
        if self._put_now:
            self._staged += 1
            self._taken += 1

    def raise_if_failed(self) -> None:
        self.input.raise_if_failed()

    def _unreported_error(self) -> BaseException | None:
        unreported = getattr(self.input, "_unreported_error", None)
        return unreported() if unreported is not None else None

    def close(self) -> None:
        """Close the wrapped input and empty the staging area. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._staged and self._mode == "graph" and self._sess is not None:
                self._sess.run(self._clear_op)
            elif self._staged and self._mode == "eager":
                def clear() -> None:
                    self._area().clear()

                tf.function(clear, autograph=False)()
        except (tf.errors.OpError, RuntimeError) as exc:
            log.debug("%s: clearing the staging area: %s", self.name, exc)
        self.input.close()

    def stats(self) -> dict[str, float]:
        """The wrapped input's statistics plus the batches staged now and the steps run."""
        out = dict(self.input.stats())
        out.update({"staged": float(self._staged), "nr_stage": float(self.nr_stage),
                    "steps": float(self._steps)})
        return out
