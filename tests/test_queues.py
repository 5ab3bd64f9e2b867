"""DataFromQueue and MultiThreadPrefetchData (tensorpack's names) with real queues, threads and processes."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time

import numpy as np
import pytest

from bridgeflow import DataFromList, DataFromQueue, MultiThreadPrefetchData, MultiThreadRunner
from bridgeflow._errors import DataFlowReentrantError, LengthUnknownError


def test_endless_by_default_and_timeout_turns_silence_into_an_error():
    q = queue.Queue()
    for i in range(5):
        q.put([np.full(2, i), i])
    df = DataFromQueue(q, timeout=0.3)
    df.reset_state()
    it = iter(df)
    got = [next(it) for _ in range(5)]
    assert [dp[1] for dp in got] == list(range(5))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="0.3 s"):
        next(it)
    assert time.monotonic() - t0 >= 0.25
    with pytest.raises(LengthUnknownError):
        len(df)


def test_items_put_later_by_a_thread_arrive_in_order():
    q = queue.Queue(maxsize=2)

    def produce():
        for i in range(50):
            q.put([i])

    t = threading.Thread(target=produce)
    t.start()
    df = DataFromQueue(q)
    df.reset_state()
    it = iter(df)
    assert [next(it)[0] for _ in range(50)] == list(range(50))
    t.join()


def test_end_marker_by_identity_and_by_value_across_processes():
    sentinel = object()
    q = queue.Queue()
    for item in ([1], [2], sentinel, [3]):
        q.put(item)
    assert list(DataFromQueue(q, end=sentinel)) == [[1], [2]]
    assert q.get_nowait() == [3]  # nothing read past the end

    ctx = mp.get_context("fork")
    mq = ctx.Queue()
    p = ctx.Process(target=_put_all, args=(mq, [[i] for i in range(4)] + ["DONE"]))
    p.start()
    assert list(DataFromQueue(mq, end="DONE", timeout=30)) == [[0], [1], [2], [3]]  # "DONE" arrives as a copy
    p.join(10)
    assert p.exitcode == 0
    mq.close()
    mq.join_thread()


def _put_all(q, items):
    for item in items:
        q.put(item)


def test_bad_arguments_and_one_consumer():
    with pytest.raises(TypeError, match="get"):
        DataFromQueue([1, 2])
    with pytest.raises(ValueError, match="timeout"):
        DataFromQueue(queue.Queue(), timeout=0)
    q = queue.Queue()
    q.put([1])
    q.put([2])
    df = DataFromQueue(q, timeout=1)
    first = iter(df)
    next(first)
    with pytest.raises(DataFlowReentrantError):
        next(iter(df))


def test_multi_thread_prefetch_data_takes_tensorpacks_order(leak_check):
    make = lambda: DataFromList([[i] for i in range(6)], shuffle=False)
    df = MultiThreadPrefetchData(make, 8, 3)  # (get_df, num_prefetch, num_thread), as in tensorpack
    assert isinstance(df, MultiThreadRunner) and df.num_workers == 3 and df.num_prefetch == 8
    with df:
        df.reset_state()
        got = [dp[0] for dp in df]
    assert len(got) == 6 and set(got) <= set(range(6))  # a runner: len(ds) datapoints from all threads


def test_a_queue_cannot_resume_and_says_why():
    import queue

    from bridgeflow._state import NotResumableError

    q = queue.Queue()
    df = DataFromQueue(q)
    with pytest.raises(NotResumableError, match="items it took from the queue are gone"):
        df.state_dict()
