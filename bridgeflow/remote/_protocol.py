"""The wire format between a producer and :class:`RemoteDataZMQ`, and address checks.

A message is either a datapoint, the frames of :func:`bridgeflow.serialize.codec.encode_frames` (its first
frame starts with the codec's magic ``b"\\x93BFC"``), or a one-frame control message starting with
``b"\\x00BF"`` and a kind byte:

- ``H`` heartbeat: the producer is alive but has nothing ready (sent every ``heartbeat_s`` when idle);
- ``E`` end of one pass over the producer's flow (the consumer's epoch ends when every producer sent it);
- ``B`` goodbye: the producer finished its last pass and is closing;
- ``L`` last: the end of the producer's last pass and its goodbye in one message (what producers send
  now: as two messages, a consumer that closed after the end marker left the producer waiting forever to
  deliver its goodbye);
- ``X`` the producer's flow raised; the rest of the frame is the formatted exception (UTF-8).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["BYE", "CONTROL", "END", "ERROR", "HEARTBEAT", "LAST", "check_address", "check_addresses", "is_public"]

log = logging.getLogger(__name__)

CONTROL = b"\x00BF"
HEARTBEAT = CONTROL + b"H"
END = CONTROL + b"E"
BYE = CONTROL + b"B"
LAST = CONTROL + b"L"
ERROR = CONTROL + b"X"

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


def is_public(addr: str) -> bool:
    """True for a tcp address bound on every interface (``*``, ``0.0.0.0``, ``::``)."""
    if not addr.startswith("tcp://"):
        return False
    host = addr[6:].rpartition(":")[0]
    return host in _WILDCARD_HOSTS
