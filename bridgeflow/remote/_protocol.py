"""The wire format between a producer and :class:`RemoteDataZMQ`, and address checks.

A message is either a datapoint, the frames of :func:`bridgeflow.serialize.encode_frames` (its first
frame starts with the codec's magic ``b"\\x93BFC"``), or a one-frame control message starting with
``b"\\x00BF"`` and a kind byte:

- ``I`` hello: the first message of a producer that connects (see ``TAG`` below);
- ``H`` heartbeat: the producer is alive but has nothing ready (sent every ``heartbeat_s`` when idle);
- ``E`` end of one pass over the producer's flow (the consumer's epoch ends when every producer sent it);
- ``B`` goodbye: the producer finished its last pass and is closing;
- ``L`` last: the end of the producer's last pass and its goodbye in one message (what producers send
  now: as two messages, a consumer that closed after the end marker left the producer waiting forever to
  deliver its goodbye);
- ``X`` the producer's flow raised; the rest of the frame is the formatted exception (UTF-8).

A datapoint larger than ``FRAGMENT_BYTES`` travels in pieces, so that the consumer sees it arrive (a
ZeroMQ message is delivered only once complete: a large one over a slow link would look like a silent
producer) and can refuse it before receiving it: first a one-frame *split header*, ``SPLIT_HEAD`` followed
by ``<QI`` (total bytes, number of frames) and one ``<Q`` size per frame of the datapoint; then the
frames' bytes in order, as two-frame messages ``[SPLIT_PART, up to FRAGMENT_BYTES bytes]``. Both start
with ``b"\x00BG"``, not the control prefix, so that a consumer of an older version, which ignores
unknown control messages, fails loudly on them instead of dropping the datapoint.

A producer that *connects* (``send_dataflow_zmq(..., bind=False)``, to a consumer that binds and may hear
from many producers on one socket) starts every message with one more frame, ``TAG`` followed by
``TAG_ID_BYTES`` random bytes naming the producer; the rest of the message is as above, and its first
message is a hello. The consumer drops (and counts) an untagged message, and one from a producer that
did not say hello: a stray message of another program does not end the stream or pass for data. It is
no defence against a stranger: without keys, a peer that connects and says hello *is* a producer, and
can end, inject or corrupt the stream like any other (with keys, strangers cannot send at all; see
:mod:`bridgeflow.remote._keys`). So without keys, :func:`check_trusted` allows only addresses that no
other machine can reach (loopback, ``ipc://``) unless the caller passes ``allow_insecure=True``.

Every frame a producer sends is at most ``FRAGMENT_BYTES`` plus a small header (``MAX_FRAME_BYTES``):
every receiving socket has ZeroMQ refuse larger frames (``MAXMSGSIZE``, set before it binds or
connects; the peer is disconnected), so no peer can make it buffer one. ZeroMQ bounds frames only: it
delivers a message once all its frames arrived and sets no bound on their number, so a peer that can
connect can still make a consumer buffer one message of many frames (3,000 frames of 1 MiB: 3 GB).
Keys keep strangers from connecting at all.
"""

from __future__ import annotations

import ipaddress
import logging
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..serialize import CorruptDataError

__all__ = [
    "BYE", "CONTROL", "END", "ERROR", "FRAGMENT_BYTES", "HEARTBEAT", "HELLO", "LAST", "MAX_FRAME_BYTES", "SPLIT",
    "SPLIT_HEAD", "SPLIT_PART", "Split",
    "TAG", "TAG_ID_BYTES", "check_address", "check_addresses", "check_trusted", "is_local", "is_public",
    "split_header", "read_split_header",
]

log = logging.getLogger(__name__)

CONTROL = b"\x00BF"
HELLO = CONTROL + b"I"
HEARTBEAT = CONTROL + b"H"
END = CONTROL + b"E"
BYE = CONTROL + b"B"
LAST = CONTROL + b"L"
ERROR = CONTROL + b"X"

SPLIT = b"\x00BG"
SPLIT_HEAD = SPLIT + b"P"
SPLIT_PART = SPLIT + b"F"
TAG = b"\x00BT"
TAG_ID_BYTES = 8
FRAGMENT_BYTES = 1 << 20  # datapoints above this travel in pieces of this size
MAX_FRAME_BYTES = FRAGMENT_BYTES + (1 << 20)  # a piece, or a split header of MAX_SPLIT_FRAMES sizes (512 KiB)
MAX_SPLIT_FRAMES = 1 << 16
_TOTAL = struct.Struct("<QI")
_SIZE = struct.Struct("<Q")


class Split:
    """A large datapoint being received in pieces: one buffer for all its frames, filled in order."""

    __slots__ = ("buf", "sizes", "filled")

    def __init__(self, total: int, sizes: list[int]) -> None:
        self.buf = np.empty(total, np.uint8)
        self.sizes, self.filled = sizes, 0

    def add(self, piece: memoryview) -> list | None:
        """Add the next piece; the datapoint's frames (views of the buffer) once it is complete."""
        end = self.filled + piece.nbytes
        if end > self.buf.nbytes:
            raise CorruptDataError(f"{end} bytes of pieces for a datapoint of {self.buf.nbytes}")
        self.buf[self.filled:end] = np.frombuffer(piece, np.uint8)
        self.filled = end
        if end < self.buf.nbytes:
            return None
        frames, off = [], 0
        for n in self.sizes:
            frames.append(self.buf[off:off + n])
            off += n
        return frames


def split_header(sizes: Sequence[int]) -> bytes:
    """The header announcing a datapoint of frames of ``sizes`` bytes, sent in pieces."""
    return SPLIT_HEAD + _TOTAL.pack(sum(sizes), len(sizes)) + b"".join(_SIZE.pack(n) for n in sizes)


def read_split_header(msg: bytes) -> tuple[int, list[int]]:
    """``(total bytes, frame sizes)`` of a split header; ``ValueError`` when it is malformed."""
    base = len(SPLIT_HEAD)
    if len(msg) < base + _TOTAL.size:
        raise ValueError(f"split header too short ({len(msg)} bytes)")
    total, n = _TOTAL.unpack_from(msg, base)
    if not 0 < n <= MAX_SPLIT_FRAMES or total == 0 or len(msg) != base + _TOTAL.size + n * _SIZE.size:
        raise ValueError(f"split header of {len(msg)} bytes for {n} frames")
    sizes = [_SIZE.unpack_from(msg, base + _TOTAL.size + i * _SIZE.size)[0] for i in range(n)]
    if sum(sizes) != total:
        raise ValueError(f"split header: frames of {sum(sizes)} bytes in all, announced {total}")
    return total, sizes

_SCHEMES = ("tcp://", "ipc://")
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::", "[*]")


def check_address(addr: object, what: str = "addr") -> str:
    """``addr`` if it is a ``tcp://host:port`` or ``ipc://path`` endpoint, else a ValueError naming ``what``."""
    if not isinstance(addr, str):
        raise TypeError(f"{what} must be a ZeroMQ address string like 'tcp://127.0.0.1:8877', got {addr!r}")
    if not addr.startswith(_SCHEMES):
        raise ValueError(f"{what}={addr!r}: use tcp://HOST:PORT or ipc://PATH (inproc:// cannot cross processes)")
    if addr.startswith("tcp://"):
        host, sep, port = addr[6:].rpartition(":")
        if not sep or not host or not (port.isdigit() or port == "*"):
            raise ValueError(f"{what}={addr!r}: a tcp address needs a host and a port, e.g. tcp://127.0.0.1:8877")
    elif len(addr) <= 6:
        raise ValueError(f"{what}={addr!r}: an ipc address needs a path, e.g. ipc:///tmp/bridgeflow.sock")
    return addr


def check_addresses(addrs: str | Sequence[str], what: str = "addrs") -> list[str]:
    """One address or a sequence of distinct addresses, checked."""
    items = [addrs] if isinstance(addrs, str) else list(addrs)
    if not items:
        raise ValueError(f"{what}: give at least one producer address")
    out = [check_address(a, f"{what}[{i}]") for i, a in enumerate(items)]
    if len(set(out)) != len(out):
        dup = sorted({a for a in out if out.count(a) > 1})
        raise ValueError(f"{what}: address given twice: {dup}")
    return out


def is_local(addr: str) -> bool:
    """True for an address no other machine can reach: ``ipc://``, or tcp on a loopback host
    (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if addr.startswith("ipc://"):
        return True
    host = addr[6:].rpartition(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_trusted(addr: str, keys: Any, allow_insecure: bool, bind: bool, who: str) -> None:
    """Without keys, refuse an address other machines can reach, unless ``allow_insecure``: any peer that
    can connect to it could then end, inject or corrupt the stream, read it, or make the consumer buffer
    what it likes. (A connecting socket given a wildcard fails on its own, with a better hint.)"""
    if keys is not None or allow_insecure or is_local(addr) or (not bind and is_public(addr)):
        return
    raise ValueError(
        f"{who}: {addr} can be reached from other machines, and without keys any peer that can connect to it can "
        "read the stream, end it, inject datapoints or corrupt it. Pass keys=FOLDER (make it once with "
        "`bridgeflow keys FOLDER`, or bridgeflow.remote.generate_keys(FOLDER), and copy it to every machine of "
        "the job), or, on a network you trust, allow_insecure=True (bridgeflow serve --allow-insecure). Loopback "
        "(tcp://127.0.0.1:PORT) and ipc:// addresses need neither")


def is_public(addr: str) -> bool:
    """True for a tcp address bound on every interface (``*``, ``0.0.0.0``, ``::``)."""
    if not addr.startswith("tcp://"):
        return False
    host = addr[6:].rpartition(":")[0]
    return host in _WILDCARD_HOSTS
