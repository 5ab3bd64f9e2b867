"""The wire with and without CurveZMQ keys, over real sockets, with real producer processes and rogue peers:
with keys, a stranger cannot end, inject, corrupt, flood or steal the stream; without, one stray message is
dropped and counted, a stranger that says hello is a producer like any other (what the docs say, and why
keyless addresses are loopback only), and the bytes a consumer buffers are bounded across producers."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from bridgeflow import DataFromGenerator
from bridgeflow.remote import (
    MessageTooLargeError,
    ProducerLostError,
    RemoteDataZMQ,
    generate_keys,
    load_keys,
    send_dataflow_zmq,
)
from bridgeflow.remote import _protocol as P
from conftest import PROMPTLY_S, exit_with_parent, free_tcp

FORK = mp.get_context("fork")
N = 50


def _produce(addr, keys, bind, n=N, delay=0.0, pause=0.0):
    """Send ``n`` datapoints, ``delay`` s apart, holding the second half back ``pause`` s (heartbeats go on)."""
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()  # no orphans

    def gen():
        for i in range(n):
            if delay:
                time.sleep(delay)
            if pause and i == n // 2:
                time.sleep(pause)
            yield [np.full((4, 5), i % 251, np.uint8), i]

    send_dataflow_zmq(DataFromGenerator(gen, size=n), addr, bind=bind, epochs=1, heartbeat_s=0.2, keys=keys)


@pytest.fixture
def producer():
    procs = []

    def start(addr, keys, bind=True, **kw):
        p = FORK.Process(target=_produce, args=(addr, keys, bind), kwargs=kw, daemon=True)
        p.start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.join(5)


@pytest.fixture
def keys(tmp_path):
    return str(generate_keys(tmp_path / "keys").source)


@pytest.fixture
def rogue():
    """Plain or wrongly keyed ZeroMQ sockets of a peer that is not part of the job; closed at teardown."""
    ctx = zmq.Context()
    socks = []

    def make(kind, curve_from=None):
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if curve_from is not None:  # a peer with CurveZMQ keys of its own, not the job's
            other = load_keys(curve_from)
            sock.curve_secretkey, sock.curve_publickey = other.client_secret, other.client_public
        socks.append(sock)
        return sock

    yield make
    for s in socks:
        s.close(0)
    ctx.term()


def labels(dps):
    return [int(dp[1]) for dp in dps]


# --- keys ---------------------------------------------------------------------------------------------

def test_keys_are_made_once_secrets_private_and_never_printed(tmp_path, caplog):
    folder = tmp_path / "k"
    made = generate_keys(folder)
    names = sorted(os.listdir(folder))
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    for name in ("client.key_secret", "server.key_secret"):
        assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o600
    assert load_keys(folder) == made and made.server_secret.decode() not in repr(made)
    with pytest.raises(FileExistsError, match="already holds keys.*overwrite=True"):
        generate_keys(folder)
    assert generate_keys(folder, overwrite=True) != made
    os.chmod(folder / "server.key_secret", 0o644)
    with caplog.at_level(logging.WARNING, logger="bridgeflow.remote._keys"):
        load_keys(folder)
    assert "can be read by other users" in caplog.text and "chmod 600" in caplog.text
    with pytest.raises(FileNotFoundError, match="no such key folder.*bridgeflow keys"):
        load_keys(tmp_path / "nope")
    os.unlink(folder / "client.key_secret")
    with pytest.raises(FileNotFoundError, match=r"client.key_secret is missing"):
        RemoteDataZMQ(free_tcp(), keys=folder)


def test_the_keys_command_makes_a_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bridgeflow.cli", "keys", str(tmp_path / "k")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "wrote CurveZMQ keys to" in proc.stdout, proc.stderr
    assert load_keys(tmp_path / "k").source == str(tmp_path / "k")
    proc = subprocess.run([sys.executable, "-m", "bridgeflow.cli", "keys", str(tmp_path / "k")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "already holds keys" in proc.stderr and "pass --overwrite" in proc.stderr
    assert "overwrite=True" not in proc.stderr  # the command's option, not the function's argument


# --- with keys: encrypted, authenticated -------------------------------------------------------------

@pytest.mark.parametrize("bind", [False, True], ids=["producer-binds", "consumer-binds"])
def test_with_keys_the_stream_arrives_whole_and_encrypted(leak_check, producer, keys, bind):
    addr = free_tcp()
    producer(addr, keys, bind=not bind)
    with RemoteDataZMQ(addr, keys=keys, timeout=20, bind=bind, producers=1 if bind else None) as df:
        df.reset_state()
        assert labels(df) == list(range(N))
        assert df.stats()["RemoteDataZMQ"]["peers_refused"] == 0


def test_with_keys_a_rogue_producer_cannot_inject_or_end_the_stream(leak_check, producer, keys, rogue, tmp_path):
    """A bound consumer with keys: a peer without them (plain, or with keys of its own) connects, says
    hello, sends datapoints and a spoofed end: none of it is read; the real producer's stream arrives
    whole, and ends when that producer finishes."""
    addr = free_tcp()
    with RemoteDataZMQ(addr, bind=True, producers=1, keys=keys, timeout=20) as df:
        df.reset_state()
        other_keys = str(generate_keys(tmp_path / "other").source)
        for curve in (None, other_keys):
            push = rogue(zmq.PUSH, curve_from=curve)
            if curve is not None:
                push.curve_serverkey = load_keys(keys).server_public  # it knows the public key: not enough
            push.connect(addr)
            tag = [P.TAG + os.urandom(P.TAG_ID_BYTES)]
            for msg in ([P.HELLO], *([b"\x93BFC" + bytes(28)] for _ in range(5)), [P.LAST]):
                push.send_multipart(tag + msg, zmq.NOBLOCK) if push.poll(0, zmq.POLLOUT) else None
        time.sleep(0.5)  # the rogues' handshakes are refused meanwhile
        producer(addr, keys, bind=False, delay=0.01)
        assert labels(df) == list(range(N))
        stats = df.stats()["RemoteDataZMQ"]
        assert stats["messages_dropped"] == 0  # never even reached the flow
        assert stats["peers_refused"] >= 1  # the one with keys of its own was refused by key


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


STRANGER = {  # what a stranger sends after its hello, to do what the docs say keys prevent
    "end": lambda: [[P.LAST]],
    "inject": lambda: [[b"\x93BFC" + bytes(28)], [P.END]],
    "corrupt": lambda: [[P.SPLIT_PART, b"x" * 100], [P.ERROR + b"spoofed error"]],
    "flood": lambda: [[bytes(1 << 20)] * 300],  # one message of 300 frames of 1 MiB, each under the frame cap
}


def _stranger(addr, attack, done):
    """A peer without the job's keys, in a process of its own (what it buffers is not the consumer's)."""
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, 2000)
    push.connect(addr)
    tag = [P.TAG + os.urandom(P.TAG_ID_BYTES)]
    for msg in [[P.HELLO], *STRANGER[attack]()]:
        try:
            push.send_multipart(tag + msg)
        except zmq.Again:
            break
    done.set()
    time.sleep(PROMPTLY_S)  # connected (and trying) while the real stream runs; killed at the end
    push.close(0)
    ctx.term()


@pytest.mark.parametrize("attack", list(STRANGER))
def test_with_keys_a_stranger_cannot_end_inject_corrupt_or_flood_the_stream(leak_check, producer, keys, attack):
    """A bound consumer with keys; a stranger without them connects before the real producer and sends a hello
    then an end, a datapoint, a malformed piece and an error, or one message of 300 frames of 1 MiB (ZeroMQ
    bounds frames, not messages: without keys a consumer buffers it whole). Its handshake fails, so none of it
    is read or buffered: the real stream arrives whole and the consumer's memory does not grow by it."""
    addr = free_tcp()
    with RemoteDataZMQ(addr, bind=True, producers=1, keys=keys, timeout=20) as df:
        df.reset_state()
        before = _rss_kib()
        done = FORK.Event()
        stranger = FORK.Process(target=_stranger, args=(addr, attack, done), daemon=True)
        stranger.start()
        try:
            assert done.wait(PROMPTLY_S)
            time.sleep(1.0)  # the stranger's bytes arrive (or are refused) meanwhile
            producer(addr, keys, bind=False, delay=0.01)
            assert labels(df) == list(range(N))
            stats = df.stats()["RemoteDataZMQ"]
            assert stats["messages_dropped"] == 0 and stats["producers_lost"] == 0, stats  # none of it reached the flow
            assert _rss_kib() - before < 64 << 10, (before, _rss_kib())  # KiB: not the 300 MiB it sent
        finally:
            stranger.kill()
            stranger.join(5)


def test_without_keys_a_stranger_that_says_hello_is_a_producer(leak_check, producer, rogue):
    """What the docs say of a keyless stream, and why keyless addresses are this machine's only: a stranger that
    says hello first is heard as a producer. Its "last" ends the iteration before the real stream did (the
    bound consumer waits for one producer), with nothing dropped; its datapoint is delivered as data."""
    addr = free_tcp()
    with RemoteDataZMQ(addr, bind=True, producers=1, timeout=PROMPTLY_S) as df:
        df.reset_state()
        push = rogue(zmq.PUSH)
        push.connect(addr)
        tag = [P.TAG + os.urandom(P.TAG_ID_BYTES)]
        for msg in ([P.HELLO], *encode_frames_list([np.arange(3), 999]), [P.LAST]):
            push.send_multipart(tag + msg)
        got = labels(df)
        assert got == [999] and df.stats()["RemoteDataZMQ"]["messages_dropped"] == 0


def encode_frames_list(dp):
    from bridgeflow._codec import encode_frames

    return [[bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in encode_frames(dp)]]


def test_with_keys_a_rogue_consumer_cannot_take_the_stream(leak_check, producer, keys, rogue, tmp_path):
    """A producer binding with keys: a PULL socket without the keys (plain, or with keys of its own)
    connected to its port before the real consumer gets nothing; the real consumer gets everything."""
    addr = free_tcp()
    producer(addr, keys, bind=True, delay=0.01)
    other_keys = str(generate_keys(tmp_path / "other").source)
    thieves = []
    for curve in (None, other_keys):
        pull = rogue(zmq.PULL, curve_from=curve)
        if curve is not None:
            pull.curve_serverkey = load_keys(keys).server_public
        pull.connect(addr)
        thieves.append(pull)
    time.sleep(0.5)
    with RemoteDataZMQ(addr, keys=keys, timeout=20) as df:
        df.reset_state()
        assert labels(df) == list(range(N))
    for pull in thieves:
        assert pull.poll(200) == 0  # not one message reached a thief


def test_with_keys_a_consumer_hears_nothing_from_a_producer_without_them(leak_check, producer, keys, tmp_path):
    """The address taken by a producer with other keys (or none): the consumer refuses its handshake, reads
    nothing from it, and says the producer sent nothing."""
    for other in (None, str(generate_keys(tmp_path / "other").source)):
        addr = free_tcp()
        producer(addr, other, bind=True)
        with RemoteDataZMQ(addr, keys=keys, timeout=1.5) as df:
            df.reset_state()
            with pytest.raises(ProducerLostError, match="sent nothing"):
                list(df)
            assert df.stats()["RemoteDataZMQ"]["datapoints"] == 0


# --- without keys: strangers' messages are dropped and counted ---------------------------------------

# the consumer's timeout where a stray peer's silence must outlast it; the other cases wait PROMPTLY_S at most
SILENT_TIMEOUT_S = 5.0


@pytest.mark.parametrize("stray", ["untagged", "end", "last", "error", "hello-then-silence"])
def test_without_keys_one_stray_or_spoofed_message_cannot_end_or_corrupt_the_stream(leak_check, producer, rogue,
                                                                                    stray):
    """A stray peer's one message is dropped and counted; the real producer's stream arrives whole. A stray
    HELLO followed by silence is not a producer that the timeout then declares lost: the real producer holds
    its second half back for longer than the timeout (a sleep: a busy machine only makes it longer), so the
    stray peer has been silent past the timeout while the stream still runs."""
    addr = free_tcp()
    silent = stray == "hello-then-silence"
    with RemoteDataZMQ(addr, bind=True, producers=1, timeout=SILENT_TIMEOUT_S if silent else PROMPTLY_S) as df:
        df.reset_state()
        push = rogue(zmq.PUSH)
        push.connect(addr)
        tag = [P.TAG + os.urandom(P.TAG_ID_BYTES)]
        push.send_multipart({"untagged": [b"\x80\x04K\x01."], "end": tag + [P.END], "last": tag + [P.LAST],
                             "error": tag + [P.ERROR + b"spoofed"], "hello-then-silence": tag + [P.HELLO]}[stray])
        producer(addr, None, bind=False, pause=SILENT_TIMEOUT_S + 1 if silent else 0.0)
        assert labels(df) == list(range(N))
        assert df.stats()["RemoteDataZMQ"]["messages_dropped"] == 1


def test_a_stranger_sending_without_pause_cannot_hold_off_the_timeout(leak_check, rogue):
    """Dropped messages are not a producer speaking: junk arriving every few milliseconds (tensorpack's
    producer repeats its data forever) still ends in ProducerLostError once no real producer spoke for
    ``timeout`` seconds, instead of a consumer that waits for good."""
    addr = free_tcp()
    stop = threading.Event()
    push = rogue(zmq.PUSH)
    push.connect(addr)

    def flood():
        while not stop.is_set():
            try:
                push.send(b"\x80\x04K\x01.", zmq.NOBLOCK)
            except zmq.Again:
                pass
            time.sleep(0.005)

    with RemoteDataZMQ(addr, bind=True, timeout=1) as df:
        df.reset_state()
        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        try:
            with pytest.raises(ProducerLostError, match=r"no producer sent anything.*message\(s\) not from "
                                                        r"bridgeflow's send_dataflow_zmq"):
                next(iter(df))
            assert df.stats()["RemoteDataZMQ"]["messages_dropped"] >= 2
        finally:
            stop.set()
            sender.join()


def test_the_bytes_buffered_are_bounded_across_producers(leak_check, rogue):
    """Producers announcing large datapoints at once: what is being received is bounded in all (not per
    producer); the producer whose announcement does not fit is named and dropped, and announcing
    allocates nothing."""
    import resource

    addr = free_tcp()
    with RemoteDataZMQ(addr, bind=True, timeout=5, max_message_bytes=400 << 20) as df:
        df.reset_state()
        pushes = []
        for _ in range(4):
            push = rogue(zmq.PUSH)
            push.connect(addr)
            tag = [P.TAG + os.urandom(P.TAG_ID_BYTES)]
            push.send_multipart(tag + [P.HELLO])
            push.send_multipart(tag + [P.split_header([300 << 20])])  # 300 MiB each, under the 400 MiB limit
            pushes.append((push, tag))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(MessageTooLargeError, match=r"while 314,572,800 bytes of other producers' datapoints "
                                                       r"are being received: over max_buffered_bytes=419,430,400"):
            next(iter(df))
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: no 300 MiB touched
        assert df.stats()["RemoteDataZMQ"]["producers_lost"] == 1


# --- the two sides given different key folders: named on both, with fingerprints ---------------------

MISMATCHED = """
import logging, sys
import numpy as np
from bridgeflow import DataFromList
from bridgeflow.remote import send_dataflow_zmq
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
print("ready", flush=True)  # imported: the handshakes begin now, not after a slow start on a busy machine
try:
    send_dataflow_zmq(DataFromList([[np.zeros(3)]] * 5), sys.argv[1], keys=sys.argv[2], bind=sys.argv[3] == "bind",
                      send_timeout=6.0, heartbeat_s=0.2, epochs=1)
except Exception as exc:
    print(type(exc).__name__, exc, file=sys.stderr)
"""


@pytest.mark.parametrize("producer_binds", [True, False], ids=["producer-binds", "consumer-binds"])
def test_different_key_folders_are_named_on_both_sides_with_fingerprints(leak_check, tmp_path, caplog,
                                                                        producer_binds):
    from bridgeflow.remote._keys import fingerprint

    mine, theirs = generate_keys(tmp_path / "mine"), generate_keys(tmp_path / "theirs")
    addr = free_tcp()
    proc = subprocess.Popen([sys.executable, "-c", MISMATCHED, addr, str(theirs.source),
                             "bind" if producer_binds else "connect"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        with caplog.at_level(logging.WARNING, logger="bridgeflow.remote._keys"):
            with RemoteDataZMQ(addr, keys=mine, bind=not producer_binds, timeout=5.0,
                               producers=None if producer_binds else 1) as df:
                df.reset_state()
                with pytest.raises(ProducerLostError) as info:
                    list(df)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    said = str(info.value)
    if producer_binds:  # this side connects: the producer does not hold the server key it expects
        expected = f"does not hold the server key {fingerprint(mine.server_public)} this side expects"
        other = f"it encrypted for another server key than this side's {fingerprint(theirs.server_public)}"
    else:  # this side binds: the producer encrypted for another server key
        expected = f"it encrypted for another server key than this side's {fingerprint(mine.server_public)}"
        other = f"does not hold the server key {fingerprint(theirs.server_public)} this side expects"
    assert "CurveZMQ handshake(s) failed" in said and expected in said, said
    assert any(expected in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert other in err, err  # the other side names the key it expected
    assert str(theirs.source) in err and str(mine.source) in said


def test_refused_peers_are_logged_at_most_once_a_minute(leak_check, keys, tmp_path, caplog):
    """A peer holding the job's server key but another client key, reconnecting again and again: each
    refusal counts, the log says it once (then once a minute with the count)."""
    other = load_keys(generate_keys(tmp_path / "other").source)
    job = load_keys(keys)
    addr = free_tcp()
    ctx = zmq.Context()
    socks = []
    try:
        with caplog.at_level(logging.WARNING, logger="bridgeflow.remote._keys"):
            with RemoteDataZMQ(addr, keys=keys, bind=True, timeout=30) as df:
                df.reset_state()
                for _ in range(20):
                    sock = ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.curve_secretkey, sock.curve_publickey = other.client_secret, other.client_public
                    sock.curve_serverkey = job.server_public
                    sock.connect(addr)
                    socks.append(sock)
                deadline = time.monotonic() + 20
                while df._security.refused < 20 and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert df._security.refused == 20
        refusals = [r.getMessage() for r in caplog.records if "refused a ZeroMQ peer" in r.getMessage()]
        assert len(refusals) == 1, refusals
        from bridgeflow.remote._keys import fingerprint

        assert fingerprint(other.client_public) in refusals[0] and fingerprint(job.client_public) in refusals[0]
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


def test_throttle_logs_a_kind_once_per_period_with_the_count(caplog, monkeypatch):
    import types

    from bridgeflow.remote import _keys as keys_module
    from bridgeflow.remote._keys import Throttle

    now = [1000.0]  # the module's clock, moved by the test: a busy machine cannot stretch the 50 calls past it
    monkeypatch.setattr(keys_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    throttle = Throttle(period=0.3)
    with caplog.at_level(logging.WARNING, logger="bridgeflow.remote._keys"):
        for _ in range(50):
            throttle.warning("a", "peer refused")
            now[0] += 0.001
        throttle.warning("b", "other kind")
        now[0] += 0.2  # 0.25 s after the first "a": inside its period, suppressed too
        throttle.warning("a", "peer refused")
        now[0] += 0.1
        throttle.warning("a", "peer refused")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["peer refused", "other kind", "peer refused (50 more like it in the last 0.3 s)"], said
