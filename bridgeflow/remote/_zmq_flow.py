"""Stream datapoints between processes or hosts over ZeroMQ PUSH/PULL sockets.

Topology: **each producer binds, the consumer connects.** :func:`send_dataflow_zmq` runs on a producer
host, binds a PUSH socket on its address and pushes the datapoints of a flow; :class:`RemoteDataZMQ` on
the trainer connects one PULL socket to each producer address it is given. Because the consumer knows
every address, it knows how many producers feed it, can tell which one went silent, and an error names
that producer. One producer serves one consumer (a second consumer connected to the same producer would
take every other datapoint).

tensorpack's topology is the reverse, and is there too: ``RemoteDataZMQ(addr1, addr2, bind=True)`` binds
its addresses and producers connect to them (``send_dataflow_zmq(df, addr, bind=False)``), any number
per address; each names itself in every message (see :mod:`bridgeflow.remote._protocol`), so silence,
errors and large datapoints are still tracked per producer. The producer sending code lives in
:mod:`bridgeflow.remote._zmq_send`.

Security: with ``keys=`` (a folder made by ``bridgeflow keys``, the same on every machine) every socket
speaks CurveZMQ, encrypted, and only peers holding the keys are heard or served
(:mod:`bridgeflow.remote._keys`). Without keys, any peer that can connect can read the stream, end it,
inject datapoints or corrupt it (a bound consumer drops and counts only stray messages: untagged, or
from a producer that did not say hello), so only addresses no other machine can reach are allowed
(loopback, ``ipc://``) unless ``allow_insecure=True`` says the network is trusted. Every receiving
socket has ZeroMQ refuse a frame larger than any producer sends (``MAXMSGSIZE``, 2 MiB) before it
binds or connects.

Datapoints travel as the frames of :func:`bridgeflow.serialize.encode_frames`: array bytes are
their own frames, sent without copying (and without pickle: the safe codec is the default). A
datapoint over 1 MiB travels in 1 MiB pieces after a header that announces its size (see
:mod:`bridgeflow.remote._protocol`): the consumer sees it arriving piece by piece and refuses one over
its ``max_message_bytes`` before receiving it.

Back-pressure: each side holds at most ``hwm`` messages per connection (ZeroMQ's high-water mark), plus
what the operating system buffers on the socket; a producer whose consumer does not read blocks in
``send``, so memory stays bounded on both sides.

Liveness: an idle producer sends a heartbeat every ``heartbeat_s``. A producer from which nothing
arrived for ``timeout`` seconds (no datapoint, no piece of one, no heartbeat), with nothing queued for
the consumer, is *lost*: with
``on_lost="raise"`` (the default) the consumer raises :class:`ProducerLostError` naming its address;
iterating again goes on with the other producers (their queued datapoints are kept). With
``on_lost="skip"`` the loss is logged and the iteration goes on; only when every producer is lost does
it raise. A consumer busy for a long time does not declare a live producer dead: its heartbeats (or,
with a full queue, its data) wait in the socket. A large datapoint over a slow link is not silence
either: each 1 MiB piece that arrives counts (so a link must carry at least 1 MiB per ``timeout``).

End of stream: after each pass over its flow a producer sends an *end* marker; an iteration of
:class:`RemoteDataZMQ` ends when every producer still connected has sent one (a producer that sent its
marker is not read again until the next iteration, so epochs do not mix). The end of its last pass
(``epochs``) also says goodbye (one message, so a consumer that stops after that epoch and closes cannot
leave the producer waiting to say goodbye); the producer closes and is no longer waited for.
``epochs=None`` streams forever.

Example:
    >>> # producer host
    >>> send_dataflow_zmq(df, "tcp://127.0.0.1:8877", epochs=None)     # doctest: +SKIP
    >>> # trainer
    >>> with RemoteDataZMQ(["tcp://127.0.0.1:8877"]) as df:            # doctest: +SKIP
    ...     for dp in df: ...
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ..engine import DECODE_ERRORS, DataFlow, DataFlowTerminated, require
from ..serialize import CorruptDataError, decode_frames
from . import _protocol as P
from ._errors import MessageTooLargeError, ProducerError, ProducerLostError, RemoteConnectionError
from ._keys import CurveKeys, Security, load_keys
from ._zmq_send import _QUEUE_DEPTH, _positive, send_dataflow_zmq  # noqa: F401 - re-exported

__all__ = ["RemoteDataZMQ", "send_dataflow_zmq"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_MAX_BOUND_PRODUCERS = 4096


# --- consumer -------------------------------------------------------------------------------------

_ACTIVE, _FINISHED, _LOST = "active", "finished", "lost"
_INCOMPLETE = object()  # a piece of a datapoint arriving in pieces: nothing to yield yet


class _Producer:
    """The consumer's view of one producer: its socket, state and the time it was last heard from.

    ``shared``: the socket is a bound one that other producers also send to (``bind=True``).
    """

    __slots__ = ("addr", "sock", "state", "ended", "last_seen", "split", "shared", "spoke")

    def __init__(self, addr: str, sock: Any, shared: bool = False) -> None:
        self.addr, self.sock, self.shared = addr, sock, shared
        self.state = _ACTIVE
        self.ended = False  # sent its end marker in the current iteration
        self.last_seen = time.monotonic()
        self.split: P.Split | None = None  # a datapoint arriving in pieces
        self.spoke = not shared  # a producer sharing a bound address: sent something besides its hello


class RemoteDataZMQ(DataFlow):
    """A flow of the datapoints that producers push from :func:`send_dataflow_zmq` (see the module doc).

    ``addrs``: one address or a list, one per producer (each producer binds, this flow connects).
    ``addr2``: a second address, for tensorpack's ``RemoteDataZMQ(addr1, addr2)`` (an int here is taken as
    ``hwm``, the second argument of earlier bridgeflow versions). ``bind=True`` is tensorpack's topology:
    this flow binds every address and producers connect (``send_dataflow_zmq(..., bind=False)``), any
    number per address, told apart by the id each sends. The iteration is then endless, as tensorpack's
    is, unless ``producers=N``: it ends once N producers have sent their last pass (however late they
    connect). When no producer is sending (none connected yet, or all finished), it waits ``timeout``
    seconds for one before raising :class:`ProducerLostError`.
    ``hwm``: messages queued per producer (per bound address with ``bind=True``) on this side.
    ``timeout``: seconds a producer may stay silent while this flow waits before it counts as lost (keep
    it several times the producers' ``heartbeat_s``).
    ``on_lost``: ``"raise"`` (raise :class:`ProducerLostError`, then go on with the others when iterated
    again) or ``"skip"`` (log a warning and go on). Received arrays are writable views of the received
    messages (not copied again; each datapoint owns its memory; a datapoint over 1 MiB, which arrives in
    pieces, is copied once into its own buffer). ``allow_pickle`` reads data sent with
    ``codec="pickle"`` (only from producers you trust). ``max_message_bytes`` (default 1 GiB) refuses a
    larger datapoint with :class:`MessageTooLargeError` naming the producer, before receiving it when
    the producer announces its size as :func:`send_dataflow_zmq` does; ``max_buffered_bytes`` (default:
    ``max_message_bytes``) bounds the bytes of all datapoints being received in pieces at once, from every
    producer; ZeroMQ itself drops the connection of a peer that sends a frame larger than any producer
    sends (see :mod:`bridgeflow.remote._protocol`). ``keys``: a key folder made by ``bridgeflow keys``
    (:mod:`bridgeflow.remote._keys`): every socket speaks CurveZMQ, encrypted, and only producers holding
    the keys are heard (with ``bind=True`` others cannot connect; connecting, this flow talks only to a
    producer that holds them). Without keys, with ``bind=True`` anyone who can reach the address can send:
    an untagged message, or one from a producer that did not say hello, is dropped and counted; a peer
    that says hello is a producer, and can end, inject or corrupt the stream. So without keys only loopback
    and ``ipc://`` addresses are allowed; ``allow_insecure=True`` allows others, for a network you trust.

    Sockets are created in ``reset_state()``, in the process that iterates; ``close()`` closes them at once
    (queued datapoints are dropped) and ends ZeroMQ's I/O threads. ``len()`` is unknown.
    ``stats()``: ``datapoints``, ``producers`` (still connected), ``producers_lost``, ``messages_dropped``,
    ``peers_refused`` (handshakes with a key other than the job's), ``buffer_fill`` (the
    share of reads that found a datapoint already waiting: near 1 means the consumer is the bottleneck),
    ``consumer_wait_s`` and ``consumer_wait_frac``.

    Example:
        >>> df = RemoteDataZMQ(["tcp://10.0.0.5:8877", "tcp://10.0.0.6:8877"], timeout=30)  # doctest: +SKIP
    """

    _fed_from_outside = True  # what arrives is what producers send this process: per rank already

    def __init__(self, addrs: str | Sequence[str], addr2: str | None = None, hwm: int = 50, bind: bool = False, *,
                 producers: int | None = None, timeout: float = 30.0, on_lost: str = "raise",
                 allow_pickle: bool = False, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_buffered_bytes: int | None = None, keys: str | os.PathLike | CurveKeys | None = None,
                 allow_insecure: bool = False) -> None:
        who = type(self).__name__
        if isinstance(addr2, int) and not isinstance(addr2, bool):  # RemoteDataZMQ(addrs, hwm) of earlier versions
            addr2, hwm = None, addr2
        elif addr2 is not None and not isinstance(addr2, str):
            raise TypeError(f"{who}: addr2 must be an address string like 'tcp://127.0.0.1:8877', got {addr2!r}")
        items = [addrs] if isinstance(addrs, str) else list(addrs)
        self.addrs = P.check_addresses(items + ([addr2] if addr2 else []), "addrs")
        if not isinstance(bind, bool):
            raise TypeError(f"{who}: bind must be True or False, got {bind!r}")
        self.bind = bind
        if producers is not None:
            if not bind:
                raise ValueError(f"{who}: producers= counts the producers that connect to a bound address "
                                 "(bind=True); a connecting consumer knows its producers from addrs")
            producers = int(_positive(producers, "producers", who))
        self.producers = producers
        self.hwm = int(_positive(hwm, "hwm", who))
        self.timeout = float(_positive(timeout, "timeout", who))
        if on_lost not in ("raise", "skip"):
            raise ValueError(f"{who}: on_lost must be 'raise' or 'skip', got {on_lost!r}")
        self.on_lost = on_lost
        self.allow_pickle = bool(allow_pickle)
        for name, value in (("max_message_bytes", max_message_bytes), ("max_buffered_bytes", max_buffered_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{who}: {name} must be a positive integer, got {value!r}")
        self.max_message_bytes = max_message_bytes
        self.max_buffered_bytes = max_message_bytes if max_buffered_bytes is None else max_buffered_bytes
        self.keys = None if keys is None else load_keys(keys)
        self.allow_insecure = bool(allow_insecure)
        for addr in self.addrs:
            P.check_trusted(addr, self.keys, self.allow_insecure, bind, who)
        self._ctx: Any = None
        self._security: Security | None = None
        self._producers: list[_Producer] = []
        self._bound: list[tuple[str, Any]] = []  # bind=True: (address, socket)
        self._by_id: dict[bytes, _Producer] = {}

    # lifecycle

    def _on_reset(self) -> None:
        self.close()
        zmq = require("zmq", type(self).__name__)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._security = Security(self._ctx, self.keys)
        self._producers, self._bound, self._by_id = [], [], {}
        try:
            for addr in self.addrs:
                sock = self._ctx.socket(zmq.PULL)
                sock.setsockopt(zmq.RCVHWM, self.hwm)
                sock.setsockopt(zmq.LINGER, 0)
                # A frame larger than any a producer sends is refused by ZeroMQ itself (it drops the
                # connection), so that a peer cannot make this process buffer one. Set before binding or
                # connecting: it applies to connections made after it.
                sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
                if self.bind:
                    self._bound.append((addr, sock))
                    if self.keys is None and not P.is_local(addr):
                        log.info("%s binds %s without keys (allow_insecure=True): any peer that can reach it can "
                                 "send it datapoints", type(self).__name__, addr)
                    self._security.binding(sock)
                    sock.bind(addr)
                else:
                    self._producers.append(_Producer(addr, sock))
                    self._security.connecting(sock)
                    sock.connect(addr)
        except zmq.ZMQError as exc:
            self.close()
            if self.bind:
                raise RemoteConnectionError(f"{type(self).__name__}: cannot bind {addr}: {exc}", addr=addr) from exc
            raise RemoteConnectionError(
                f"{type(self).__name__}: cannot connect to {addr}: {exc} (bridgeflow's consumer connects to "
                "producers that bind; for tensorpack's topology, where the consumer binds a wildcard address "
                "such as tcp://*:PORT, pass bind=True)", addr=addr) from exc
        self._next = 0
        self._sweep_at = 0.0
        self._n = self._ready = self._reads = 0
        self._lost = self._dropped = self._buffered = 0
        self._wait = 0.0
        self._started: float | None = None

    def _note(self) -> str:
        """What the keys say about a silent producer (see Security.note); nothing once closed."""
        return self._security.note() if self._security is not None else ""

    def close(self) -> None:
        producers, self._producers = self._producers, []
        bound, self._bound = getattr(self, "_bound", []), []
        self._by_id = {}
        for sock in [p.sock for p in producers] + [sock for _, sock in bound]:
            if not sock.closed:
                sock.close(linger=0)
        security, self._security = getattr(self, "_security", None), None
        if security is not None:
            security.close()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for key in ("_ctx", "_producers", "_zmq", "_bound", "_by_id", "_security"):
            state.pop(key, None)
        state["_ctx"], state["_producers"], state["_bound"], state["_by_id"] = None, [], [], {}
        state["_security"] = None
        return state

    def _own_stats(self) -> dict[str, float]:
        started = getattr(self, "_started", None)
        if started is None:
            return {}
        elapsed = max(time.perf_counter() - started, 1e-9)
        return {
            "datapoints": self._n,
            "producers": sum(p.state == _ACTIVE for p in self._producers),
            "producers_lost": self._lost,
            "messages_dropped": self._dropped,
            "peers_refused": 0 if self._security is None else self._security.refused,
            "buffer_fill": self._ready / max(self._reads, 1),
            "consumer_wait_s": self._wait,
            "consumer_wait_frac": min(1.0, self._wait / elapsed),
        }

    # iteration

    def _why_not_resumable(self) -> str:
        return ("RemoteDataZMQ cannot save its position: it reads what producers send over the network, which "
                "cannot be rewound; resume the producers instead")

    def _iter_epoch(self) -> Iterator:
        if self._ctx is None:
            raise DataFlowTerminated(f"{type(self).__name__} is closed; call reset_state() to connect again")
        if self._started is None:
            self._started = time.perf_counter()
        if self.bind:
            yield from self._iter_bound()
            return
        if not any(p.state == _ACTIVE for p in self._producers):
            log.warning("%s: no producer is connected any more (all finished or lost); the iteration is empty",
                        type(self).__name__)
        while True:
            if self._ctx is None:
                raise DataFlowTerminated(f"{type(self).__name__} was closed while being iterated")
            pending = [p for p in self._producers if p.state == _ACTIVE and not p.ended]
            if not pending:
                if self._producers and all(p.state == _LOST for p in self._producers):
                    raise ProducerLostError(f"{type(self).__name__}: every producer is lost "
                                            f"({', '.join(self.addrs)})", addr=", ".join(self.addrs))
                for p in self._producers:
                    p.ended = False
                return
            got = self._receive(pending)
            if got is None:  # producers were lost and skipped: look again at who is left
                continue
            p, frames = got
            head = frames[0].buffer
            if head[:3] == P.CONTROL:
                self._control(p, bytes(head))
                continue
            dp = self._decode(p, frames)
            if dp is not _INCOMPLETE:
                self._n += 1
                yield dp

    def _decode(self, p: _Producer, frames: list) -> Any:
        """The datapoint of a data message, or ``_INCOMPLETE`` for a piece of a large one."""
        try:
            parts = self._datapoint_frames(p, frames)
            if parts is None:  # a piece of a large datapoint: more to come
                return _INCOMPLETE
            return decode_frames(parts, allow_pickle=self.allow_pickle)
        except DECODE_ERRORS as exc:
            raise type(exc)(f"{type(self).__name__}: bad message from {p.addr}: {exc}") from exc

    # bind=True: producers connect, any number per bound address, each naming itself in every message

    def _iter_bound(self) -> Iterator:
        who = type(self).__name__
        heard = time.monotonic()  # the last time a producer spoke (or the iteration began)
        finished = lost = 0  # producers that finished / were lost during this iteration
        while True:
            if self._ctx is None:
                raise DataFlowTerminated(f"{who} was closed while being iterated")
            if self.producers is not None and finished >= self.producers:
                return  # the producers this flow waits for have all sent their last pass
            active = [p for p in self._producers if p.state == _ACTIVE]
            if not active and lost and not finished and self.producers is None:
                raise ProducerLostError(f"{who}: every producer is lost ({', '.join(self.addrs)})",
                                        addr=", ".join(self.addrs))
            got = self._receive_bound(active, heard)
            if got is None:
                before = sum(p.state == _LOST for p in self._producers)
                self._sweep_bound(active, heard, finished)
                lost += sum(p.state == _LOST for p in self._producers) - before
                continue
            addr, frames = got
            p = self._tagged(addr, frames)
            if p is None or p.state != _ACTIVE:  # a hello, a dropped message, or a producer finished or lost
                continue  # (dropped messages do not count as heard: a stranger cannot hold off the timeout)
            heard = time.monotonic()
            frames = frames[1:]
            head = frames[0].buffer
            p.spoke = True
            if head[:3] == P.CONTROL:
                msg = bytes(head)
                if msg not in (P.END, P.HELLO):  # passes do not end iterations here: producers come and go
                    self._control(p, msg)
                finished += p.state == _FINISHED
                continue
            dp = self._decode(p, frames)
            if dp is not _INCOMPLETE:
                self._n += 1
                yield dp

    def _tagged(self, addr: str, frames: list) -> _Producer | None:
        """The producer a message on the bound ``addr`` comes from, or ``None`` when there is nothing more to
        do with it: a hello (the producer is added) or a message dropped (untagged, or from a producer that
        did not say hello: one stray or spoofed message cannot end or corrupt the stream)."""
        head = frames[0].buffer
        if len(frames) < 2 or len(head) != len(P.TAG) + P.TAG_ID_BYTES or bytes(head[:len(P.TAG)]) != P.TAG:
            self._drop_message(addr, "not from bridgeflow's send_dataflow_zmq(..., bind=False) (tensorpack's "
                                     "send_dataflow_zmq sends pickled or msgpack datapoints, which bridgeflow does "
                                     "not read; nothing was unpickled)")
            return None
        pid = bytes(head[len(P.TAG):])
        p = self._by_id.get(pid)
        if p is not None:
            p.last_seen = time.monotonic()
            return p
        if bytes(frames[1].buffer) != P.HELLO or len(frames) != 2:
            self._drop_message(addr, f"from a producer ({pid.hex()}) that did not say hello first")
            return None
        if len(self._by_id) >= _MAX_BOUND_PRODUCERS:
            self._drop_message(addr, f"a hello past {_MAX_BOUND_PRODUCERS} producers")
            return None
        try:
            peer = " from " + frames[0].get("Peer-Address")
        except Exception:  # not every transport knows its peer's address (ipc)
            peer = ""
        sock = next(sock for a, sock in self._bound if a == addr)
        p = self._by_id[pid] = _Producer(f"{addr} (producer {pid.hex()}{peer})", sock, shared=True)
        self._producers.append(p)
        log.info("%s: producer %s connected", type(self).__name__, p.addr)
        return None

    def _drop_message(self, addr: str, why: str) -> None:
        self._dropped += 1
        if self._dropped & (self._dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th... time
            log.warning("%s: dropped a message on %s: %s (%d dropped so far; with keys= strangers cannot send)",
                        type(self).__name__, addr, why, self._dropped)

    def _receive_bound(self, active: list[_Producer], heard: float) -> tuple[str, list] | None:
        """The next message on a bound socket (fair between them), or ``None`` when it is time to look for
        silent producers."""
        zmq = self._zmq
        n = len(self._bound)
        start = self._next % n
        self._reads += 1
        for k in range(n):  # fast path: a message is already waiting
            addr, sock = self._bound[(start + k) % n]
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            self._next = start + k + 1
            self._ready += 1
            return addr, frames
        deadline = (min(p.last_seen for p in active) if active else heard) + self.timeout
        wait_ms = min(250, max(0, int((deadline - time.monotonic()) * 1000)) + 1)
        poller = zmq.Poller()
        for _, sock in self._bound:
            poller.register(sock, zmq.POLLIN)
        t0 = time.perf_counter()
        try:
            events = dict(poller.poll(wait_ms))
        finally:
            self._wait += time.perf_counter() - t0
        for addr, sock in self._bound:
            if events.get(sock):
                return addr, sock.recv_multipart(zmq.NOBLOCK, copy=False)
        return None

    def _sweep_bound(self, active: list[_Producer], heard: float, finished: int) -> None:
        """Raise (or, with ``on_lost="skip"``, log) for producers silent for ``timeout`` with nothing queued;
        with no producer sending, raise once nothing at all arrived for ``timeout``."""
        now = time.monotonic()
        if any(sock.poll(0) for _, sock in self._bound):
            return  # something is queued: read it first (it may be from the silent one)
        if not active:
            if now - heard >= self.timeout:
                done = sum(p.state == _FINISHED for p in self._producers)
                hint = (f"; {done} producer(s) finished: pass producers=N to end an iteration once N have"
                        if done and self.producers is None else "")
                waiting = (f", waiting for {self.producers - finished} more producer(s) to finish"
                           if self.producers is not None else "")
                if self._dropped:
                    hint += (f"; {self._dropped} message(s) not from bridgeflow's send_dataflow_zmq(..., bind=False) "
                             "were dropped (tensorpack's producer sends pickles, which bridgeflow does not read)")
                raise ProducerLostError(
                    f"{type(self).__name__}: no producer sent anything to {', '.join(self.addrs)} for "
                    f"{self.timeout:g} s{waiting} (bind=True: producers connect with "
                    f"send_dataflow_zmq(..., bind=False)){hint}{self._note()}", addr=", ".join(self.addrs),
                    silent_s=now - heard)
            return
        lost = [p for p in active if now - p.last_seen >= self.timeout]
        for p in [p for p in lost if not p.spoke]:  # a hello and nothing else: a stranger, or gone at once
            self._drop(p, _LOST)
            self._drop_message(p.addr, f"a producer that said hello and nothing else for {self.timeout:g} s")
        lost = [p for p in lost if p.spoke]
        if lost:
            self._lose(lost, now)

    def _datapoint_frames(self, p: _Producer, frames: list) -> list | None:
        """The frames of a datapoint, or ``None`` while one arriving in pieces is incomplete."""
        head = frames[0].buffer
        if head[:3] != P.SPLIT and p.split is None:
            self._check_size(p, sum(f.buffer.nbytes for f in frames))
            return [f.buffer for f in frames]
        try:
            kind = bytes(head[:4])
            if kind == P.SPLIT_HEAD and len(frames) == 1 and p.split is None:
                try:
                    total, sizes = P.read_split_header(bytes(head))
                except ValueError as exc:
                    raise CorruptDataError(str(exc)) from None
                self._check_size(p, total)
                self._check_buffered(p, total)
                p.split = P.Split(total, sizes)
                self._buffered += total
                return None
            if kind == P.SPLIT_PART and len(frames) == 2 and len(head) == 4 and p.split is not None:
                done = p.split.add(frames[1].buffer)
                if done is not None:
                    self._end_split(p)
                return done
            if p.split is not None:
                raise CorruptDataError("a message other than the next piece of a datapoint arriving in pieces")
            raise CorruptDataError(f"unexpected split message {bytes(head[:8])!r} ({len(frames)} frames)")
        except CorruptDataError:  # the stream of this producer is out of step: nothing more of it can be read
            self._drop(p, _LOST)
            self._lost += 1
            raise

    def _check_buffered(self, p: _Producer, nbytes: int) -> None:
        """Datapoints being received in pieces hold at most ``max_buffered_bytes`` in all, whatever the
        number of producers."""
        if self._buffered + nbytes > self.max_buffered_bytes:
            others = self._buffered
            self._drop(p, _LOST)
            self._lost += 1
            raise MessageTooLargeError(
                f"{type(self).__name__}: producer {p.addr} announced a datapoint of {nbytes:,} bytes while "
                f"{others:,} bytes of other producers' datapoints are being received: over max_buffered_bytes="
                f"{self.max_buffered_bytes:,}; dropped (raise max_buffered_bytes to accept it)",
                addr=p.addr, nbytes=nbytes, limit=self.max_buffered_bytes)

    def _end_split(self, p: _Producer) -> None:
        if p.split is not None:
            self._buffered -= p.split.buf.nbytes
            p.split = None

    def _check_size(self, p: _Producer, nbytes: int) -> None:
        if nbytes > self.max_message_bytes:
            self._drop(p, _LOST)
            self._lost += 1
            raise MessageTooLargeError(
                f"{type(self).__name__}: producer {p.addr} sent a datapoint of {nbytes:,} bytes, over "
                f"max_message_bytes={self.max_message_bytes:,}; dropped (raise max_message_bytes to accept it)",
                addr=p.addr, nbytes=nbytes, limit=self.max_message_bytes)

    def _control(self, p: _Producer, msg: bytes) -> None:
        if msg == P.END:
            p.ended = True
        elif msg == P.LAST or msg == P.BYE:  # (producers of older versions sent END, then BYE)
            log.info("%s: producer %s finished", type(self).__name__, p.addr)
            self._drop(p, _FINISHED)
        elif msg.startswith(P.ERROR):
            self._drop(p, _LOST)
            self._lost += 1
            text = msg[len(P.ERROR):].decode("utf-8", "replace")
            raise ProducerError(f"the flow on producer {p.addr} raised:\n{text}", addr=p.addr)
        # a heartbeat only refreshes last_seen (done in _receive)

    def _drop(self, p: _Producer, state: str) -> None:
        p.state = state
        self._end_split(p)
        if not p.shared:  # a bound socket stays open for the other producers; this one's messages are ignored
            p.sock.close(linger=0)

    def _receive(self, pending: list[_Producer]) -> tuple[_Producer, list] | None:
        """The next message from one of ``pending``, fair between them; ``None`` when silent producers were
        dropped (``on_lost="skip"``)."""
        zmq = self._zmq
        if time.monotonic() >= self._sweep_at and self._sweep(pending):
            return None
        n = len(pending)
        start = self._next % n
        self._reads += 1
        for k in range(n):  # fast path: a message is already waiting
            p = pending[(start + k) % n]
            try:
                frames = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            self._next = start + k + 1
            self._ready += 1
            p.last_seen = time.monotonic()
            return p, frames
        t0 = time.perf_counter()
        try:
            return self._wait_for(pending)
        finally:
            self._wait += time.perf_counter() - t0

    def _sweep(self, pending: list[_Producer]) -> bool:
        """Drop the producers silent for ``timeout`` with nothing queued; True if any was dropped.

        A live producer always has something queued after ``heartbeat_s`` (a heartbeat, or data when its
        queue is full), however long this consumer was busy, so an empty socket means silence.
        """
        now = time.monotonic()
        self._sweep_at = now + min(0.25, self.timeout / 4)
        lost = [p for p in pending if now - p.last_seen >= self.timeout and not p.sock.poll(0)]
        if lost:
            self._lose(lost, now)
        return bool(lost)

    def _wait_for(self, pending: list[_Producer]) -> tuple[_Producer, list] | None:
        zmq = self._zmq
        poller = zmq.Poller()
        for p in pending:
            poller.register(p.sock, zmq.POLLIN)
        while True:
            deadline = min(p.last_seen for p in pending) + self.timeout
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000)) + 1
            events = dict(poller.poll(min(wait_ms, 250)))
            for p in pending:
                if events.get(p.sock):
                    frames = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    p.last_seen = time.monotonic()
                    return p, frames
            if self._sweep(pending):
                return None

    def _lose(self, lost: list[_Producer], now: float) -> None:
        for p in lost:
            self._drop(p, _LOST)
        self._lost += len(lost)
        names = ", ".join(p.addr for p in lost)
        silent = now - min(p.last_seen for p in lost)
        left = sum(p.state == _ACTIVE for p in self._producers)
        msg = (f"{type(self).__name__}: producer {names} sent nothing for {silent:.1f} s "
               f"(timeout={self.timeout:g} s); dropped, {left} other producer(s) go on{self._note()}")
        if self.on_lost == "raise":
            raise ProducerLostError(msg, addr=lost[0].addr, silent_s=silent)
        log.warning("%s", msg)
