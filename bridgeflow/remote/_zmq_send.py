"""The producer side of :mod:`bridgeflow.remote._zmq_flow`: :func:`send_dataflow_zmq`.

By default the producer binds its address and one consumer connects (bridgeflow's topology: the
consumer knows every producer). ``bind=False`` connects to a consumer that binds instead
(``RemoteDataZMQ(addr, bind=True)``, tensorpack's topology), where many producers may share one
address: each message then starts with a frame naming this producer (``_protocol.TAG``), so the consumer
can tell the producers apart, reassemble each one's large datapoints and notice which one went silent.

``format`` takes tensorpack's serializer names and maps them to bridgeflow's codecs: ``None``,
``"msgpack"`` and ``"pyarrow"`` (data-only serializers) send with the safe codec; ``"pickle"`` only with
``allow_pickle=True`` (the consumer must also pass ``allow_pickle=True``); tensorpack's ``"zmq_ops"``
array format (for its ``ZMQInput``) is not provided.

Example:
    >>> send_dataflow_zmq(df, "tcp://127.0.0.1:8877", epochs=None)                   # doctest: +SKIP
    >>> send_dataflow_zmq(df, "tcp://trainer:8877", bind=False)   # tensorpack's way  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import time
import traceback
from collections.abc import Iterable
from typing import Any

from ..engine import Producer, progress_bar, require
from ..serialize import CODECS, DEFAULT_CODEC, encode_frames
from . import _protocol as P
from ._errors import RemoteConnectionError
from ._keys import CurveKeys, Security, load_keys

__all__ = ["FORMATS", "send_dataflow_zmq"]

log = logging.getLogger(__name__)

_QUEUE_DEPTH = 4  # encoded datapoints waiting between the producer's reader thread and its socket
# A connecting producer waits at most this long after its last message for the binding consumer to hang up
# (that consumer keeps its socket for other producers, so it may never hang up; see _Peers).
_HANGUP_GRACE_S = 5.0
# tensorpack's names (its `format`, and its TENSORPACK_SERIALIZE serializers) -> bridgeflow's codec
FORMATS = {None: DEFAULT_CODEC, "bridgeflow": DEFAULT_CODEC, "msgpack": DEFAULT_CODEC, "pyarrow": DEFAULT_CODEC,
           "pickle": "pickle"}


def _positive(value: Any, what: str, who: str, *, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{who}: {what} must be a positive number, got {value!r}")
    return value


def _codec(format: str | None, codec: str | None, allow_pickle: bool, who: str) -> str:
    """bridgeflow's codec for tensorpack's ``format`` name and/or bridgeflow's ``codec``."""
    if format in ("zmq_op", "zmq_ops"):
        raise ValueError(f"{who}: format={format!r} (tensorpack's zmq_ops array format, read by its ZMQInput) is "
                         "not provided; leave format=None: RemoteDataZMQ reads bridgeflow's safe format")
    if format not in FORMATS:
        raise ValueError(f"{who}: unknown format {format!r}; choose one of {[k for k in FORMATS if k]} or None")
    mapped = FORMATS[format]
    if mapped == "pickle" and not allow_pickle:
        raise ValueError(f"{who}: format='pickle' sends pickles, which run code where they are read: pass "
                         "allow_pickle=True to send them (the consumer must pass allow_pickle=True too), or leave "
                         "format=None for the safe codec")
    if codec is None:
        return mapped
    if codec not in CODECS:
        raise ValueError(f"{who}: unknown codec {codec!r}; choose one of {list(CODECS)}")
    if format is not None and codec != mapped:
        raise ValueError(f"{who}: format={format!r} and codec={codec!r} disagree; give one of them")
    return codec


def _byte_view(frame: Any) -> memoryview:
    mv = memoryview(frame)
    if mv.ndim == 1 and mv.format == "B":
        return mv
    return mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())


def _send_datapoint(sock: Any, frames: list, prefix: list) -> None:
    """Send one datapoint's frames: as one message, or in pieces after a split header when it is large;
    every message starts with ``prefix`` (the producer's tag when it connects, else nothing)."""
    views = [_byte_view(f) for f in frames]
    sizes = [v.nbytes for v in views]
    if sum(sizes) <= P.FRAGMENT_BYTES:
        sock.send_multipart(prefix + views, copy=False)
        return
    sock.send_multipart(prefix + [P.split_header(sizes)])
    step = P.FRAGMENT_BYTES
    for v in views:
        for off in range(0, v.nbytes, step):
            sock.send_multipart(prefix + [P.SPLIT_PART, v[off:off + step]], copy=False)


class _Peers:
    """The connections of the producer's socket, from its ZeroMQ monitor: after the last message the producer
    waits for the consumer to hang up before closing.

    libzmq (4.3.5) drops what a peer sent but the receiving engine has not read yet when the connection closes
    while the receiver's queue is full (RCVHWM): on ``ipc://`` the hang-up wakes the stalled engine, which then
    stops reading the socket for good. A producer that closed as soon as its last message was written lost
    the tail of the stream (and the end marker) whenever the consumer was behind, and the consumer waited
    ``timeout`` for it. The consumer hangs up on the producer's last message (connecting, it closes that
    producer's socket; binding, it closes its socket when the flow is closed), so the producer closes after
    that: nothing it sent is still on its way.
    """

    def __init__(self, zmq: Any, sock: Any) -> None:
        self.zmq = zmq
        self.up = 0
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)

    def read(self, timeout_ms: int = 0) -> None:
        """Count the connections made and lost since the last read (read them often: the monitor holds 1,000
        events, and drops what comes after)."""
        from zmq.utils.monitor import recv_monitor_message
        zmq = self.zmq
        while self.monitor.poll(timeout_ms):
            event = recv_monitor_message(self.monitor)["event"]
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self.up += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.up = max(0, self.up - 1)
            timeout_ms = 0

    def await_hangup(self, timeout: float | None) -> bool:
        """Wait until no consumer is connected, for at most ``timeout`` seconds (``None``: no limit); returns
        whether none is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.read()
        while self.up > 0:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            self.read(max(1, int(min(left, 1.0) * 1000)))
        return True

    def close(self, sock: Any) -> None:
        try:
            sock.disable_monitor()
        except self.zmq.ZMQError:
            pass
        self.monitor.close(linger=0)


def _read_source(df: Any, epochs: int | None, codec: str, out: Any) -> None:
    """Reader thread: encode every datapoint of ``epochs`` passes over ``df`` for the sending thread (an
    error of the flow reaches it after the datapoints before it)."""
    done = 0
    while epochs is None or done < epochs:
        for dp in df:
            if not out.put(("D", encode_frames(dp, codec=codec))):
                return
        done += 1
        last = epochs is not None and done == epochs
        if not out.put(("L" if last else "E", None)):  # the last end says goodbye too
            return


def send_dataflow_zmq(df: Iterable, addr: str, hwm: int = 50, format: str | None = None, bind: bool = True, *,
                      codec: str | None = None, allow_pickle: bool = False, epochs: int | None = 1,
                      heartbeat_s: float = 1.0, send_timeout: float | None = None, progress: bool = False,
                      keys: str | os.PathLike | CurveKeys | None = None, allow_insecure: bool = False) -> int:
    """Send ``epochs`` passes over ``df`` on a PUSH socket at ``addr``; return the datapoints sent.

    ``bind=True`` (the default) binds ``addr`` and a :class:`RemoteDataZMQ` connects to it;
    ``bind=False`` (tensorpack's default) connects to a ``RemoteDataZMQ(addr, bind=True)``, which may
    hear from many producers on one address. ``format``: tensorpack's serializer name, mapped to a
    bridgeflow codec (see the module doc); ``codec``: bridgeflow's name (``"bridgeflow"`` or ``"pickle"``).

    Blocks until done: each send waits while the consumer's queue is full (``hwm`` messages), so start
    it in the process (or host) that should do the work. ``df`` is reset here. A reader thread iterates
    and encodes the flow while this thread sends, so heartbeats keep flowing even while one datapoint
    takes long to make. ``epochs=None`` sends forever (tensorpack's producer always does). ``send_timeout``
    (seconds) gives up with :class:`RemoteConnectionError` when no consumer takes a message for that long
    (default: wait). The end-and-goodbye marker of the last pass is delivered before returning (within
    ``send_timeout``): a binding producer returns once its consumer, having read it, hung up; a connecting
    one waits for that at most 5 s, since a binding consumer hangs up only when closed (closing sooner
    could lose what the consumer had not read yet: libzmq drops it). Arrays are sent without copying: the flow
    must not modify an array after yielding it.

    ``keys``: a key folder made by ``bridgeflow keys`` (or :func:`~bridgeflow.remote.generate_keys`), the
    same on every machine: the stream is encrypted and authenticated with CurveZMQ, and only a consumer
    holding the keys can connect (see :mod:`bridgeflow.remote._keys`). Without keys, any peer that can
    connect can read the stream (or, connecting to a consumer, pass for one), so ``addr`` must be one no
    other machine can reach (``tcp://127.0.0.1:PORT``, ``ipc://PATH``) unless ``allow_insecure=True``
    says the network is trusted.
    """
    who = "send_dataflow_zmq"
    zmq = require("zmq", who)
    addr = P.check_address(addr, "addr")
    hwm = int(_positive(hwm, "hwm", who))
    heartbeat_s = float(_positive(heartbeat_s, "heartbeat_s", who))
    _positive(send_timeout, "send_timeout", who, allow_none=True)
    if epochs is not None:
        epochs = int(_positive(epochs, "epochs", who))
    codec = _codec(format, codec, allow_pickle, who)
    if not isinstance(bind, bool):
        raise TypeError(f"{who}: bind must be True or False, got {bind!r}")
    if not hasattr(df, "__iter__"):
        raise TypeError(f"{who}: df must be a DataFlow or iterable, got {type(df).__name__}")
    if keys is not None:
        keys = load_keys(keys)
    P.check_trusted(addr, keys, bool(allow_insecure), bind, who)
    if hasattr(df, "reset_state"):
        df.reset_state()

    ctx = zmq.Context()
    security = Security(ctx, keys)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    # A PUSH socket reads nothing, but ZeroMQ queues what a peer sends it: keep that to one small message.
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 10)
    sock.setsockopt(zmq.RCVHWM, 1)
    if send_timeout is not None:
        sock.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
    peers = _Peers(zmq, sock)  # before binding or connecting: every connection is counted
    try:
        if bind:
            security.binding(sock)
            sock.bind(addr)
        else:
            security.connecting(sock)
            if keys is not None:  # queue nothing before a handshake succeeded: one that fails is then named
                sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(addr)
    except zmq.ZMQError as exc:
        _close(ctx, sock, peers, security, 0)
        hint = "" if bind else " (a connecting producer needs the consumer's address, not a wildcard)"
        raise RemoteConnectionError(f"{who}: cannot {'bind' if bind else 'connect to'} {addr}: {exc}{hint}",
                                    addr=addr) from exc
    # A connecting producer names itself in every message: the consumer binds, and hears from many. Its
    # first message says hello, so that one message from a stranger cannot pass for a producer's.
    prefix = [] if bind else [P.TAG + os.urandom(P.TAG_ID_BYTES)]
    if prefix:
        try:
            sock.send_multipart(prefix + [P.HELLO])
        except zmq.Again:
            _close(ctx, sock, peers, security, 0)
            raise RemoteConnectionError(f"{who}: no consumer took a message on {addr} for {send_timeout} s "
                                        f"(send_timeout){security.note()}", addr=addr) from None

    total = None
    if epochs is not None:
        try:
            total = len(df) * epochs  # type: ignore[arg-type]  # a flow without len(): TypeError, caught
        except TypeError:
            total = None
    bar = None
    if progress:
        bar = progress_bar(total=total, desc=f"serve {addr}", unit="dp")
    sent = 0
    linger = 0
    reader = Producer(functools.partial(_read_source, df, epochs, codec), depth=_QUEUE_DEPTH,
                      name=f"bridgeflow-zmq-reader {addr}")
    try:
        while True:
            try:
                kind, payload = reader.get(timeout=heartbeat_s)
            except queue.Empty:
                peers.read()
                try:
                    sock.send_multipart(prefix + [P.HEARTBEAT], zmq.NOBLOCK)
                except zmq.Again:  # no consumer yet, or its queue is full (it has data to read)
                    pass
                continue
            except StopIteration:  # the reader ended after its last put (only when stopped)
                return sent
            except BaseException as exc:  # the flow's error: told to the consumer, then raised here
                kind, payload = "X", exc
            try:
                if kind == "D":
                    _send_datapoint(sock, payload, prefix)
                    sent += 1
                    if sent % 256 == 0:
                        peers.read()
                    if bar is not None:
                        bar.update(1)
                elif kind == "E":
                    sock.send_multipart(prefix + [P.END])
                elif kind == "L":
                    sock.send_multipart(prefix + [P.LAST])
                    linger = -1 if send_timeout is None else int(send_timeout * 1000)
                    # Closing now could lose the tail of the stream (see _Peers): wait for the consumer to hang
                    # up; one binding for many producers may never, so a connecting producer waits a while.
                    wait = send_timeout if bind else min(send_timeout or _HANGUP_GRACE_S, _HANGUP_GRACE_S)
                    peers.await_hangup(wait)
                    return sent
                else:
                    text = "".join(traceback.format_exception(type(payload), payload, payload.__traceback__))
                    try:
                        sock.send_multipart(prefix + [P.ERROR + text.encode("utf-8", "replace")], zmq.NOBLOCK)
                        linger = 2000
                        if bind:  # a connecting consumer hangs up on an error too (see _Peers)
                            peers.await_hangup(2.0)
                    except zmq.Again:
                        pass
                    raise payload
            except zmq.Again:
                raise RemoteConnectionError(f"{who}: no consumer took a message on {addr} for {send_timeout} s "
                                            f"(send_timeout){security.note()}", addr=addr) from None
    finally:
        if not reader.close(timeout=5):  # stuck inside the flow; a daemon thread, it stops at its next put
            log.warning("%s: the reader thread of %s is still inside the flow after 5 s", who, addr)
        if bar is not None:
            bar.close()
        _close(ctx, sock, peers, security, linger)


def _close(ctx: Any, sock: Any, peers: _Peers, security: Security, linger: int) -> None:
    """Close the producer's socket (after ``linger`` ms for what it still holds; -1: until sent), its monitor,
    its keys and its context."""
    peers.close(sock)
    sock.close(linger=linger)
    security.close()
    ctx.term()
