"""CurveZMQ keys for the ZeroMQ wire: made once, copied to every machine of a job, passed as ``keys=``.

A key folder holds two key pairs in ZeroMQ's certificate format (``zmq.auth``): ``server.key`` and
``server.key_secret`` for the side that binds its address, ``client.key`` and ``client.key_secret`` for
the side that connects. Given ``keys=``, :func:`~bridgeflow.remote.send_dataflow_zmq` and
:class:`~bridgeflow.remote.RemoteDataZMQ` speak CurveZMQ (libsodium, bundled with pyzmq) on every socket:
the stream is encrypted, and both ends are authenticated. The binding side admits only a peer that
proves it holds the client secret (a ZAP handler, one thread of the flow's ZeroMQ context, stopped by
``close()``); the connecting side only talks to a binding side that proves it holds the server secret.
A peer without the folder can then neither send a consumer datapoints, nor end its stream, nor take a
producer's stream away: its handshake fails and nothing it sends is read.

The secret files are written readable by their owner only (0600); loading warns when others can read
them. Anyone holding the folder is trusted: treat it as a password.

When the two sides were given different key folders, both say so: every secured socket is watched
(ZeroMQ's socket monitor, one thread each, stopped by ``close()``) and a failed handshake is logged with the
:func:`fingerprint` of the key this side expected (the binding side: its server key, and the job's client
key; the connecting side: the server key it expects, and its own client key), so the fingerprints the two
machines print tell which folder differs. The consumer's "sent nothing" error repeats the last one. A
stranger retrying without pause cannot fill the log: each kind of failure is logged at once, then at most
once a minute with the count since (:class:`Throttle`).

Example:
    $ bridgeflow keys ~/.bridgeflow/job-keys         # once; copy the folder to every machine
    >>> send_dataflow_zmq(df, "tcp://0.0.0.0:8877", keys="~/.bridgeflow/job-keys")   # doctest: +SKIP
    >>> RemoteDataZMQ("tcp://10.0.0.5:8877", keys="~/.bridgeflow/job-keys")          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import stat
import threading
import time
from typing import Any

from ..engine import require

__all__ = ["CurveKeys", "Security", "Throttle", "fingerprint", "generate_keys", "load_keys"]

log = logging.getLogger(__name__)

_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")


@dataclasses.dataclass(frozen=True, repr=False)
class CurveKeys:
    """The two CurveZMQ key pairs of a job (Z85 text, as ZeroMQ takes them) and where they came from."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    source: str = ""

    def __repr__(self) -> str:  # never the secrets
        return f"CurveKeys(server={self.server_public.decode()}, client={self.client_public.decode()}, " \
               f"source={self.source!r})"


def fingerprint(public: bytes) -> str:
    """A short name of a public key (Z85 text) to compare between machines: 16 hex digits of its SHA-256."""
    digest = hashlib.sha256(public.strip()).hexdigest()[:16]
    return ":".join(digest[i:i + 4] for i in range(0, 16, 4))


class Throttle:
    """Logs a kind of warning at once, then at most once per ``period`` seconds with the count since: a peer
    that retries without pause cannot fill the log. Thread-safe."""

    def __init__(self, period: float = 60.0) -> None:
        self.period = period
        self._lock = threading.Lock()
        self._kinds: dict[str, list] = {}  # kind -> [last logged (monotonic), suppressed since]

    def warning(self, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._kinds.get(kind)
            if last is not None and now - last[0] < self.period:
                last[1] += 1
                return
            more = last[1] if last is not None else 0
            self._kinds[kind] = [now, 0]
        log.warning("%s%s", message, f" ({more} more like it in the last {self.period:g} s)" if more else "")


def generate_keys(folder: str | os.PathLike, *, overwrite: bool = False) -> CurveKeys:
    """Make a key folder for ``keys=`` and return its keys; an existing one is kept unless ``overwrite``.

    The folder holds two CurveZMQ key pairs in ZeroMQ's certificate format: ``server.key`` and
    ``server.key_secret`` for the side that binds its address, ``client.key`` and ``client.key_secret`` for
    the side that connects. The secret files are readable by their owner only (0600). Copy the folder to
    every machine of the job and treat it as a password: anyone holding it is trusted. See
    docs/remote.md ("Keys") for what the keys protect.
    """
    require("zmq", "generate_keys")
    import zmq.auth

    if not zmq.has("curve"):
        raise RuntimeError("this pyzmq's libzmq was built without CURVE (libsodium); reinstall pyzmq from a wheel")
    path = os.path.expanduser(os.fspath(folder))
    present = [f for f in _FILES if os.path.exists(os.path.join(path, f))]
    if present and not overwrite:
        raise FileExistsError(f"{path} already holds keys ({', '.join(present)}); pass overwrite=True "
                              "to replace them (every machine then needs the new folder)")
    os.makedirs(path, mode=0o700, exist_ok=True)
    for name in ("server", "client"):
        public, secret = zmq.auth.create_certificates(path, name)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
    log.info("wrote CurveZMQ keys to %s", path)
    return load_keys(path)


def load_keys(keys: str | os.PathLike | CurveKeys) -> CurveKeys:
    """The :class:`CurveKeys` of a key folder (or ``keys`` itself); errors name the folder and the file."""
    if isinstance(keys, CurveKeys):
        return keys
    require("zmq", "load_keys")
    import zmq.auth

    path = os.path.expanduser(os.fspath(keys))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"keys={path!r}: no such key folder; make one with `bridgeflow keys {path}` "
                                "(or bridgeflow.remote.generate_keys) and copy it to every machine")
    pairs = {}
    for name in ("server", "client"):
        secret = os.path.join(path, f"{name}.key_secret")
        if not os.path.isfile(secret):
            raise FileNotFoundError(f"keys={path!r}: {name}.key_secret is missing; copy the whole folder made by "
                                    "`bridgeflow keys`")
        mode = os.stat(secret).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s can be read by other users (mode %o): anyone who reads it can join the stream; "
                        "chmod 600 it", secret, stat.S_IMODE(mode))
        try:
            public, private = zmq.auth.load_certificate(secret)
        except (ValueError, OSError) as exc:
            raise ValueError(f"keys={path!r}: {name}.key_secret is not a ZeroMQ certificate ({exc})") from exc
        if not public or not private:
            raise ValueError(f"keys={path!r}: {name}.key_secret holds no secret key")
        pairs[name] = (public, private)
    return CurveKeys(pairs["server"][0], pairs["server"][1], pairs["client"][0], pairs["client"][1], path)


class _Allowed:
    """ZAP credentials provider: the client key of the job, and a count of the peers refused."""

    def __init__(self, keys: CurveKeys, throttle: Throttle) -> None:
        self.keys, self.throttle = keys, throttle
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.keys.client_public:
            return True
        self.refused += 1
        self.throttle.warning("refused", f"refused a ZeroMQ peer presenting client key {fingerprint(key)}: this "
                                         f"side expects the job's client key {fingerprint(self.keys.client_public)} "
                                         f"(keys from {self.keys.source or 'keys='}); the peer was given another key "
                                         "folder, or is a stranger")
        return False


class _Watch(threading.Thread):
    """Reads one socket's monitor events and names failed CurveZMQ handshakes (see the module doc)."""

    def __init__(self, security: Security, sock: Any, binding: bool) -> None:
        super().__init__(name="bridgeflow-zmq-handshakes", daemon=True)
        import zmq

        self.zmq, self.security, self.binding = zmq, security, binding
        self.addr = f"inproc://bridgeflow-monitor-{id(self):x}-{os.getpid()}"
        self.stop = threading.Event()
        sock.monitor(self.addr, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_MONITOR_STOPPED)
        self.pair = security.ctx.socket(zmq.PAIR)
        self.pair.connect(self.addr)

    def run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self.zmq
        try:
            while not self.stop.is_set():
                if not self.pair.poll(100):
                    continue
                event = recv_monitor_message(self.pair)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self.security.failed(self._message(event["event"], event["endpoint"].decode("utf-8", "replace")))
        except zmq.ZMQError:  # the context is going away
            return
        finally:
            self.pair.close(0)

    def _message(self, kind: int, addr: str) -> tuple[str, str]:
        keys, zmq = self.security.keys, self.zmq
        assert keys is not None
        folder = keys.source or "keys="
        if self.binding:
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "", ""  # the ZAP handler refused its client key, and said so
            return "server", (f"a ZeroMQ peer on {addr} failed its CurveZMQ handshake: it encrypted for another "
                              f"server key than this side's {fingerprint(keys.server_public)} (keys from {folder}); "
                              "the peer was given another key folder, or is a stranger")
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return "client", (f"{addr} refused this side's client key {fingerprint(keys.client_public)} (keys from "
                              f"{folder}): the two sides were given different key folders")
        return "server", (f"the CurveZMQ handshake with {addr} failed: it does not hold the server key "
                          f"{fingerprint(keys.server_public)} this side expects (keys from {folder}); the two sides "
                          "were given different key folders, or it is not a bridgeflow peer with keys=")


class Security:
    """How the sockets of one ZeroMQ context are secured: with ``keys``, CurveZMQ (the binding side a
    CURVE server admitting only the job's client key, through a ZAP handler started with the first bound
    socket); without, plain TCP. ``close()`` stops the ZAP handler (before the context is terminated)."""

    def __init__(self, ctx: Any, keys: str | os.PathLike | CurveKeys | None) -> None:
        self.ctx = ctx
        self.keys = None if keys is None else load_keys(keys)
        self._auth: Any = None
        self._allowed: _Allowed | None = None
        self._watches: list[_Watch] = []
        self.throttle = Throttle()
        self.handshakes_failed = 0
        self.last_failure = ""

    @property
    def refused(self) -> int:
        """Peers whose handshake presented a key other than the job's."""
        return 0 if self._allowed is None else self._allowed.refused

    def failed(self, kind_message: tuple[str, str]) -> None:
        """A failed handshake (from a socket's watch): counted, and logged through the throttle."""
        kind, message = kind_message
        if not message:
            return
        self.handshakes_failed += 1
        self.last_failure = message
        self.throttle.warning(kind, message)

    def note(self) -> str:
        """What to add to a "nothing arrived" error: the last failed handshake, if any."""
        if not self.handshakes_failed:
            return ""
        return f"; {self.handshakes_failed} CurveZMQ handshake(s) failed, the last: {self.last_failure}"

    def _watch(self, sock: Any, binding: bool) -> None:
        watch = _Watch(self, sock, binding)
        self._watches.append(watch)
        watch.start()

    def binding(self, sock: Any) -> None:
        """Secure a socket that will bind (a CURVE server)."""
        if self.keys is None:
            return
        if self._auth is None:
            from zmq.auth.thread import ThreadAuthenticator

            self._allowed = _Allowed(self.keys, self.throttle)
            self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger(f"{__name__}.zap"))
            self._auth.start()
            self._auth.configure_curve_callback(domain="*", credentials_provider=self._allowed)
        sock.curve_secretkey = self.keys.server_secret
        sock.curve_publickey = self.keys.server_public
        sock.curve_server = True
        self._watch(sock, binding=True)

    def connecting(self, sock: Any) -> None:
        """Secure a socket that will connect (a CURVE client of the job's server key)."""
        if self.keys is None:
            return
        sock.curve_secretkey = self.keys.client_secret
        sock.curve_publickey = self.keys.client_public
        sock.curve_serverkey = self.keys.server_public
        self._watch(sock, binding=False)

    def close(self) -> None:
        watches, self._watches = self._watches, []
        for watch in watches:
            watch.stop.set()
        for watch in watches:
            watch.join(2.0)
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()
