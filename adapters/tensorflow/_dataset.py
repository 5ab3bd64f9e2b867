"""to_tf_dataset: a ``tf.data.Dataset`` over any DataFlow, for ``model.fit`` and ``tf.data`` pipelines.

Each iteration of the dataset (each Keras epoch) is one new epoch of the flow: ``iter(df)`` is called
again. One flow may be iterated by one consumer at a time, so two iterations of the same dataset that
overlap (two ``iter(ds)`` alive at once, or ``ds.concatenate(ds)`` with prefetching, or
``tf.data.Dataset.zip((ds, ds))``) make the second one fail with bridgeflow's
``DataFlowReentrantError`` message inside TensorFlow's error; build two flows (and two datasets) to read
the data twice at the same time.

Example:
    >>> import numpy as np
    >>> from bridgeflow import BatchData, DataFromList
    >>> df = DataFromList([[np.full(2, i, np.float32), i] for i in range(5)], shuffle=False)
    >>> ds = to_tf_dataset(BatchData(df, 2, remainder=True))  # then model.fit(ds, epochs=3)
    >>> [tuple(x.shape) for x, y in ds]  # the last, short batch fits: the batch dimension is None
    [(2, 2), (2, 2), (1, 2)]
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from bridgeflow.engine import not_a_flow

from ._flow import END, close_iterator, dynamic_batch_for, peek, reset_once
from ._signature import Signature

__all__ = ["to_tf_dataset"]

class _FlowGenerator:
    """The callable handed to ``from_generator``: a new epoch of the flow per call.

    When the signature was inferred, the first call resumes the iterator that was peeked (its first
    datapoint included), so nothing is read twice or lost.
    """

    def __init__(self, df: Any, sig: Signature, pending: tuple[Any, Iterator] | None) -> None:
        self.df = df
        self.sig = sig
        self._pending = pending
        self._lock = threading.Lock()

    def __call__(self) -> Iterator[tuple | dict]:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            first, it = pending
        else:
            reset_once(self.df)
            first, it = END, iter(self.df)
        sig, n = self.sig, 0
        try:
            if first is not END:
                yield sig.pack(sig.flatten(first, who="to_tf_dataset: datapoint 0"))
                n = 1
            for dp in it:
                yield sig.pack(sig.flatten(dp, who=f"to_tf_dataset: datapoint {n}"))
                n += 1
        finally:
            close_iterator(it)


def to_tf_dataset(df: Any, output_signature: Any = None, *, dynamic_batch: bool | None = None,
                  prefetch: int | None = tf.data.AUTOTUNE) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` yielding the datapoints of ``df`` (tuples, or dicts for dict datapoints).

    Args:
        df: a DataFlow, or any re-iterable of datapoints. It is not closed here: close it yourself.
        output_signature: a tuple/list/dict of ``tf.TensorSpec``. When None it is inferred from the first
            datapoint, which is read now (the flow is reset in this thread) and handed to the first
            iteration of the dataset, not read twice.
        dynamic_batch: with an inferred signature, leave the first dimension unknown so a smaller last
            batch (``BatchData(..., remainder=True)``) fits; None (default): when ``df`` batches that way.
        prefetch: buffer size of the final ``prefetch`` (``tf.data.AUTOTUNE`` by default); None for none.

    When ``len(df)`` is known the dataset's cardinality is set to it (Keras then knows the steps per
    epoch); a flow whose epoch differs from its ``len()`` then fails with TensorFlow's cardinality error.
    """
    if not hasattr(df, "__iter__"):
        raise not_a_flow(df, "to_tf_dataset needs a DataFlow or iterable of datapoints")
    pending = None
    if output_signature is None:
        pending = peek(df, "to_tf_dataset", "output_signature=")
        sig = Signature.from_datapoint(pending[0], dynamic_batch_for(df, dynamic_batch),
                                       who="to_tf_dataset: first datapoint")
    else:
        sig = Signature.from_structure(output_signature)
    ds = tf.data.Dataset.from_generator(_FlowGenerator(df, sig, pending), output_signature=sig.structure)
    try:
        length = len(df)
    except TypeError:  # LengthUnknownError, or an iterable without len()
        length = None
    if length is not None:
        # Keras then knows the steps per epoch (progress bar, no "ran out of data" warning)
        ds = ds.apply(tf.data.experimental.assert_cardinality(length))
    if prefetch is not None:
        ds = ds.prefetch(prefetch)
    return ds
