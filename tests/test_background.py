"""The background-thread primitive: Producer (bounded put that honours a stop, errors forwarded after the
items before them, join) and BackgroundIterator over it; every way of stopping leaves no thread."""

from __future__ import annotations

import gc
import queue
import threading
import time

import numpy as np
import pytest

from bridgeflow.engine import BackgroundIterator, Producer
from conftest import PROMPTLY_S, wait_for


def test_items_come_in_order_computed_in_the_background(leak_check):
    names = []

    def fn(x):
        names.append(threading.current_thread().name)
        return x * 2

    it = BackgroundIterator(range(50), fn, depth=3, name="bf-test")
    assert list(it) == [2 * i for i in range(50)]
    assert set(names) == {"bf-test"} and not it.alive
    assert list(it) == []  # exhausted stays exhausted


def test_it_runs_at_most_depth_items_ahead(leak_check):
    pulled = []

    def source():
        for i in range(100):
            pulled.append(i)
            yield i

    it = BackgroundIterator(source(), depth=2)
    assert next(it) == 0
    time.sleep(0.2)
    # one handed out, two waiting, one produced and blocked on the full queue
    assert len(pulled) <= 1 + 2 + 1
    it.close()
    assert not it.alive


@pytest.mark.parametrize("where", ["source", "fn"])
def test_an_error_arrives_after_the_items_before_it(where, leak_check):
    class ShardMissing(KeyError):
        pass

    def source():
        for i in range(5):
            if where == "source" and i == 3:
                raise ShardMissing("shard 3")
            yield i

    def fn(x):
        if where == "fn" and x == 3:
            raise ShardMissing("shard 3")
        return x

    it = BackgroundIterator(source(), fn)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ShardMissing, match="shard 3"):
        next(it)
    assert not it.alive
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("how", ["close", "with", "garbage"])
def test_stopping_early_joins_the_thread_and_closes_the_source(how, leak_check):
    closed = []

    def endless():
        try:
            i = 0
            while True:
                yield np.full(1000, i)
                i += 1
        finally:
            closed.append(threading.current_thread().name)

    if how == "with":
        with BackgroundIterator(endless(), name="bf-endless") as it:
            next(it)
    else:
        it = BackgroundIterator(endless(), name="bf-endless")
        next(it)
        if how == "close":
            it.close()
        else:
            del it
            gc.collect()
    assert wait_for(lambda: closed == ["bf-endless"])
    assert not any(t.name == "bf-endless" for t in threading.enumerate())


def test_close_source_false_leaves_the_source_open(leak_check):
    class Source:
        closed = False

        def __iter__(self):
            return self

        def __next__(self):
            return 1

        def close(self):
            self.closed = True

    src = Source()
    it = BackgroundIterator(src, close_source=False)
    next(it)
    it.close()
    assert not src.closed


def test_len_and_bad_depth():
    it = BackgroundIterator([1, 2, 3])
    assert len(it) == 3
    it.close()
    with pytest.raises(ValueError, match="depth should be a positive integer"):
        BackgroundIterator([1], depth=0)


# --- Producer -------------------------------------------------------------------------------------------

def test_a_put_blocked_on_a_full_queue_gives_up_at_a_stop(leak_check):
    returned = []

    def produce(p):
        for i in range(100):
            if not p.put(i):
                returned.append(i)
                return

    producer = Producer(produce, depth=1, name="bf-full")
    assert producer.get() == 0
    time.sleep(0.1)  # item 1 queued, item 2 blocked on the full queue
    assert producer.close(timeout=PROMPTLY_S)
    assert returned and returned[0] < 100 and not producer.alive  # the blocked put (or the next) gives up


def test_the_error_comes_after_the_items_before_it_and_is_kept(leak_check):
    class Broken(OSError):
        pass

    def produce(p):
        p.put("a")
        p.put("b")
        raise Broken("socket gone")

    producer = Producer(produce, depth=4, name="bf-broken")
    assert [producer.get(), producer.get()] == ["a", "b"]
    with pytest.raises(Broken, match="socket gone"):
        producer.get()
    assert isinstance(producer.error, Broken) and not producer.alive
    with pytest.raises(StopIteration):
        producer.get()


def test_a_producer_without_a_queue_keeps_its_error_and_honours_the_stop(leak_check):
    steps = []

    def produce(p):
        while not p.stop.wait(0.01):
            steps.append(1)
        raise KeyError("after the stop")

    producer = Producer(produce, depth=0, name="bf-noqueue")
    assert wait_for(lambda: len(steps) >= 2)
    assert producer.close(timeout=PROMPTLY_S)
    assert isinstance(producer.error, KeyError)
    with pytest.raises(StopIteration):
        producer.get()


def test_get_with_a_timeout_and_a_close_that_times_out(leak_check):
    release = threading.Event()

    def produce(p):
        release.wait()
        p.put(1)

    producer = Producer(produce, depth=1, name="bf-slow")
    with pytest.raises(queue.Empty):
        producer.get(timeout=0.05)
    assert producer.close(timeout=0.1) is False and producer.alive  # still inside produce
    release.set()
    assert wait_for(lambda: not producer.alive)
    assert producer.close() is True


def test_a_producer_closing_itself_does_not_join_itself(leak_check):
    holder, ready = [], threading.Event()

    def produce(p):
        ready.wait()
        holder[0].close()
        p.put("never taken")

    producer = Producer(produce, depth=1, name="bf-self")
    holder.append(producer)
    ready.set()
    assert wait_for(lambda: not producer.alive)
    assert producer.error is None


def test_a_dropped_producer_stops_its_thread(leak_check):
    def produce(p):
        i = 0
        while p.put(np.zeros(1000) + i):
            i += 1

    producer = Producer(produce, depth=2, name="bf-dropped")
    producer.get()
    del producer
    gc.collect()
    assert wait_for(lambda: not any(t.name == "bf-dropped" for t in threading.enumerate()))


def test_bad_depth_is_named():
    with pytest.raises(ValueError, match="bf-x: depth should be an integer >= 0"):
        Producer(lambda p: None, depth=-1, name="bf-x")
