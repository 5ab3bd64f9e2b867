"""to_tf_dataset: signature inference without losing the peeked datapoint, epochs, errors, Keras fit."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from bridgeflow import BatchData, DataFlow, DataFromGenerator, DataFromList, MapData
from bridgeflow._errors import DatapointError
from bridgeflow.testing import assert_same_datapoints
from conftest import need

need("tensorflow")

import tensorflow as tf

from bridgeflow.adapters.tensorflow import to_tf_dataset


class Counting(DataFlow):
    """Counts datapoints read, to prove the peeked one is not read twice."""

    def __init__(self, n: int) -> None:
        self.n, self.reads, self.resets = n, 0, 0

    def reset_state(self) -> None:
        self.resets += 1

    def __iter__(self):
        for i in range(self.n):
            self.reads += 1
            yield {"x": np.full(2, i, np.float32), "y": np.int32(i)}


def test_first_iteration_resumes_the_peeked_iterator():
    df = Counting(6)
    ds = to_tf_dataset(df)
    assert df.reads == 1 and df.resets == 1
    assert ds.element_spec["x"] == tf.TensorSpec([2], tf.float32, name="x")
    got = [{"x": d["x"].numpy(), "y": d["y"].numpy()} for d in ds]
    assert df.reads == 6, "the peeked datapoint was read twice"
    assert_same_datapoints(got, [{"x": np.full(2, i, np.float32), "y": np.int32(i)} for i in range(6)])
    # a second iteration is a new epoch of the flow
    assert [int(d["y"]) for d in ds] == list(range(6))
    assert df.reads == 12 and df.resets == 1


def test_one_shot_generator_loses_nothing_to_the_peek():
    gen = ((np.int64(i), np.float32(i) / 2) for i in range(5))
    ds = to_tf_dataset(DataFromGenerator(gen), prefetch=None)
    assert [(int(a), float(b)) for a, b in ds] == [(i, i / 2) for i in range(5)]


def test_explicit_signature_and_dynamic_batch():
    df = BatchData(DataFromList([[np.float32(i)] for i in range(10)], shuffle=False), 4, remainder=True)
    sizes = [int(b[0].shape[0]) for b in to_tf_dataset(df, dynamic_batch=True)]
    assert sizes == [4, 4, 2]
    spec = (tf.TensorSpec([None], tf.float32),)
    assert [int(b[0].shape[0]) for b in to_tf_dataset(df, output_signature=spec)] == [4, 4, 2]
    # by default the batch dimension is unknown because df batches with remainder=True
    assert [int(b[0].shape[0]) for b in to_tf_dataset(df)] == [4, 4, 2]
    with pytest.raises(tf.errors.InvalidArgumentError, match="shape"):
        list(to_tf_dataset(df, dynamic_batch=False))  # the last batch does not fit the first one's shape


def test_concurrent_iterations_of_one_flow_are_refused_with_bridgeflow_message():
    ds = to_tf_dataset(DataFromList([[np.int64(i)] for i in range(50)], shuffle=False), prefetch=None)
    first = iter(ds)
    next(first)
    with pytest.raises(tf.errors.OpError, match="already being iterated"):
        next(iter(ds))
    del first


def test_flow_error_message_reaches_the_dataset_consumer():
    def boom(dp):
        if dp[0] == 3:
            raise ValueError("cannot decode image 3")
        return dp

    ds = to_tf_dataset(MapData(DataFromList([[np.int64(i)] for i in range(6)], shuffle=False), boom))
    with pytest.raises(tf.errors.OpError, match="cannot decode image 3"):
        list(ds)


def test_bad_inputs_are_named():
    with pytest.raises(DatapointError, match="yielded no datapoint.*output_signature"):
        to_tf_dataset(DataFromList([], shuffle=False))
    with pytest.raises(TypeError, match="DataFlow or iterable"):
        to_tf_dataset(42)
    ds = to_tf_dataset(DataFromList([[np.int64(1)], [np.float32(2.5)]], shuffle=False))
    with pytest.raises(tf.errors.OpError, match="datapoint 1 component 0: dtype float32 does not fit"):
        list(ds)


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. Keras' "your input ran out of data"
def test_keras_fit_learns_from_a_dataflow():
    rng = np.random.RandomState(0)
    xs = rng.normal(size=(512, 8)).astype(np.float32)
    ys = (xs.sum(axis=1) > 0).astype(np.float32)
    seen = []

    def record(dp):
        seen.append(1)
        return dp

    df = BatchData(MapData(DataFromList(list(zip(xs, ys)), shuffle=True, seed=1), record), 64)
    model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="binary_crossentropy",
                  metrics=["accuracy"])
    ds = to_tf_dataset(df)
    assert int(ds.cardinality()) == 8  # len(df): Keras knows the steps per epoch
    hist = model.fit(ds, epochs=4, verbose=0, shuffle=False)  # the flow shuffles
    assert len(seen) == 4 * 512  # four epochs; the batch peeked for the signature is not read twice
    assert len(hist.history["loss"]) == 4
    assert hist.history["loss"][-1] < hist.history["loss"][0]
    assert hist.history["accuracy"][-1] > 0.8


def test_a_dataset_read_by_index_is_refused_saying_how_to_make_it_a_flow():
    class ByIndex:  # a torch map-style Dataset, to Python
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return [np.full(2, i)]

    with pytest.raises(TypeError, match=r"to_tf_dataset needs a DataFlow or iterable of datapoints, got ByIndex, "
                                        r"a dataset read by index .*DataFromList\(dataset, shuffle=False\)"):
        to_tf_dataset(ByIndex())
    got = [x[0].numpy().tolist() for x in to_tf_dataset(DataFromList(ByIndex(), shuffle=False))]
    assert got == [[0, 0], [1, 1]]
