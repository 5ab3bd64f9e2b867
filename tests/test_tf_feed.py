"""FeedInput (feed_dict / step arguments) and DummyConstantInput (constant tensors)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from bridgeflow import DataFromGenerator, DataFromList, MapData
from bridgeflow._errors import DatapointError
from conftest import need

need("tensorflow")

import tensorflow as tf

from bridgeflow.adapters.tensorflow import DummyConstantInput, FeedInput, InputSourceError


def points(n: int) -> list:
    return [{"x": np.full(3, i, np.float32), "y": np.int64(i)} for i in range(n)]


def test_graph_mode_feeds_every_datapoint_once():
    g = tf.Graph()
    with g.as_default():
        fi = FeedInput(DataFromList(points(7), shuffle=False))
        batch = fi.dequeue()
        assert fi.dequeue()["x"] is batch["x"]
        assert batch["x"].op.type == "Placeholder" and batch["x"].shape.as_list() == [3]
        total = tf.reduce_sum(batch["x"]) + tf.cast(batch["y"], tf.float32)
        got = []
        with tf.compat.v1.Session(graph=g) as sess, fi:
            steps = fi.run_until_end(total, sess=sess, callback=got.append)
    assert steps == 7 and got == [4.0 * i for i in range(7)]


def test_eager_passes_the_batch_to_the_step_and_loses_no_peeked_datapoint():
    gen = ((np.full(2, i, np.float32),) for i in range(5))  # one-shot: the peek must not lose item 0
    fi = FeedInput(DataFromGenerator(gen))
    assert fi.signature.shapes[0].as_list() == [2]

    @tf.function
    def step(batch):
        (x,) = batch
        return tf.reduce_sum(x)

    got = []
    with fi:
        assert fi.run_until_end(step, callback=lambda r: got.append(float(r))) == 5
        with pytest.raises(InputSourceError, match=r"step\(batch\)"):
            tf.function(fi.dequeue, autograph=False)()
    assert got == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_feed_errors_are_the_flows_own():
    def boom(dp):
        if dp["y"] == 2:
            raise RuntimeError("bad label file")
        return dp

    fi = FeedInput(MapData(DataFromList(points(4), shuffle=False), boom))
    with fi, pytest.raises(RuntimeError, match="bad label file"):
        fi.run_until_end(tf.function(lambda b: b["x"]))
    fi = FeedInput(DataFromList([[np.zeros(2)], [np.zeros(3)]], shuffle=False))
    with fi, pytest.raises(DatapointError, match=r"datapoint 1 component 0: shape \(3,\)"):
        fi.run_until_end(tf.function(lambda b: b[0]))
    with pytest.raises(DatapointError, match="signature="):
        FeedInput(DataFromList([], shuffle=False)).start()


def test_dummy_constant_input_in_both_modes():
    dummy = DummyConstantInput([[4, 3], [4]], ["float32", "int32"])
    x, y = dummy.dequeue()
    assert x.dtype == tf.float32 and y.dtype == tf.int32 and int(tf.reduce_sum(y)) == 0
    step = tf.function(lambda: tf.reduce_sum(dummy.dequeue()[0]))
    results = []
    assert dummy.run_until_end(step, max_steps=3, callback=results.append) == 3
    assert len({float(r) for r in results}) == 1 and float(results[0]) == pytest.approx(float(tf.reduce_sum(x)))
    with pytest.raises(ValueError, match="max_steps"):
        dummy.run_until_end(step)
    g = tf.Graph()
    with g.as_default():
        gx, _ = dummy.dequeue()
        with tf.compat.v1.Session(graph=g) as sess:
            assert dummy.run_until_end(tf.reduce_sum(gx), sess=sess, max_steps=2) == 2
            np.testing.assert_allclose(sess.run(gx), x.numpy())
    with pytest.raises(ValueError, match="2 dtypes for 1 shapes"):
        DummyConstantInput([[2]], ["float32", "int32"])
