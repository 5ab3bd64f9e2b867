"""Every loop shape tensorpack users write over QueueInput / StagingInput gets every datapoint exactly once.

100 samples in batches of 32 (the last one of 4), nr_stage 1 and 2: a hand loop until OutOfRangeError,
a fixed number of steps (``for _ in range(len(df))``, one epoch or several with ``epochs=None``),
``for batch in input``, ``run_until_end``, eager and graph mode; ``with StagingInput(...)`` starts it;
several inputs in one process print no retracing warning.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from bridgeflow import BatchData, DataFlow, DataFromList
from conftest import need

need("tensorflow")

import tensorflow as tf

from bridgeflow.adapters.tensorflow import FeedInput, InputSourceError, QueueInput, StagingInput, to_tf_dataset

N, BATCH = 100, 32


def batches(n: int = N) -> BatchData:
    return BatchData(DataFromList([[np.int64(i), np.full(3, i, np.float32)] for i in range(n)], shuffle=False),
                     BATCH, remainder=True)


def staged(nr_stage: int, **kwargs) -> StagingInput:
    return StagingInput(QueueInput(batches(), queue_size=3, **kwargs), nr_stage=nr_stage, device="/cpu:0")


class Step:
    """A training step as a callable object: one tf.function per input, traced once."""

    def __init__(self, inp) -> None:
        self.inp = inp

    def __call__(self):
        ids, x = self.inp.dequeue()
        return ids, tf.reduce_sum(x)


def make_step(inp):
    return tf.function(Step(inp))


def assert_each_once(ids: list) -> None:
    assert sorted(ids) == list(range(N)), f"got {len(ids)} ids, {len(set(ids))} distinct"


def ids_of(result) -> list:
    return [int(v) for v in result[0].numpy()]


@pytest.mark.parametrize("nr_stage", [1, 2])
def test_until_out_of_range_with_block_start(leak_check, nr_stage):
    si = staged(nr_stage)
    step = make_step(si)
    got = []
    with si:  # eager: the with block starts the input
        while True:
            try:
                got += ids_of(step())
            except tf.errors.OutOfRangeError:
                break
        with pytest.raises(tf.errors.OutOfRangeError):  # and it stays ended
            step()
        assert si.stats()["staged"] == 0
    assert_each_once(got)


@pytest.mark.parametrize("nr_stage", [1, 2])
def test_fixed_number_of_steps(leak_check, nr_stage):
    df = batches()
    si = StagingInput(QueueInput(df, queue_size=3), nr_stage=nr_stage, device="/cpu:0")
    step = make_step(si)
    got = []
    with si:
        for _ in range(len(df)):
            got += ids_of(step())
    assert len(df) == 4
    assert_each_once(got)


@pytest.mark.parametrize("nr_stage", [1, 2])
def test_fixed_steps_over_endless_epochs(leak_check, nr_stage):
    df = batches()
    si = StagingInput(QueueInput(df, queue_size=3, epochs=None), nr_stage=nr_stage, device="/cpu:0")
    step = make_step(si)
    with si:
        for _epoch in range(3):
            got = []
            for _ in range(len(df)):
                got += ids_of(step())
            assert_each_once(got)  # every epoch of steps is exactly one pass over the data


@pytest.mark.parametrize("nr_stage", [1, 2])
def test_iterating_the_input(leak_check, nr_stage):
    got = []
    with staged(nr_stage) as si:
        for ids, x in si:
            assert x.shape[1:] == (3,)
            got += [int(v) for v in ids.numpy()]
    assert_each_once(got)
    got = []
    with QueueInput(batches(), queue_size=3) as qi:
        for ids, _ in qi:
            got += [int(v) for v in ids.numpy()]
    assert_each_once(got)


@pytest.mark.parametrize("nr_stage", [1, 2])
def test_run_until_end(leak_check, nr_stage):
    si = staged(nr_stage)
    got = []
    with si:
        assert si.run_until_end(make_step(si), callback=lambda r: got.extend(ids_of(r))) == 4
    assert_each_once(got)


def test_start_without_with_and_explicit_start(leak_check):
    si = staged(2)
    si.start()
    step = make_step(si)
    got = []
    try:
        while True:
            got += ids_of(step())
    except tf.errors.OutOfRangeError:
        pass
    si.close()
    assert_each_once(got)


def test_queue_input_alone(leak_check):
    df = batches()
    qi = QueueInput(df, queue_size=3)
    step = make_step(qi)
    got = []
    with qi:
        for _ in range(len(df)):
            got += ids_of(step())
        with pytest.raises(tf.errors.OutOfRangeError):
            step()
    assert_each_once(got)
    qi = QueueInput(batches(), queue_size=3)
    step = make_step(qi)
    got = []
    with qi:
        while True:
            try:
                got += ids_of(step())
            except tf.errors.OutOfRangeError:
                break
    assert_each_once(got)


@pytest.mark.parametrize("nr_stage", [1, 2])
def test_graph_mode_loops(leak_check, nr_stage):
    g = tf.Graph()
    with g.as_default():
        si = staged(nr_stage)
        ids, x = si.dequeue()
        assert ids.shape.as_list() == [None]  # BatchData(remainder=True): the batch dimension is unknown
        train_op = tf.reduce_sum(x)
        with tf.compat.v1.Session(graph=g) as sess, si:
            si.start(sess)
            got = []
            while True:  # a hand-written loop of sess.run(train_op), as tensorpack's trainers run
                try:
                    got += sess.run([ids, train_op])[0].tolist()
                except tf.errors.OutOfRangeError:
                    break
            with pytest.raises(tf.errors.OutOfRangeError):
                sess.run(train_op)
            assert si.stats()["staged"] == 0 and si.stats()["steps"] == 4
    assert_each_once(got)
    g = tf.Graph()
    with g.as_default():
        df = batches()
        si = StagingInput(QueueInput(df, queue_size=3), nr_stage=nr_stage, device="/cpu:0")
        ids, _ = si.dequeue()
        with tf.compat.v1.Session(graph=g) as sess, si:
            si.start(sess)
            got = []
            for _ in range(len(df)):
                got += sess.run(ids).tolist()
            assert si.run_until_end(ids, sess=sess) == 0  # nothing left
    assert_each_once(got)


class FailsAfter(DataFlow):
    def __iter__(self):
        for i in range(3):
            yield [np.full(2, i, np.int64)]
        raise KeyError("record 3 is missing")


def test_flow_error_reaches_every_loop_shape(leak_check):
    si = StagingInput(QueueInput(FailsAfter()), nr_stage=2, device="/cpu:0")
    step = tf.function(lambda: si.dequeue()[0])
    got = []
    with pytest.raises(KeyError, match="record 3 is missing"), si:
        while True:  # the loop sees the end; the with block raises the flow's error
            try:
                got.append(int(step()[0]))
            except tf.errors.OutOfRangeError:
                break
    assert got == [0, 1, 2]
    with pytest.raises(KeyError, match="record 3 is missing"):
        for _ in StagingInput(QueueInput(FailsAfter()), nr_stage=1, device="/cpu:0"):
            pass


def test_several_inputs_print_no_retracing_warning(leak_check, caplog):
    with caplog.at_level(logging.WARNING):
        for _ in range(7):
            with staged(1) as si:
                assert sum(int(tf.size(ids)) for ids, _ in si) == N
            si = staged(2)
            with si:
                si.run_until_end(make_step(si))
    assert "retracing" not in caplog.text


def test_remainder_batches_fit_every_input(leak_check):
    with FeedInput(batches()) as fi:
        sizes = []
        fi.run_until_end(lambda batch: sizes.append(int(tf.size(batch[0]))))
    assert sizes == [32, 32, 32, 4]
    ds = to_tf_dataset(batches())
    assert [int(tf.size(ids)) for ids, _ in ds] == [32, 32, 32, 4]
    with QueueInput(batches(), dynamic_batch=False) as qi:  # asked for static shapes: the last batch is refused
        with pytest.raises(Exception, match="does not match the signature"):
            for _ in qi:
                pass


def test_misuse_is_explained():
    si = staged(1)
    with pytest.raises(InputSourceError, match=r"enter `with"):
        tf.function(lambda: si.dequeue(), autograph=False)()
    si.close()


@pytest.mark.parametrize("nr_stage", [1, 3])
def test_early_break_and_close_leave_no_thread(leak_check, nr_stage):
    si = StagingInput(QueueInput(batches(1000), queue_size=2), nr_stage=nr_stage, device="/cpu:0")
    with si:
        for _ in si:  # the staging thread is waiting for room in the area, the producer for room in the queue
            break
    assert not si._thread.alive


def test_graph_session_closed_before_the_input(leak_check):
    g = tf.Graph()
    with g.as_default():
        si = staged(2)
        ids, _ = si.dequeue()
        sess = tf.compat.v1.Session(graph=g)
        si.start(sess)
        assert len(sess.run(ids)) == BATCH
        sess.close()  # the staging thread is blocked in a put on this session
        si.close()
    assert not si._thread.alive
