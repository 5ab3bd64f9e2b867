"""Errors raised by bridgeflow.remote; all derive from :class:`bridgeflow._errors.BridgeflowError`."""

from __future__ import annotations

from ..engine import BridgeflowError

__all__ = ["MessageTooLargeError", "ProducerError", "ProducerLostError", "RemoteConnectionError"]


class RemoteConnectionError(BridgeflowError, ConnectionError):
    """A ZeroMQ endpoint cannot be bound or connected, or a send timed out; ``addr`` names the endpoint."""

    def __init__(self, message: str, *, addr: str = "") -> None:
        super().__init__(message)
        self.addr = addr


class ProducerLostError(RemoteConnectionError):
    """A producer sent nothing (no datapoint, no heartbeat) for longer than the consumer's ``timeout``.

    ``addr`` is the producer's address and ``silent_s`` how long it had been silent. The other producers
    of the flow are not affected: iterate the flow again to go on reading from them.
    """

    def __init__(self, message: str, *, addr: str = "", silent_s: float = 0.0) -> None:
        super().__init__(message, addr=addr)
        self.silent_s = silent_s


class ProducerError(BridgeflowError, RuntimeError):
    """The flow on a producer raised; the message holds the producer's address, exception and traceback."""

    def __init__(self, message: str, *, addr: str = "") -> None:
        super().__init__(message)
        self.addr = addr


class MessageTooLargeError(BridgeflowError, ValueError):
    """A producer sent, or announced, a datapoint larger than the consumer's ``max_message_bytes``.

    ``addr`` names the producer, ``nbytes`` the datapoint's size and ``limit`` the consumer's limit. The
    producer is dropped; the others go on when the flow is iterated again.
    """

    def __init__(self, message: str, *, addr: str = "", nbytes: int = 0, limit: int = 0) -> None:
        super().__init__(message)
        self.addr, self.nbytes, self.limit = addr, nbytes, limit
