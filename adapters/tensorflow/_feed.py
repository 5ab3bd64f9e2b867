"""FeedInput and DummyConstantInput: the two ends to compare the pipelined inputs with.

``FeedInput`` prepares each datapoint in the training thread and hands it to the step (``feed_dict`` in
graph mode, an argument of the ``tf.function`` in eager mode): preparation and training take turns,
which is what QueueInput avoids. ``DummyConstantInput`` gives the same constant tensors every step, so a
step costs only the model: the upper bound any input can reach.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from bridgeflow.engine import not_a_flow

from ._flow import END, close_iterator, dynamic_batch_for, peek, reset_once, with_first
from ._signature import Signature
from ._source import InputSource, InputSourceError, graph_mode, not_autographed

__all__ = ["DummyConstantInput", "FeedInput"]


class FeedInput(InputSource):
    """Feed each datapoint of ``df`` to the step from the training thread (no overlap).

    Graph mode: ``dequeue()`` returns placeholders to build the model on, and
    ``run_until_end(train_op, sess=sess)`` runs one ``sess.run`` per datapoint with a ``feed_dict``.
    Eager: ``run_until_end(step)`` calls ``step(batch)`` with the datapoint as tensors (a tuple or dict).

    Example:
        >>> import numpy as np
        >>> from bridgeflow import BatchData, DataFromList
        >>> df = DataFromList([[np.full(2, i, np.float32), i] for i in range(5)], shuffle=False)
        >>> sizes = []
        >>> fi = FeedInput(BatchData(df, 2, remainder=True))
        >>> fi.run_until_end(lambda batch: sizes.append(int(batch[1].shape[0])))  # usually a tf.function
        3
        >>> sizes
        [2, 2, 1]
    """

    def __init__(self, df: Any, signature: Any = None, *, dynamic_batch: bool | None = None) -> None:
        if not hasattr(df, "__iter__"):
            raise not_a_flow(df, "FeedInput needs a DataFlow or iterable of datapoints")
        self.df = df
        self.dynamic_batch = dynamic_batch_for(df, dynamic_batch)  # None: from BatchData(remainder=...)
        self._sig = None if signature is None else Signature.from_structure(signature)
        self._pending: tuple[Any, Iterator] | None = None
        self._it: Iterator | None = None
        self._placeholders: list | None = None
        self._graph: Any = None
        self._current: list = []  # the arrays of the datapoint of the step in progress
        self._steps = 0

    @property
    def signature(self) -> Signature:
        if self._sig is None:
            self._pending = peek(self.df, "FeedInput", "signature=")
            self._sig = Signature.from_datapoint(self._pending[0], self.dynamic_batch,
                                                 who="FeedInput: first datapoint")
        return self._sig

    @not_autographed
    def dequeue(self) -> tuple | dict:
        """Graph mode: the placeholders (the same ones for every call in one graph)."""
        sig = self.signature
        if not graph_mode():
            raise InputSourceError("FeedInput in eager mode passes each datapoint to the step: "
                                   "run_until_end(step) calls step(batch)")
        g = tf.compat.v1.get_default_graph()
        if self._placeholders is None:
            with tf.name_scope("FeedInput"):
                self._placeholders = [tf.compat.v1.placeholder(s.dtype, s.shape, name=s.name) for s in sig.specs]
            self._graph = g
        elif g is not self._graph:
            raise InputSourceError("FeedInput's placeholders belong to another graph")
        return sig.pack(self._placeholders)

    def start(self, sess: Any = None) -> None:
        if self._closed:
            raise InputSourceError("FeedInput is closed")
        if self._it is not None:
            return
        sig = self.signature
        if self._pending is not None:
            first, it = self._pending
            self._pending = None
            self._it = with_first(first, it)
        else:
            reset_once(self.df)
            self._it = iter(self.df)
        self._sig = sig

    def _before_step(self, sess: Any) -> bool:
        if self._it is None:
            raise InputSourceError("FeedInput: start() has not run")
        dp = next(self._it, END)
        if dp is END:
            return False
        self._current = self.signature.flatten(dp, who=f"FeedInput: datapoint {self._steps}")
        return True

    def _after_step(self) -> None:
        self._steps += 1

    def _run_kwargs(self) -> tuple[list, dict | None]:
        if self._placeholders is None:
            raise InputSourceError("FeedInput in graph mode: build the model on dequeue() first")
        return [], dict(zip(self._placeholders, self._current))

    def _call_step(self, step: Any, sess: Any) -> Any:
        if sess is None:
            batch = self.signature.pack([tf.convert_to_tensor(a) for a in self._current])
            return step(batch)
        return super()._call_step(step, sess)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        close_iterator(self._it)
        if self._pending is not None:
            close_iterator(self._pending[1])
        close = getattr(self.df, "close", None)
        if callable(close):
            close()

    def stats(self) -> dict[str, float]:
        return {"items": float(self._steps)}


class DummyConstantInput(InputSource):
    """The same constant tensors every step, to time the model alone (it never ends: pass max_steps).

    Args:
        shapes: one fully defined shape per component.
        dtypes: one dtype for all, or one per component. Float components hold fixed random normal
            values, integer and bool ones zeros.

    Example:
        >>> dummy = DummyConstantInput([[256, 1024], [256, 1]], ["float32", "int32"])
        >>> [(tuple(t.shape), t.dtype.name) for t in dummy.dequeue()]
        [((256, 1024), 'float32'), ((256, 1), 'int32')]
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Any = "float32", seed: int = 0) -> None:
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if not shapes or any(d < 0 for s in shapes for d in s):
            raise ValueError(f"DummyConstantInput needs one non-negative shape per component, got {shapes}")
        if isinstance(dtypes, (list, tuple)):
            if len(dtypes) != len(shapes):
                raise ValueError(f"DummyConstantInput got {len(dtypes)} dtypes for {len(shapes)} shapes")
        else:
            dtypes = [dtypes] * len(shapes)
        rng = np.random.RandomState(seed)
        self._values = []
        for shape, dtype in zip(shapes, dtypes):
            dt = tf.as_dtype(dtype)
            if dt.is_floating:
                self._values.append(rng.standard_normal(shape).astype(dt.as_numpy_dtype))
            else:
                self._values.append(np.zeros(shape, dt.as_numpy_dtype))
        self._sig = Signature(tuple(range(len(shapes))),
                              tuple(tf.TensorSpec(s, tf.as_dtype(d), name=f"input{i}")
                                    for i, (s, d) in enumerate(zip(shapes, dtypes))), False)
        self._eager: list | None = None
        self._graph_tensors: dict[Any, list] = {}
        self._steps = 0

    @property
    def signature(self) -> Signature:
        return self._sig

    @not_autographed
    def dequeue(self) -> tuple | dict:
        if graph_mode():
            g = tf.compat.v1.get_default_graph()
            if g not in self._graph_tensors:
                with tf.name_scope("DummyConstantInput"):
                    self._graph_tensors[g] = [tf.constant(v) for v in self._values]
            return self._sig.pack(self._graph_tensors[g])
        if self._eager is None:
            with tf.init_scope():  # identity runs on the default device: a GPU's memory when there is one
                self._eager = [tf.identity(tf.constant(v)) for v in self._values]
        return self._sig.pack(self._eager)

    def run_until_end(self, step: Any, sess: Any = None, max_steps: int | None = None,
                      callback: Any = None) -> int:
        if max_steps is None:
            raise ValueError("DummyConstantInput never ends: pass max_steps to run_until_end")
        return super().run_until_end(step, sess=sess, max_steps=max_steps, callback=callback)

    def _after_step(self) -> None:
        self._steps += 1

    def stats(self) -> dict[str, float]:
        return {"items": float(self._steps)}
