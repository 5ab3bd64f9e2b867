"""QueueInput: eager tf.function steps and tf.compat.v1 graph mode, end of data, errors, close, stats."""

from __future__ import annotations

import logging
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from bridgeflow import BatchData, DataFlow, DataFromList, FakeData, MapData, MultiProcessMapData
from bridgeflow._errors import DatapointError
from bridgeflow.testing import assert_same_datapoints
from conftest import PROMPTLY_S, need

need("tensorflow")

import tensorflow as tf

from bridgeflow.adapters.tensorflow import InputSourceError, QueueInput


def tuple_points(n: int) -> list:
    return [(np.full((2, 3), i, np.float32), np.int64(i)) for i in range(n)]


def as_numpy(structure):
    if isinstance(structure, dict):
        return {k: v.numpy() if hasattr(v, "numpy") else v for k, v in structure.items()}
    return tuple(v.numpy() if hasattr(v, "numpy") else v for v in structure)


class Failing(DataFlow):
    """Yields ``good`` datapoints, then raises."""

    def __init__(self, good: int) -> None:
        self.good = good

    def __iter__(self):
        for i in range(self.good):
            yield [np.float32(i)]
        raise ValueError(f"corrupt record after {self.good} datapoints")


class ResetRecorder(DataFromList):
    def reset_state(self) -> None:
        super().reset_state()
        self.reset_thread = threading.current_thread().name


def test_eager_tf_function_gets_every_datapoint_in_order(leak_check):
    points = tuple_points(23)
    qi = QueueInput(DataFromList(points, shuffle=False), queue_size=4)

    @tf.function
    def step():
        x, y = qi.dequeue()
        assert x.shape.as_list() == [2, 3]  # static shape from the first datapoint
        return x, y

    got = []
    with qi:
        n = qi.run_until_end(step, callback=lambda r: got.append(as_numpy(r)))
        # after the end, a step gets OutOfRangeError (the queue is closed and drained)
        with pytest.raises(tf.errors.OutOfRangeError):
            step()
    assert n == 23
    assert_same_datapoints(got, points)
    assert qi.stats()["items"] == 23


def test_eager_iteration_of_dict_datapoints(leak_check):
    points = [{"img": np.full((4,), i, np.uint8), "label": i, "name": f"n{i}"} for i in range(9)]
    with QueueInput(DataFromList(points, shuffle=False), queue_size=3) as qi:
        got = []
        for batch in qi:
            assert isinstance(batch, dict) and list(batch) == ["img", "label", "name"]
            got.append({"img": batch["img"].numpy(), "label": int(batch["label"]),
                        "name": batch["name"].numpy().decode()})
    assert_same_datapoints(got, points)


def test_a_second_queue_input_over_the_same_flow_reads_it_again(leak_check):
    """``with QueueInput(df)`` closes ``df`` when the block ends (its workers stop); a second ``QueueInput(df)``
    starts them again (it used to fail: the stage was closed)."""
    points = tuple_points(9)
    df = MultiProcessMapData(DataFromList(points, shuffle=False), 2, tuple, start_method="fork")
    for _ in range(2):
        with QueueInput(df, queue_size=3) as qi:
            got = [as_numpy(dp) for dp in qi]
        assert_same_datapoints(got, points)


def test_graph_mode_session_gets_every_datapoint(leak_check):
    points = tuple_points(17)
    g = tf.Graph()
    with g.as_default():
        qi = QueueInput(DataFromList(points, shuffle=False), queue_size=5)
        x, y = qi.dequeue()
        assert x.shape.as_list() == [2, 3]
        total = tf.reduce_sum(x)
        got = []
        with tf.compat.v1.Session(graph=g) as sess, qi:
            qi.start(sess)
            n = qi.run_until_end([x, y, total], sess=sess, callback=lambda r: got.append((r[0], r[1])))
    assert n == 17
    assert_same_datapoints(got, points)


def test_graph_mode_needs_a_session():
    g = tf.Graph()
    with g.as_default():
        qi = QueueInput(DataFromList(tuple_points(3), shuffle=False), signature=(
            tf.TensorSpec([2, 3], tf.float32), tf.TensorSpec([], tf.int64)))
        qi.dequeue()
        with qi, pytest.raises(InputSourceError, match=r"start\(sess\)"):
            qi.start()


def test_flow_exception_reaches_the_eager_loop_with_its_message(leak_check):
    qi = QueueInput(Failing(5), queue_size=2)

    @tf.function
    def step():
        return qi.dequeue()[0]

    got = []
    with qi, pytest.raises(ValueError, match="corrupt record after 5 datapoints"):
        qi.run_until_end(step, callback=lambda r: got.append(float(r)))
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]  # what came before the error was delivered


def test_flow_exception_reaches_eager_dequeue_and_graph_mode(leak_check):
    with QueueInput(Failing(2)) as qi:
        assert [float(qi.dequeue()[0]) for _ in range(2)] == [0.0, 1.0]
        with pytest.raises(ValueError, match="corrupt record"):
            qi.dequeue()
    g = tf.Graph()
    with g.as_default():
        qi = QueueInput(Failing(3))
        v = qi.dequeue()[0]
        with tf.compat.v1.Session(graph=g) as sess, qi:
            qi.start(sess)
            with pytest.raises(ValueError, match="corrupt record after 3"):
                qi.run_until_end(v, sess=sess)


def test_bad_datapoint_against_signature_names_the_component(leak_check):
    points = [[np.zeros(3, np.float32)], [np.zeros(3, np.float32)], [np.zeros(4, np.float32)]]
    with QueueInput(DataFromList(points, shuffle=False)) as qi:
        with pytest.raises(DatapointError, match=r"datapoint 2 component 0: shape \(4,\)"):
            for _ in qi:
                pass


def test_close_with_the_producer_blocked_on_a_full_queue(leak_check):
    qi = QueueInput(FakeData([[64]], size=None), queue_size=2)
    qi.start()
    first = qi.dequeue()
    assert first[0].shape == (64,)
    # the producer fills the queue again and then blocks in enqueue
    assert qi.wait_for_item(2, timeout=10)
    time.sleep(0.05)
    assert qi._thread.alive
    t0 = time.monotonic()
    qi.close()
    assert not qi._thread.alive, "the blocked producer was not woken by close()"
    assert time.monotonic() - t0 < qi.join_timeout_s
    qi.close()  # idempotent
    with pytest.raises(InputSourceError, match="closed"):
        qi.start()


def test_close_before_start_and_session_closed_first(leak_check):
    qi = QueueInput(DataFromList(tuple_points(100), shuffle=False), queue_size=2)
    assert qi.signature.dtypes == [tf.float32, tf.int64]  # producer running, waiting for start
    qi.close()
    assert qi.signature.shapes[0].as_list() == [2, 3]  # still known after close
    with pytest.raises(InputSourceError, match="closed"):
        qi.dequeue()
    g = tf.Graph()
    with g.as_default():
        qi = QueueInput(FakeData([[8]], size=None), queue_size=2)
        x = qi.dequeue()[0]
        with tf.compat.v1.Session(graph=g) as sess:
            qi.start(sess)
            sess.run(x)
        # the Session closed under a blocked producer: close() still returns promptly
        qi.close()


def test_epochs_reset_in_the_producer_thread_and_dynamic_batch(leak_check):
    df = ResetRecorder([[np.full(2, i, np.int32)] for i in range(10)], shuffle=False)
    with QueueInput(BatchData(df, 4, remainder=True), epochs=2, dynamic_batch=True) as qi:
        sizes = [int(b[0].shape[0]) for b in qi]
    assert sizes == [4, 4, 2] * 2
    assert df.reset_thread == "bf-QueueInput"


def test_empty_flow_needs_a_signature(leak_check):
    with QueueInput(DataFromList([], shuffle=False)) as qi:
        with pytest.raises(DatapointError, match="yielded no datapoint.*signature="):
            qi.dequeue()
    spec = (tf.TensorSpec([3], tf.float32),)
    with QueueInput(DataFromList([], shuffle=False), signature=spec) as qi:
        assert qi.run_until_end(tf.function(lambda: qi.dequeue())) == 0


def test_queue_fill_shows_which_side_is_slow(leak_check, caplog):
    # slow consumer: the queue stays nearly full
    with QueueInput(FakeData([[4]], size=40), queue_size=8) as qi:
        qi.start()
        assert qi.wait_for_item(7, timeout=10)
        for _ in qi:
            time.sleep(0.005)
        full = qi.stats()
    assert full["queue_fill_frac"] > 0.5
    # slow producer: the queue stays nearly empty, and the periodic log line says so
    slow = MapData(FakeData([[4]], size=15), lambda dp: (time.sleep(0.02), dp)[1])
    with caplog.at_level(logging.INFO, logger="bridgeflow.adapters.tensorflow._queue_input"):
        with QueueInput(slow, queue_size=8, log_every_s=0.02) as qi:
            assert sum(1 for _ in qi) == 15
            empty = qi.stats()
    assert empty["queue_fill_avg"] < 1.0
    assert empty["producer_read_s"] > 0.1 and empty["consumer_wait_s"] > 0.05
    assert any("queue fill" in r.getMessage() for r in caplog.records)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="queue_size"):
        QueueInput(DataFromList([[1]]), queue_size=0)
    with pytest.raises(ValueError, match="epochs"):
        QueueInput(DataFromList([[1]]), epochs=0)
    with pytest.raises(TypeError, match="DataFlow or iterable"):
        QueueInput(3)
    qi = QueueInput(DataFromList([[1]]))
    with pytest.raises(ValueError, match="max_steps"):
        qi.run_until_end(lambda: None, max_steps=-1)
    qi.close()


class FailingWith(DataFlow):
    """Yields ``good`` datapoints, then raises ``error``."""

    def __init__(self, good: int, error: BaseException) -> None:
        self.good, self.error = good, error

    def __iter__(self):
        for i in range(self.good):
            yield [np.float32(i)]
        raise self.error


def test_flow_error_that_mentions_a_session_is_still_the_flows_error(leak_check):
    """Only the enqueue's own failures (queue closed, Session closed) mean the consumer went away; an error
    of the flow is never taken for one, whatever its message says."""
    qi = QueueInput(FailingWith(3, RuntimeError("Session token expired for s3://bucket")))
    step = tf.function(lambda: qi.dequeue()[0])
    with qi, pytest.raises(RuntimeError, match="Session token expired"):
        qi.run_until_end(step)


def test_hand_written_graph_loop_gets_the_flow_error_when_the_with_block_ends(leak_check, caplog):
    """A graph loop that takes the closed queue's OutOfRangeError for the end of the data still learns of
    the flow's error: leaving the ``with`` block raises it, and the producer logged it as a warning."""
    g = tf.Graph()
    with g.as_default():
        qi = QueueInput(FailingWith(4, ValueError("record 4 is corrupt")), queue_size=2)
        x = qi.dequeue()[0]
        seen = []
        with caplog.at_level(logging.WARNING, logger="bridgeflow.adapters.tensorflow._queue_input"):
            with tf.compat.v1.Session(graph=g) as sess, pytest.raises(ValueError, match="record 4 is corrupt"):
                with qi:
                    qi.start(sess)
                    try:
                        while True:
                            seen.append(float(sess.run(x)))
                    except tf.errors.OutOfRangeError:
                        pass  # "end of data"
    assert seen == [0.0, 1.0, 2.0, 3.0]
    assert any("record 4 is corrupt" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    # an uncaught OutOfRangeError leaving the block is replaced by the flow's error too
    qi = QueueInput(FailingWith(1, KeyError("index entry 1")))
    with pytest.raises(KeyError, match="index entry 1") as info:
        with qi:
            qi.dequeue()
            qi._thread.join(10)
            raise tf.errors.OutOfRangeError(None, None, "queue closed")
    assert isinstance(info.value.__context__, tf.errors.OutOfRangeError)
    # once the loop has seen the error, leaving the block does not raise it again
    with QueueInput(FailingWith(0, KeyError("first"))) as qi:
        with pytest.raises(KeyError):
            qi.dequeue()


def test_graph_close_with_the_producer_blocked_and_the_session_open(leak_check):
    g = tf.Graph()
    with g.as_default():
        qi = QueueInput(FakeData([[16]], size=None), queue_size=3)
        x = qi.dequeue()[0]
        with tf.compat.v1.Session(graph=g) as sess:
            qi.start(sess)
            assert sess.run(x).shape == (16,)
            assert qi.wait_for_item(3, timeout=10)  # queue full again: the producer blocks in enqueue
            time.sleep(0.05)
            assert qi._thread.alive
            t0 = time.monotonic()
            qi.close()
            assert time.monotonic() - t0 < PROMPTLY_S and not qi._thread.alive
            drained = 0
            with pytest.raises(tf.errors.OutOfRangeError):
                while True:
                    sess.run(x)
                    drained += 1
            assert drained == 3  # what was queued stays for the consumer, then the end
