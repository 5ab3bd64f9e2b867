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

The receiving side, one class per topology, is :mod:`bridgeflow.remote._zmq_consumer`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..engine import DataFlow, DataFlowTerminated, require
from . import _protocol as P
from ._errors import RemoteConnectionError
from ._keys import CurveKeys, Security, load_keys
from ._zmq_consumer import BindingConsumer, ConnectingConsumer, Consumer
from ._zmq_send import _QUEUE_DEPTH, _positive, send_dataflow_zmq  # noqa: F401 - re-exported

__all__ = ["RemoteDataZMQ", "send_dataflow_zmq"]

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


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
    _ctx: Any = None
    _security: Security | None = None
    _consumer: Consumer | None = None  # the topology's, made by reset_state(); kept after close() for stats()

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

    # lifecycle: the flow owns the ZeroMQ context and the keys, its consumer the sockets and the producers

    def _on_reset(self) -> None:
        self.close()
        zmq = require("zmq", type(self).__name__)
        self._ctx = zmq.Context()
        self._security = Security(self._ctx, self.keys)
        topology = BindingConsumer if self.bind else ConnectingConsumer
        try:
            self._consumer = topology(self, zmq, self._ctx, self._security)
        except RemoteConnectionError:  # the consumer closed the sockets it opened
            self.close()
            raise

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
        security, self._security = self._security, None
        if security is not None:
            security.close()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for key in ("_ctx", "_consumer", "_security"):
            state.pop(key, None)
        return state

    def _own_stats(self) -> dict[str, float]:
        return {} if self._consumer is None else self._consumer.stats()

    # iteration

    def _why_not_resumable(self) -> str:
        return ("RemoteDataZMQ cannot save its position: it reads what producers send over the network, which "
                "cannot be rewound; resume the producers instead")

    def _iter_epoch(self) -> Iterator:
        if self._ctx is None or self._consumer is None:
            raise DataFlowTerminated(f"{type(self).__name__} is closed; call reset_state() to connect again")
        yield from self._consumer.epoch()
