"""Canary for the private TensorFlow symbol the adapter uses (StagingArea)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

from conftest import need

need("tensorflow")

import tensorflow as tf

from bridgeflow.adapters.tensorflow._compat import default_device, staging_area_class


def test_staging_area_still_round_trips_in_tf_function_and_graph():
    area_cls = staging_area_class()

    @tf.function
    def put(x):
        area_cls([tf.float32, tf.int64], shared_name="bf_canary").put([x, tf.constant(7, tf.int64)])

    @tf.function
    def get():
        area = area_cls([tf.float32, tf.int64], shared_name="bf_canary")
        return area.get(), area.size()

    put(tf.constant([1.0, 2.0]))
    put(tf.constant([3.0, 4.0]))
    (x, y), size = get()
    # FIFO order, values intact, one left
    assert x.numpy().tolist() == [1.0, 2.0] and int(y) == 7 and int(size) == 1
    (x, _), size = get()
    assert x.numpy().tolist() == [3.0, 4.0] and int(size) == 0

    g = tf.Graph()
    with g.as_default():
        area = area_cls([tf.int32], shapes=[[2]])
        put_op = area.put([tf.constant(np.array([5, 6], np.int32))])
        got = area.get()
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(put_op)
            assert sess.run(got)[0].tolist() == [5, 6]


def test_default_device_places_tensors_on_an_existing_device():
    dev = default_device()
    assert dev in ("/gpu:0", "/cpu:0")
    with tf.device(dev):
        t = tf.identity(tf.constant([1.0]))
    assert t.device.endswith(dev.replace("/gpu", "GPU").replace("/cpu", "CPU"))
