"""tensorpack's ZeroMQ forms: RemoteDataZMQ(addr1, addr2[, bind=True]) with connecting producers, and
send_dataflow_zmq(df, addr, hwm, format, bind), over real sockets with real producer processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

from bridgeflow import DataFromGenerator, DataFromList
from bridgeflow.remote import (
    ProducerError,
    ProducerLostError,
    RemoteConnectionError,
    RemoteDataZMQ,
    send_dataflow_zmq,
)
from bridgeflow.serialize import PickleNotAllowedError
from conftest import PROMPTLY_S, exit_with_parent, free_tcp

FORK = mp.get_context("fork")


def _produce(addr, n, base, *, bind=False, epochs=1, shape=(2, 3), delay=0.0, fail_at=None, **kw):
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()  # no orphans

    def gen():
        for i in range(n):
            if delay:
                time.sleep(delay)
            if i == fail_at:
                raise ValueError(f"bad record {i}")
            yield [np.full(shape, (base + i) % 251, np.uint8), base + i]

    send_dataflow_zmq(DataFromGenerator(gen, size=n), addr, 50, None, bind, epochs=epochs, heartbeat_s=0.2, **kw)


@pytest.fixture
def producers():
    procs = []

    def start(*args, **kwargs):
        p = FORK.Process(target=_produce, args=args, kwargs=kwargs, daemon=True)
        p.start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


def labels_by_producer(dps: list, bases: list[int], n: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {b: [] for b in bases}
    for img, label in dps:
        base = max(b for b in bases if b <= label)
        assert img.flat[0] == label % 251
        out[base].append(label)
    assert all(len(v) == n for v in out.values()), {b: len(v) for b, v in out.items()}
    return out


def test_two_address_form_binds_both_and_reads_every_producer(leak_check, producers, tmp_path):
    a, b = f"ipc://{tmp_path}/a.sock", free_tcp()
    with RemoteDataZMQ(a, b, bind=True, producers=3, timeout=10) as df:  # tensorpack: RemoteDataZMQ(addr1, addr2)
        assert df.addrs == [a, b] and df.bind
        df.reset_state()
        for base, addr in ((0, a), (1000, b), (2000, b)):  # two producers share b
            producers(addr, 40, base)
        got = list(df)  # ends when the three said their last pass
        by = labels_by_producer(got, [0, 1000, 2000], 40)
        assert all(v == sorted(v) for v in by.values())  # each producer's order is kept
        assert df.stats()["RemoteDataZMQ"]["producers"] == 0 and df.stats()["RemoteDataZMQ"]["datapoints"] == 120


def test_large_datapoints_of_producers_sharing_an_address_are_not_mixed(leak_check, producers, tmp_path):
    addr = f"ipc://{tmp_path}/big.sock"
    with RemoteDataZMQ(addr, bind=True, producers=2, timeout=20) as df:
        df.reset_state()
        for base in (0, 100):  # 3 MiB each: sent in 1 MiB pieces, interleaved on one socket
            producers(addr, 4, base, shape=(1024, 1024, 3))
        got = list(df)
    by = labels_by_producer(got, [0, 100], 4)
    for img, label in got:
        assert img.shape == (1024, 1024, 3) and (img == label % 251).all()
    assert by[0] == [0, 1, 2, 3] and by[100] == [100, 101, 102, 103]


def test_default_topology_two_addresses_connect_to_binding_producers(leak_check, producers, tmp_path):
    a, b = free_tcp(), f"ipc://{tmp_path}/b.sock"
    producers(a, 10, 0, bind=True)
    producers(b, 10, 500, bind=True)
    with RemoteDataZMQ(a, b, timeout=10) as df:  # bridgeflow's default: producers bind, this connects
        assert not df.bind
        df.reset_state()
        labels_by_producer(list(df), [0, 500], 10)


def test_without_a_producer_count_the_iteration_waits_and_then_says_what_to_do(leak_check, producers, tmp_path):
    addr = f"ipc://{tmp_path}/n.sock"
    with RemoteDataZMQ(addr, bind=True, timeout=3.0) as df:  # endless, as tensorpack's
        df.reset_state()
        producers(addr, 5, 0)
        it = iter(df)
        assert [next(it)[1] for _ in range(5)] == list(range(5))
        with pytest.raises(ProducerLostError, match=r"1 producer\(s\) finished: pass producers=N"):
            next(it)


def test_late_producers_are_waited_for(leak_check, producers, tmp_path):
    addr = f"ipc://{tmp_path}/late.sock"
    with RemoteDataZMQ(addr, bind=True, producers=2, timeout=10) as df:
        df.reset_state()
        producers(addr, 5, 0)
        it = iter(df)
        first = [next(it) for _ in range(5)]  # the first producer is done before the second starts
        producers(addr, 5, 100)
        rest = list(it)
    labels_by_producer(first + rest, [0, 100], 5)
    with pytest.raises(ValueError, match="bind=True"):
        RemoteDataZMQ(addr, producers=2)


def test_earlier_positional_hwm_still_means_hwm():
    df = RemoteDataZMQ("tcp://127.0.0.1:5555", 7)
    assert df.hwm == 7 and df.addrs == ["tcp://127.0.0.1:5555"]
    with pytest.raises(TypeError, match="addr2"):
        RemoteDataZMQ("tcp://127.0.0.1:5555", 7.5)
    with pytest.raises(TypeError, match="bind"):
        RemoteDataZMQ("tcp://127.0.0.1:5555", bind="yes")


def test_bound_consumer_names_a_killed_producer(leak_check, producers, tmp_path):
    addr = f"ipc://{tmp_path}/k.sock"
    with RemoteDataZMQ(addr, bind=True, timeout=3.0) as df:
        df.reset_state()
        slow = producers(addr, 1000, 0, delay=0.05)
        it = iter(df)
        first = [next(it) for _ in range(3)]
        os.kill(slow.pid, signal.SIGKILL)
        t0 = time.monotonic()
        n = len(first)
        with pytest.raises(ProducerLostError, match=r"producer [0-9a-f]{16}.*sent nothing") as info:
            for _ in it:
                n += 1
        assert time.monotonic() - t0 < PROMPTLY_S and info.value.addr.startswith(addr)
        assert [dp[1] for dp in first] == [0, 1, 2]
        assert f"(after {n:,} datapoints from it) sent nothing" in str(info.value)  # how far it got
        assert "and no end of its pass" in str(info.value)


def test_bound_consumer_without_producers_raises_after_timeout(leak_check, tmp_path):
    with RemoteDataZMQ(f"ipc://{tmp_path}/none.sock", bind=True, timeout=0.5) as df:
        df.reset_state()
        t0 = time.monotonic()
        with pytest.raises(ProducerLostError, match="no producer sent anything.*bind=False"):
            list(df)
        assert 0.4 < time.monotonic() - t0 < PROMPTLY_S


def test_bound_consumer_reports_a_producer_error(leak_check, producers, tmp_path):
    addr = f"ipc://{tmp_path}/e.sock"
    with RemoteDataZMQ(addr, bind=True, timeout=10) as df:
        df.reset_state()
        producers(addr, 10, 0, fail_at=4)
        with pytest.raises(ProducerError, match="bad record 4"):
            list(df)


def test_endless_producers_make_an_endless_iteration_as_in_tensorpack(leak_check, producers, tmp_path):
    addr = f"ipc://{tmp_path}/inf.sock"
    with RemoteDataZMQ(addr, bind=True, timeout=10) as df:
        df.reset_state()
        producers(addr, 5, 0, epochs=None)  # passes end, the iteration does not
        it = iter(df)
        labels = [next(it)[1] for _ in range(23)]
    assert labels == [i % 5 for i in range(23)]


def test_format_names_map_to_safe_codecs_and_pickle_needs_consent(leak_check, tmp_path):
    df = DataFromList([[1]])
    with pytest.raises(ValueError, match="zmq_ops.*not provided"):
        send_dataflow_zmq(df, "tcp://127.0.0.1:5000", format="zmq_ops")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        send_dataflow_zmq(df, "tcp://127.0.0.1:5000", format="pickle")
    with pytest.raises(ValueError, match="disagree"):
        send_dataflow_zmq(df, "tcp://127.0.0.1:5000", format="msgpack", codec="pickle")
    with pytest.raises(ValueError, match="unknown format"):
        send_dataflow_zmq(df, "tcp://127.0.0.1:5000", format="json")
    for fmt, allow, reader_allows in (("msgpack", False, False), ("pickle", True, True), ("pickle", True, False)):
        addr = f"ipc://{tmp_path}/{fmt}{reader_allows}.sock"
        sender = threading.Thread(target=send_dataflow_zmq, args=(DataFromList([[np.arange(3), "x"]]), addr),
                                  kwargs=dict(format=fmt, allow_pickle=allow, bind=False, send_timeout=10))
        with RemoteDataZMQ(addr, bind=True, producers=1, timeout=10, allow_pickle=reader_allows) as rdf:
            rdf.reset_state()
            sender.start()
            if fmt == "pickle" and not reader_allows:
                with pytest.raises(PickleNotAllowedError):
                    list(rdf)
            else:
                (arr, text), = list(rdf)
                assert arr.tolist() == [0, 1, 2] and text == "x"
        sender.join(15)
        assert not sender.is_alive()


def test_wildcards_are_refused_where_they_cannot_work():
    with pytest.raises(RemoteConnectionError, match="bind=True"):
        RemoteDataZMQ("tcp://*:5999").reset_state()  # tensorpack's bind address, given to a connecting consumer
    with pytest.raises(RemoteConnectionError, match="connect to.*wildcard"):
        send_dataflow_zmq(DataFromList([[1]]), "tcp://*:5999", bind=False)
