"""The receiving side of :class:`~bridgeflow.remote.RemoteDataZMQ`, one class per socket topology.

:class:`RemoteDataZMQ` checks its arguments and owns the ZeroMQ context and the keys; at ``reset_state()``
it makes one consumer here, which owns the sockets and the producers it hears from:

- :class:`ConnectingConsumer` (bridgeflow's topology): one PULL socket connected to each producer's
  address, so each producer is known from the start and has a socket of its own; an iteration ends when
  every producer still connected has sent its end marker.
- :class:`BindingConsumer` (tensorpack's, ``bind=True``): a PULL socket bound on each address, which any
  number of producers connect to; a producer is known by the id it sends with every message, from its
  hello on; an iteration is endless unless ``producers=N``.

:class:`Consumer`, their base, is what both share: a datapoint's frames, arriving whole or in pieces, and
their size limits; the control messages; dropping a lost producer; the counters of ``stats()``. The wire
format is :mod:`bridgeflow.remote._protocol`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..engine import DECODE_ERRORS, DataFlowTerminated
from ..serialize import CorruptDataError, decode_frames
from . import _protocol as P
from ._errors import MessageTooLargeError, ProducerError, ProducerLostError, RemoteConnectionError
from ._keys import Security

if TYPE_CHECKING:
    from ._zmq_flow import RemoteDataZMQ

__all__ = ["BindingConsumer", "ConnectingConsumer", "Consumer"]

log = logging.getLogger("bridgeflow.remote._zmq_flow")  # the flow's logger: users filter on the flow's name

_MAX_BOUND_PRODUCERS = 4096

_ACTIVE, _FINISHED, _LOST = "active", "finished", "lost"
_INCOMPLETE = object()  # a piece of a datapoint arriving in pieces: nothing to yield yet


class _Producer:
    """The consumer's view of one producer: its socket, state and the time it was last heard from.

    ``shared``: the socket is a bound one that other producers also send to (``bind=True``).
    """

    __slots__ = ("addr", "sock", "state", "ended", "last_seen", "split", "shared", "spoke", "received")

    def __init__(self, addr: str, sock: Any, shared: bool = False) -> None:
        self.addr, self.sock, self.shared = addr, sock, shared
        self.state = _ACTIVE
        self.ended = False  # sent its end marker in the current iteration
        self.last_seen = time.monotonic()
        self.split: P.Split | None = None  # a datapoint arriving in pieces
        self.spoke = not shared  # a producer sharing a bound address: sent something besides its hello
        self.received = 0  # datapoints from it, every pass: an error for a lost producer says how far it got


class Consumer:
    """The sockets of one ``reset_state()`` of ``flow`` and what it heard on them (see the module doc).

    The settings (``timeout``, ``on_lost``, the size limits, ...) are read from ``flow``, which made this
    consumer; ``close()`` closes the sockets, and the counters stay for ``stats()``.
    """

    def __init__(self, flow: RemoteDataZMQ, zmq: ModuleType, ctx: Any, security: Security) -> None:
        self.flow, self.zmq = flow, zmq
        self.security: Security | None = security
        self.who = type(flow).__name__
        self.closed = False
        self._producers: list[_Producer] = []
        try:
            for addr in flow.addrs:
                sock = ctx.socket(zmq.PULL)
                sock.setsockopt(zmq.RCVHWM, flow.hwm)
                sock.setsockopt(zmq.LINGER, 0)
                # A frame larger than any a producer sends is refused by ZeroMQ itself (it drops the
                # connection), so that a peer cannot make this process buffer one. Set before binding or
                # connecting: it applies to connections made after it.
                sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES)
                self._open(addr, sock)
        except zmq.ZMQError as exc:
            self.close()
            raise self._cannot_open(addr, exc) from exc
        self._next = 0
        self._n = self._ready = self._reads = 0
        self._lost = self._dropped = self._buffered = 0
        self._wait = 0.0
        self._started: float | None = None

    # the topology's part

    def _open(self, addr: str, sock: Any) -> None:
        """Bind or connect ``sock`` to ``addr``, after taking it in (so that ``close()`` closes it)."""
        raise NotImplementedError

    def _cannot_open(self, addr: str, exc: Exception) -> RemoteConnectionError:
        raise NotImplementedError

    def _sockets(self) -> list[Any]:
        """Every socket this consumer opened."""
        return [p.sock for p in self._producers]

    def _epoch(self) -> Iterator:
        raise NotImplementedError

    # what both topologies share

    def epoch(self) -> Iterator:
        """One iteration of the flow: the datapoints the producers send, until the topology's end."""
        if self._started is None:
            self._started = time.perf_counter()
        return self._epoch()

    def close(self) -> None:
        """Close the sockets at once (queued datapoints are dropped)."""
        self.closed = True
        for sock in self._sockets():
            if not sock.closed:
                sock.close(linger=0)
        self._producers = []
        self.security = None  # the flow closes it; a closed consumer notes nothing

    def stats(self) -> dict[str, float]:
        if self._started is None:
            return {}
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        return {
            "datapoints": self._n,
            "producers": sum(p.state == _ACTIVE for p in self._producers),
            "producers_lost": self._lost,
            "messages_dropped": self._dropped,
            "peers_refused": 0 if self.security is None else self.security.refused,
            "buffer_fill": self._ready / max(self._reads, 1),
            "consumer_wait_s": self._wait,
            "consumer_wait_frac": min(1.0, self._wait / elapsed),
        }

    def _note(self) -> str:
        """What the keys say about a silent producer (see Security.note); nothing once closed."""
        return self.security.note() if self.security is not None else ""

    def _decode(self, p: _Producer, frames: list) -> Any:
        """The datapoint of a data message, or ``_INCOMPLETE`` for a piece of a large one."""
        try:
            parts = self._datapoint_frames(p, frames)
            if parts is None:  # a piece of a large datapoint: more to come
                return _INCOMPLETE
            return decode_frames(parts, allow_pickle=self.flow.allow_pickle)
        except DECODE_ERRORS as exc:
            raise type(exc)(f"{self.who}: bad message from {p.addr}: {exc}") from exc

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
        limit = self.flow.max_buffered_bytes
        if self._buffered + nbytes > limit:
            others = self._buffered
            self._drop(p, _LOST)
            self._lost += 1
            raise MessageTooLargeError(
                f"{self.who}: producer {p.addr} announced a datapoint of {nbytes:,} bytes while "
                f"{others:,} bytes of other producers' datapoints are being received: over max_buffered_bytes="
                f"{limit:,}; dropped (raise max_buffered_bytes to accept it)",
                addr=p.addr, nbytes=nbytes, limit=limit)

    def _end_split(self, p: _Producer) -> None:
        if p.split is not None:
            self._buffered -= p.split.buf.nbytes
            p.split = None

    def _check_size(self, p: _Producer, nbytes: int) -> None:
        limit = self.flow.max_message_bytes
        if nbytes > limit:
            self._drop(p, _LOST)
            self._lost += 1
            raise MessageTooLargeError(
                f"{self.who}: producer {p.addr} sent a datapoint of {nbytes:,} bytes, over "
                f"max_message_bytes={limit:,}; dropped (raise max_message_bytes to accept it)",
                addr=p.addr, nbytes=nbytes, limit=limit)

    def _control(self, p: _Producer, msg: bytes) -> None:
        if msg == P.END:
            p.ended = True
        elif msg == P.LAST or msg == P.BYE:  # (producers of older versions sent END, then BYE)
            log.info("%s: producer %s finished", self.who, p.addr)
            self._drop(p, _FINISHED)
        elif msg.startswith(P.ERROR):
            self._drop(p, _LOST)
            self._lost += 1
            text = msg[len(P.ERROR):].decode("utf-8", "replace")
            raise ProducerError(f"the flow on producer {p.addr} raised:\n{text}", addr=p.addr)
        # a heartbeat only refreshes last_seen (done where the message is received)

    def _drop(self, p: _Producer, state: str) -> None:
        p.state = state
        self._end_split(p)
        if not p.shared:  # a bound socket stays open for the other producers; this one's messages are ignored
            p.sock.close(linger=0)

    def _lose(self, lost: list[_Producer], now: float) -> None:
        for p in lost:
            self._drop(p, _LOST)
        self._lost += len(lost)
        names = ", ".join(f"{p.addr} (after {p.received:,} datapoints from it)" for p in lost)
        silent = now - min(p.last_seen for p in lost)
        left = sum(p.state == _ACTIVE for p in self._producers)
        msg = (f"{self.who}: producer {names} sent nothing for {silent:.1f} s "
               f"(timeout={self.flow.timeout:g} s) and no end of its pass; dropped, {left} other producer(s) "
               f"go on{self._note()}")
        if self.flow.on_lost == "raise":
            raise ProducerLostError(msg, addr=lost[0].addr, silent_s=silent)
        log.warning("%s", msg)


class ConnectingConsumer(Consumer):
    """bridgeflow's topology: each producer binds, this consumer connects one socket to each."""

    def __init__(self, flow: RemoteDataZMQ, zmq: ModuleType, ctx: Any, security: Security) -> None:
        super().__init__(flow, zmq, ctx, security)
        self._sweep_at = 0.0

    def _open(self, addr: str, sock: Any) -> None:
        assert self.security is not None  # open
        self._producers.append(_Producer(addr, sock))
        self.security.connecting(sock)
        sock.connect(addr)

    def _cannot_open(self, addr: str, exc: Exception) -> RemoteConnectionError:
        return RemoteConnectionError(
            f"{self.who}: cannot connect to {addr}: {exc} (bridgeflow's consumer connects to "
            "producers that bind; for tensorpack's topology, where the consumer binds a wildcard address "
            "such as tcp://*:PORT, pass bind=True)", addr=addr)

    def _epoch(self) -> Iterator:
        if not any(p.state == _ACTIVE for p in self._producers):
            log.warning("%s: no producer is connected any more (all finished or lost); the iteration is empty",
                        self.who)
        while True:
            if self.closed:
                raise DataFlowTerminated(f"{self.who} was closed while being iterated")
            pending = [p for p in self._producers if p.state == _ACTIVE and not p.ended]
            if not pending:
                if self._producers and all(p.state == _LOST for p in self._producers):
                    raise ProducerLostError(f"{self.who}: every producer is lost "
                                            f"({', '.join(self.flow.addrs)})", addr=", ".join(self.flow.addrs))
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
                p.received += 1
                yield dp

    def _receive(self, pending: list[_Producer]) -> tuple[_Producer, list] | None:
        """The next message from one of ``pending``, fair between them; ``None`` when silent producers were
        dropped (``on_lost="skip"``)."""
        zmq = self.zmq
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
        timeout = self.flow.timeout
        self._sweep_at = now + min(0.25, timeout / 4)
        lost = [p for p in pending if now - p.last_seen >= timeout and not p.sock.poll(0)]
        if lost:
            self._lose(lost, now)
        return bool(lost)

    def _wait_for(self, pending: list[_Producer]) -> tuple[_Producer, list] | None:
        zmq = self.zmq
        poller = zmq.Poller()
        for p in pending:
            poller.register(p.sock, zmq.POLLIN)
        while True:
            deadline = min(p.last_seen for p in pending) + self.flow.timeout
            wait_ms = max(0, int((deadline - time.monotonic()) * 1000)) + 1
            events = dict(poller.poll(min(wait_ms, 250)))
            for p in pending:
                if events.get(p.sock):
                    frames = p.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    p.last_seen = time.monotonic()
                    return p, frames
            if self._sweep(pending):
                return None


class BindingConsumer(Consumer):
    """tensorpack's topology (``bind=True``): this consumer binds every address and producers connect, any
    number per address, each naming itself in every message."""

    def __init__(self, flow: RemoteDataZMQ, zmq: ModuleType, ctx: Any, security: Security) -> None:
        self._bound: list[tuple[str, Any]] = []  # (address, socket)
        self._by_id: dict[bytes, _Producer] = {}
        super().__init__(flow, zmq, ctx, security)

    def _open(self, addr: str, sock: Any) -> None:
        assert self.security is not None  # open
        self._bound.append((addr, sock))
        if self.flow.keys is None and not P.is_local(addr):
            log.info("%s binds %s without keys (allow_insecure=True): any peer that can reach it can "
                     "send it datapoints", self.who, addr)
        self.security.binding(sock)
        sock.bind(addr)

    def _cannot_open(self, addr: str, exc: Exception) -> RemoteConnectionError:
        return RemoteConnectionError(f"{self.who}: cannot bind {addr}: {exc}", addr=addr)

    def _sockets(self) -> list[Any]:
        return [sock for _, sock in self._bound]  # the producers' sockets are these

    def close(self) -> None:
        super().close()
        self._bound, self._by_id = [], {}

    def _epoch(self) -> Iterator:
        who = self.who
        heard = time.monotonic()  # the last time a producer spoke (or the iteration began)
        finished = lost = 0  # producers that finished / were lost during this iteration
        while True:
            if self.closed:
                raise DataFlowTerminated(f"{who} was closed while being iterated")
            if self.flow.producers is not None and finished >= self.flow.producers:
                return  # the producers this flow waits for have all sent their last pass
            active = [p for p in self._producers if p.state == _ACTIVE]
            if not active and lost and not finished and self.flow.producers is None:
                raise ProducerLostError(f"{who}: every producer is lost ({', '.join(self.flow.addrs)})",
                                        addr=", ".join(self.flow.addrs))
            got = self._receive(active, heard)
            if got is None:
                before = sum(p.state == _LOST for p in self._producers)
                self._sweep(active, heard, finished)
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
                p.received += 1
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
        log.info("%s: producer %s connected", self.who, p.addr)
        return None

    def _drop_message(self, addr: str, why: str) -> None:
        self._dropped += 1
        if self._dropped & (self._dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th... time
            log.warning("%s: dropped a message on %s: %s (%d dropped so far; with keys= strangers cannot send)",
                        self.who, addr, why, self._dropped)

    def _receive(self, active: list[_Producer], heard: float) -> tuple[str, list] | None:
        """The next message on a bound socket (fair between them), or ``None`` when it is time to look for
        silent producers."""
        zmq = self.zmq
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
        deadline = (min(p.last_seen for p in active) if active else heard) + self.flow.timeout
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

    def _sweep(self, active: list[_Producer], heard: float, finished: int) -> None:
        """Raise (or, with ``on_lost="skip"``, log) for producers silent for ``timeout`` with nothing queued;
        with no producer sending, raise once nothing at all arrived for ``timeout``."""
        now = time.monotonic()
        timeout, producers, addrs = self.flow.timeout, self.flow.producers, ", ".join(self.flow.addrs)
        if any(sock.poll(0) for _, sock in self._bound):
            return  # something is queued: read it first (it may be from the silent one)
        if not active:
            if now - heard >= timeout:
                done = sum(p.state == _FINISHED for p in self._producers)
                hint = (f"; {done} producer(s) finished: pass producers=N to end an iteration once N have"
                        if done and producers is None else "")
                waiting = (f", waiting for {producers - finished} more producer(s) to finish"
                           if producers is not None else "")
                if self._dropped:
                    hint += (f"; {self._dropped} message(s) not from bridgeflow's send_dataflow_zmq(..., bind=False) "
                             "were dropped (tensorpack's producer sends pickles, which bridgeflow does not read)")
                raise ProducerLostError(
                    f"{self.who}: no producer sent anything to {addrs} for {timeout:g} s{waiting} (bind=True: "
                    f"producers connect with send_dataflow_zmq(..., bind=False)){hint}{self._note()}", addr=addrs,
                    silent_s=now - heard)
            return
        lost = [p for p in active if now - p.last_seen >= timeout]
        for p in [p for p in lost if not p.spoke]:  # a hello and nothing else: a stranger, or gone at once
            self._drop(p, _LOST)
            self._drop_message(p.addr, f"a producer that said hello and nothing else for {timeout:g} s")
        lost = [p for p in lost if p.spoke]
        if lost:
            self._lose(lost, now)
