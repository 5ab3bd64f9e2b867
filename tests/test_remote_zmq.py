"""RemoteDataZMQ and send_dataflow_zmq over real sockets (127.0.0.1 and ipc://) with real producer processes."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from bridgeflow import DataFromGenerator, DataFromList
from bridgeflow.remote import (
    MessageTooLargeError,
    ProducerError,
    ProducerLostError,
    RemoteConnectionError,
    RemoteDataZMQ,
    send_dataflow_zmq,
)
from bridgeflow.remote._zmq_flow import _QUEUE_DEPTH
from bridgeflow.serialize import PickleNotAllowedError, encode_frames
from bridgeflow.testing import assert_same_datapoints, check_dataflow
from conftest import PROMPTLY_S, exit_with_parent, free_tcp, wait_for

FORK = mp.get_context("fork")


def expected(base: int, n: int, shape=(2, 3)) -> list:
    return [[np.full(shape, (base + i) % 251, np.uint8), base + i] for i in range(n)]


def _produce(addr, n, base, epochs, delay=0.0, shape=(2, 3), counter=None, hwm=50, fail_at=None, codec="bridgeflow"):
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()  # no orphans
    def gen():
        for i in range(n):
            if delay:
                time.sleep(delay)
            if i == fail_at:
                raise ValueError(f"bad record {i}")
            if counter is not None:
                with counter.get_lock():
                    counter.value += 1
            yield [np.full(shape, (base + i) % 251, np.uint8), base + i]

    send_dataflow_zmq(DataFromGenerator(gen, size=n), addr, hwm=hwm, codec=codec, epochs=epochs, heartbeat_s=0.2)


@pytest.fixture
def producers():
    """Start producer processes with ``start(addr, n, base, epochs, **kw)``; all are killed at teardown."""
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


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_tcp_one_producer_in_order_and_contract(leak_check, producers):
    addr = free_tcp()
    producers(addr, 30, 0, 3)  # check_dataflow reads two epochs and starts a third
    df = RemoteDataZMQ(addr, timeout=10)
    first = check_dataflow(df)
    assert_same_datapoints(first, expected(0, 30), ordered=True)
    arr = first[0][0]
    assert arr.flags.writeable and not arr.flags.owndata  # a view of the received frame, ours to modify
    arr += 1


def test_ipc_and_tcp_several_producers_epochs_do_not_mix(leak_check, producers, tmp_path):
    addrs = [f"ipc://{tmp_path}/a.sock", f"ipc://{tmp_path}/b.sock", free_tcp()]
    procs = [producers(addrs[0], 20, 0, 2), producers(addrs[1], 15, 1000, 2, delay=0.01),
             producers(addrs[2], 10, 2000, 2)]
    want = expected(0, 20) + expected(1000, 15) + expected(2000, 10)
    with RemoteDataZMQ(addrs, timeout=10) as df:
        df.reset_state()
        for _ in range(2):  # the fast producers' second pass waits until the slow one's first pass ends
            got = list(df)
            assert_same_datapoints(got, want, ordered=False)
            assert got[0][0].flags.writeable
        assert wait_for(lambda: all(p.exitcode == 0 for p in procs))  # each said goodbye
        assert list(df) == []  # no producer left: an empty iteration
        assert df.stats()["RemoteDataZMQ"]["datapoints"] == 2 * len(want)


# A killed producer's TCP port is free again at once, and the consumer keeps reconnecting to it: a producer that
# another test (another process of the suite) binds there is adopted in the dead one's place, its datapoints
# read as the dead producer's, and the loss never noticed (an endless one: an epoch that never ends, and the
# other test missing what was read from it). Tests that kill a producer give it an ipc:// path of their own.


def test_killed_producer_is_named_within_timeout_and_the_others_go_on(leak_check, producers, tmp_path):
    a, b = f"ipc://{tmp_path}/victim.sock", f"ipc://{tmp_path}/survivor.sock"
    victim = producers(a, 100_000, 0, None, delay=0.005)
    producers(b, 100_000, 500_000, None, delay=0.005)
    df = RemoteDataZMQ([a, b], timeout=3.0)  # 3 s: longer than a busy machine keeps a live producer silent
    df.reset_state()
    it = iter(df)
    # both producers heard from before the kill: on a busy machine one starts seconds after the other (the
    # stress run read 40 datapoints of the victim alone), so read until both are seen, 20,000 at most (100 s)
    seen: list[int] = []
    while not (any(x < 500_000 for x in seen) and any(x >= 500_000 for x in seen)) and len(seen) < 20_000:
        seen.append(next(it)[1])
    assert any(x < 500_000 for x in seen) and any(x >= 500_000 for x in seen)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    from_victim = sum(x < 500_000 for x in seen)
    with pytest.raises(ProducerLostError) as info:
        for dp in it:
            from_victim += dp[1] < 500_000
    assert time.monotonic() - killed < PROMPTLY_S  # not the other producer's 500 s
    assert info.value.addr == a and a in str(info.value) and b not in str(info.value).split("sent nothing")[0]
    assert f"{a} (after {from_victim:,} datapoints from it) sent nothing" in str(info.value)
    more = [dp[1] for _, dp in zip(range(30), df)]  # iterating again goes on with the survivor
    assert len(more) == 30 and all(x >= 500_000 for x in more)
    assert df.stats()["RemoteDataZMQ"]["producers_lost"] == 1 and df.stats()["RemoteDataZMQ"]["producers"] == 1
    df.close()


def test_on_lost_skip_logs_and_finishes_the_epoch(leak_check, producers, caplog, tmp_path):
    """The survivor has sent its whole epoch, and its last-pass marker, before the victim is killed: a producer
    that has said goodbye cannot be lost, however busy the machine; it returns once this consumer hung up."""
    a, b = f"ipc://{tmp_path}/victim.sock", f"ipc://{tmp_path}/survivor.sock"
    victim = producers(a, 100_000, 0, None, delay=0.005)
    made = FORK.Value("i", 0)
    survivor = producers(b, 60, 500_000, 1, counter=made)
    with RemoteDataZMQ([a, b], hwm=1000, timeout=3.0, on_lost="skip") as df, caplog.at_level(logging.WARNING):
        df.reset_state()  # connects: the survivor sends its epoch into this side's queue, then waits for the hang-up
        assert wait_for(lambda: made.value == 60)
        got = []
        for dp in df:
            got.append(dp[1])
            if len(got) == 10:
                os.kill(victim.pid, signal.SIGKILL)
        assert len(got) >= 10
        assert sorted(x for x in got if x >= 500_000) == list(range(500_000, 500_060))
        assert any(a in r.getMessage() and "sent nothing" in r.getMessage() for r in caplog.records)
        assert wait_for(lambda: survivor.exitcode is not None) and survivor.exitcode == 0  # its end was read


def test_every_producer_lost_raises_even_when_skipping(leak_check, producers, tmp_path):
    a = f"ipc://{tmp_path}/victim.sock"
    victim = producers(a, 100_000, 0, None, delay=0.005)
    with RemoteDataZMQ(a, timeout=3.0, on_lost="skip") as df:
        df.reset_state()
        it = iter(df)
        next(it)
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(ProducerLostError, match="every producer is lost"):
            for _ in it:
                pass


def test_producer_never_started_times_out(leak_check):
    a = free_tcp()
    with RemoteDataZMQ(a, timeout=0.5) as df:
        df.reset_state()
        t0 = time.monotonic()
        with pytest.raises(ProducerLostError, match=a.replace(".", r"\.")):
            list(df)
        assert time.monotonic() - t0 < PROMPTLY_S


def test_close_early_leaves_no_thread_socket_or_fd(leak_check, producers):
    addr = free_tcp()
    producers(addr, 10_000, 0, None)
    threads0, fds0 = os_threads(), open_fds()
    df = RemoteDataZMQ(addr, timeout=10)
    df.reset_state()
    assert os_threads() > threads0  # ZeroMQ's I/O threads
    for i, _ in enumerate(df):
        if i == 5:
            break
    df.close()
    df.close()
    # at most as many as before: a thread an earlier test left to end on its own may end meanwhile
    assert wait_for(lambda: os_threads() <= threads0) and wait_for(lambda: open_fds() <= fds0)
    with pytest.raises(Exception, match="closed"):
        next(iter(df))


def test_back_pressure_bounds_what_the_producer_makes(leak_check, producers):
    addr = free_tcp()
    made = FORK.Value("i", 0)
    hwm, n = 4, 400
    producers(addr, n, 0, 1, shape=(1024, 1024), counter=made, hwm=hwm)  # 1 MiB datapoints
    with RemoteDataZMQ(addr, hwm=hwm, timeout=10) as df:
        df.reset_state()  # connected, not reading

        def settled():
            before = made.value
            time.sleep(0.5)
            return made.value == before and before > 0

        assert wait_for(settled)
        # both high-water marks, the reader thread's queue, and what the kernel buffers on loopback (< 16 MiB)
        bound = 2 * hwm + _QUEUE_DEPTH + 2 + 16
        stalled = made.value
        assert stalled <= bound, f"the producer made {stalled} datapoints without a reader"
        got = [dp[1] for _, dp in zip(range(100), df)]
        assert got == list(range(100))
        assert wait_for(lambda: made.value >= 100)  # reading lets it go on


def test_flow_error_on_producer_reaches_consumer(leak_check, producers):
    addr = free_tcp()
    proc = producers(addr, 20, 0, 1, fail_at=7)
    with RemoteDataZMQ(addr, timeout=10) as df:
        df.reset_state()
        with pytest.raises(ProducerError, match="bad record 7") as info:
            list(df)
        assert info.value.addr == addr and addr in str(info.value)
    proc.join(10)
    assert proc.exitcode not in (0, None)


def test_pickle_codec_needs_allow_pickle(leak_check, producers, tmp_path):
    a, b = f"ipc://{tmp_path}/p.sock", f"ipc://{tmp_path}/q.sock"
    producers(a, 3, 0, 1, codec="pickle")
    producers(b, 3, 0, 1, codec="pickle")
    with RemoteDataZMQ(a, timeout=10) as df:
        df.reset_state()
        with pytest.raises(PickleNotAllowedError):
            list(df)
    with RemoteDataZMQ(b, timeout=10, allow_pickle=True) as df:
        df.reset_state()
        assert_same_datapoints(list(df), expected(0, 3))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"addrs\[1\]"):
        RemoteDataZMQ(["tcp://127.0.0.1:5000", "inproc://x"])
    with pytest.raises(ValueError, match="given twice"):
        RemoteDataZMQ(["ipc:///tmp/x", "ipc:///tmp/x"])
    with pytest.raises(ValueError, match="port"):
        RemoteDataZMQ("tcp://localhost")
    with pytest.raises(ValueError, match="on_lost"):
        RemoteDataZMQ("tcp://127.0.0.1:5000", on_lost="ignore")
    with pytest.raises(ValueError, match="timeout"):
        RemoteDataZMQ("tcp://127.0.0.1:5000", timeout=0)
    with pytest.raises(ValueError, match="codec"):
        send_dataflow_zmq(DataFromList([[1]]), "tcp://127.0.0.1:5000", codec="json")
    with pytest.raises(ValueError, match="hwm"):
        send_dataflow_zmq(DataFromList([[1]]), "tcp://127.0.0.1:5000", hwm=0)


def test_bind_to_a_busy_address_names_it(leak_check):
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        addr = f"tcp://127.0.0.1:{port}"
        with pytest.raises(RemoteConnectionError, match=addr) as info:
            send_dataflow_zmq(DataFromList([[1]]), addr)
        assert info.value.addr == addr
    finally:
        sock.close(0)
        ctx.term()


def test_send_timeout_when_no_consumer(leak_check):
    t0 = time.monotonic()
    with pytest.raises(RemoteConnectionError, match="send_timeout"):
        send_dataflow_zmq(DataFromList([[1]] * 5), free_tcp(), send_timeout=0.5)
    assert time.monotonic() - t0 < PROMPTLY_S


def test_import_bridgeflow_loads_neither_zmq_nor_ray():
    code = "import sys, bridgeflow, bridgeflow.remote; print('zmq' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize(("frames", "error", "message"), [
    ([b"\x93BFC\x09" + bytes(27)], "UnsupportedFormatError", "format version 9"),
    ([b"\x93BFC" + bytes(12), b"x"], "CorruptDataError", "too short"),
    ("pickle", "PickleNotAllowedError", "allow_pickle=True"),
])
def test_a_bad_message_names_the_producer(leak_check, frames, error, message):
    import zmq

    from bridgeflow import serialize

    if frames == "pickle":
        frames = serialize.encode_frames([1], codec="pickle")
    addr = free_tcp()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(addr)
    try:
        with RemoteDataZMQ(addr, timeout=10) as df:
            df.reset_state()
            push.send_multipart(frames)
            with pytest.raises(getattr(serialize, error), match=message) as info:
                list(df)
            assert f"bad message from {addr}" in str(info.value)
    finally:
        push.close(0)
        ctx.term()


def test_producer_exits_when_the_consumer_closes_right_after_its_last_epoch(leak_check, producers, tmp_path):
    """The end of the last pass and the goodbye are one message: a consumer that closes as soon as the
    epoch ends used to leave the producer blocked forever sending its goodbye to nobody."""
    for k in range(8):
        addr = f"ipc://{tmp_path}/last{k}.sock" if k % 2 else free_tcp()
        proc = producers(addr, 5, 0, 1)
        with RemoteDataZMQ(addr, timeout=10) as df:
            df.reset_state()
            assert [dp[1] for dp in df] == list(range(5))
        proc.join(10)
        assert proc.exitcode == 0, f"round {k}: the producer did not finish after the consumer closed"


def test_the_last_end_marker_is_also_the_goodbye(leak_check, producers):
    """On the wire: after the last datapoint comes one LAST marker (not END, then BYE), and a consumer that
    closes as soon as it sees it lets the producer finish."""
    import zmq

    from bridgeflow.remote import _protocol as P

    addr = free_tcp()
    proc = producers(addr, 3, 0, 1)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, 10_000)
    pull.connect(addr)
    try:
        controls, data = [], 0
        while not controls:
            frames = pull.recv_multipart()
            if frames[0][:3] == P.CONTROL:
                if frames[0] != P.HEARTBEAT:
                    controls.append(frames[0])
            else:
                data += 1
    finally:
        pull.close(0)
        ctx.term()
    assert data == 3 and controls == [P.LAST]
    proc.join(10)
    assert proc.exitcode == 0


# --- large datapoints: liveness over a slow link, and the size limit ---------------------------------

class ThrottledProxy:
    """A TCP proxy that forwards the producer's bytes to the consumer at ``rate`` bytes/s (the other way
    unthrottled): a slow link between hosts. ``addr`` is where the consumer connects."""

    def __init__(self, upstream: str, rate: float) -> None:
        self.upstream = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.rate = rate
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.addr = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop = threading.Event()
        self.forwarded = 0
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self.stop.is_set():
            try:
                down, _ = self.listener.accept()
            except OSError:
                continue
            try:
                up = socket.create_connection((self.upstream[0], int(self.upstream[1])))
            except OSError:  # the producer is not bound yet: ZeroMQ connects again in a moment
                down.close()
                continue
            for src, dst, rate in ((up, down, self.rate), (down, up, None)):
                t = threading.Thread(target=self._pump, args=(src, dst, rate), daemon=True)
                self.threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, rate: float | None) -> None:
        src.settimeout(0.1)
        chunk = 16384
        try:
            while not self.stop.is_set():
                try:
                    data = src.recv(chunk)
                except TimeoutError:
                    continue
                if not data:
                    break
                dst.sendall(data)
                if rate is not None:
                    self.forwarded += len(data)
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        self.listener.close()


def _produce_big(addr, sizes, whole=False):
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    if whole:  # the transport as it was: every datapoint as one ZeroMQ message
        from bridgeflow.remote import _protocol as P

        P.FRAGMENT_BYTES = 1 << 40
    data = [[np.full(n, i + 1, np.uint8), i] for i, n in enumerate(sizes)]
    send_dataflow_zmq(DataFromList(data, shuffle=False), addr, epochs=1, heartbeat_s=0.2)


@pytest.mark.parametrize("whole", [False, True])
def test_a_large_datapoint_over_a_slow_link_is_not_a_lost_producer(whole, leak_check):
    """10 MB through a 2 MB/s link with timeout=2 s: 5 s for one datapoint, and bytes arrive all along (a 1 MiB
    piece each half second: 4x inside the timeout, so a busy machine's pauses do not end it).
    Sent whole (as producers did before pieces), it reached the consumer only once complete, which took it
    for dead; now ZeroMQ refuses a frame larger than any producer sends before buffering it."""
    addr = free_tcp()
    producer = FORK.Process(target=_produce_big, args=(addr, [1000, 10_000_000, 1000], whole), daemon=True)
    producer.start()
    proxy = ThrottledProxy(addr, rate=2_000_000)
    try:
        with RemoteDataZMQ(proxy.addr, timeout=2.0) as df:
            df.reset_state()
            if whole:
                with pytest.raises(ProducerLostError, match="sent nothing"):
                    list(df)
                assert proxy.forwarded < 1_000_000  # refused at the frame's header: the 10 MB never came in
                return
            t0 = time.monotonic()
            got = list(df)
            assert time.monotonic() - t0 > 4.0  # it did take the link's time
        assert [dp[1] for dp in got] == [0, 1, 2]
        assert [dp[0].nbytes for dp in got] == [1000, 10_000_000, 1000]
        for i, (arr, _) in enumerate(got):
            assert (arr == i + 1).all()
        assert got[1][0].flags.writeable
    finally:
        proxy.close()
        producer.kill()
        producer.join(5)


def test_a_datapoint_over_max_message_bytes_is_refused_before_it_arrives(leak_check):
    """Announced at 3 MB against a 1 MB limit, over a 1 MB/s link: refused at the header (no 3 s wait,
    no 3 MB buffer), naming the producer; the datapoint before it was delivered."""
    addr = free_tcp()
    producer = FORK.Process(target=_produce_big, args=(addr, [1000, 3_000_000]), daemon=True)
    producer.start()
    proxy = ThrottledProxy(addr, rate=1_000_000)
    try:
        with RemoteDataZMQ(proxy.addr, timeout=5.0, max_message_bytes=1_000_000) as df:
            df.reset_state()
            it = iter(df)
            assert next(it)[1] == 0
            with pytest.raises(MessageTooLargeError) as info:
                next(it)
            assert proxy.forwarded < 2_000_000  # refused at the header, before the 3 MB came in (3 s)
            assert df.stats()["RemoteDataZMQ"]["producers_lost"] == 1
        err = info.value
        assert err.addr == proxy.addr and err.nbytes > 3_000_000 and err.limit == 1_000_000
        assert proxy.addr in str(err) and "max_message_bytes=1,000,000" in str(err)
    finally:
        proxy.close()
        producer.kill()
        producer.join(5)


def test_a_raw_message_over_max_message_bytes_is_refused(leak_check):
    """A peer that does not announce sizes: frames each under the limit but 2.5 MB together are refused
    with the producer's name; a single frame over it never reaches the consumer at all (ZeroMQ drops the
    connection), so nothing is allocated for it and the producer counts as silent."""
    import zmq

    addr = free_tcp()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind(addr)
    try:
        frames = encode_frames([np.ones(1_250_000, np.uint8), np.ones(1_250_000, np.uint8)])
        with RemoteDataZMQ(addr, timeout=10, max_message_bytes=2_000_000) as df:
            df.reset_state()
            push.send_multipart(frames)
            with pytest.raises(MessageTooLargeError, match=f"producer {addr} sent a datapoint of 2,500,"):
                list(df)
        with RemoteDataZMQ(addr, timeout=1.5, max_message_bytes=2_000_000) as df:
            df.reset_state()
            push.send_multipart(encode_frames([np.ones(3_000_000, np.uint8)]))
            with pytest.raises(ProducerLostError):
                list(df)
    finally:
        push.close(0)
        ctx.term()


def test_max_message_bytes_is_validated():
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="max_message_bytes"):
            RemoteDataZMQ("tcp://127.0.0.1:1", max_message_bytes=bad)


def test_without_keys_only_addresses_of_this_machine_unless_allowed(leak_check):
    """Without keys, any peer that can connect can read, end, inject or corrupt the stream: an address other
    machines can reach is refused (naming keys=, `bridgeflow keys` and allow_insecure=True) by the consumer and
    the producer, binding or connecting; loopback and ipc:// need nothing, keys or allow_insecure=True open the
    rest."""
    from bridgeflow.remote._protocol import is_local

    for addr in ("tcp://127.0.0.1:5555", "tcp://127.3.4.5:5555", "tcp://localhost:5555", "tcp://[::1]:5555",
                 "ipc:///tmp/bf.sock"):
        assert is_local(addr), addr
    for addr in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.5:5555", "tcp://trainer:5555",
                 "tcp://eth0:5555", "tcp://[::]:5555"):
        assert not is_local(addr), addr
    refused = r"can be reached from other machines.*keys=FOLDER.*bridgeflow keys FOLDER.*allow_insecure=True"
    with pytest.raises(ValueError, match="tcp://10.0.0.5:5555 " + refused):
        RemoteDataZMQ("tcp://10.0.0.5:5555")
    with pytest.raises(ValueError, match="tcp://0.0.0.0:5555 " + refused):
        RemoteDataZMQ(["tcp://127.0.0.1:5556", "tcp://0.0.0.0:5555"], bind=True)
    with pytest.raises(ValueError, match="tcp://0.0.0.0:5555 " + refused):
        send_dataflow_zmq(DataFromList([[1]]), "tcp://0.0.0.0:5555")
    with pytest.raises(ValueError, match="tcp://10.0.0.5:5555 " + refused):
        send_dataflow_zmq(DataFromList([[1]]), "tcp://10.0.0.5:5555", bind=False)
    RemoteDataZMQ("tcp://10.0.0.5:5555", allow_insecure=True).close()  # allowed: nothing opened before reset_state
    port = free_tcp().rpartition(":")[2]
    with RemoteDataZMQ(f"tcp://0.0.0.0:{port}", bind=True, allow_insecure=True, producers=1, timeout=20) as df:
        df.reset_state()
        sender = threading.Thread(target=send_dataflow_zmq, args=(DataFromList([[i] for i in range(5)], shuffle=False),
                                                                  f"tcp://127.0.0.1:{port}"), kwargs={"bind": False})
        sender.start()
        assert [dp[0] for dp in df] == list(range(5))
        sender.join(PROMPTLY_S)


def _produce_then_exit(addr, n, bind, done):
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()  # no orphans
    def gen():
        for i in range(n):
            yield [np.full(4, i, np.int64), i]
        done.set()  # every datapoint was handed to the sender

    sent = send_dataflow_zmq(DataFromGenerator(gen, size=n), addr, hwm=2, bind=bind, heartbeat_s=0.2)
    assert sent == n


@pytest.mark.parametrize("consumer_binds", [False, True], ids=["consumer-connects", "consumer-binds"])
def test_the_tail_reaches_a_consumer_behind_when_the_producer_is_done(leak_check, tmp_path, consumer_binds):
    """A producer that sent everything while the consumer was behind (its queue full) does not close before
    the consumer hung up: libzmq drops what a closed peer sent but the consumer's engine has not read yet (on
    ipc://, the hang-up stops that engine for good), so the tail and the end marker were lost and the consumer
    waited ``timeout`` for a producer that had returned. Each side holds 2 messages; the 200 small
    datapoints fit in the socket buffers between them, so the producer is done while the consumer waits."""
    n, addr = 200, f"ipc://{tmp_path}/tail.sock"
    done = FORK.Event()
    kw = {"bind": True, "producers": 1} if consumer_binds else {}
    with RemoteDataZMQ(addr, hwm=2, timeout=10, **kw) as df:
        if consumer_binds:
            df.reset_state()
        proc = FORK.Process(target=_produce_then_exit, args=(addr, n, not consumer_binds, done), daemon=True)
        proc.start()
        try:
            if not consumer_binds:
                df.reset_state()
            it = iter(df)
            got = [next(it)[1]]
            assert done.wait(PROMPTLY_S)
            proc.join(1.0)  # closing now lost the tail: give a producer that would close the time to
            got += [dp[1] for dp in it]
            assert got == list(range(n))
        finally:
            if consumer_binds:
                df.close()  # a binding consumer hangs up when closed
            proc.join(PROMPTLY_S)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert proc.exitcode == 0
