"""CURVE on every control-plane ZMQ socket: the one place that configures them.

Every router, worker and probe of a deployment holds the same cluster key pair
(``transfer.cluster_key``). A worker's control socket is a CURVE server with that key; every
socket that connects to one (the router's ``WorkerClient``, a decode worker's sockets to its
prefill peers, which carry the KV handshake with the NIXL/ucxx metadata, ``pdserve probe``) is a
CURVE client presenting the same pair. A ZAP handler in the server's context admits a client only
if its public key is the cluster's, so a peer must hold the secret key: without the key, or with
another one, the handshake fails and not one message of the peer reaches the worker.

ZMQ drops failed handshakes silently. ``HandshakeWatch`` reads the socket's monitor events and
turns each failure into a log line that names ``--cluster-key`` (both sides, throttled per
cause) and, on a client, into ``error`` (the router shows it in ``/health``). A client's watch may
also feed a ``transfer.link_watch.LinkWatch`` (the router's: is the worker's process gone?).

``ControlAuth.insecure()`` (``--insecure-control-plane``) configures nothing: plain ZMTP, no
authentication; its sockets still explain a mismatch with a CURVE peer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from transfer.cluster_key import ClusterKey, ClusterKeyError, read_key_file
from transfer.link_watch import LINK_EVENTS, LinkWatch

log = logging.getLogger(__name__)

ENV_SECRET = "PDSERVE_CLUSTER_SECRET_KEY"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # libzmq asks the handler bound here in the socket's context
ZAP_DOMAIN = "pdserve"
CONNECT_TIMEOUT_MS = 2000  # one TCP connect attempt of a client socket; then libzmq retries, re-resolving the name
KEYGEN_HINT = "make one with 'pdserve keygen FILE' and give every router and worker --cluster-key FILE"
_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_MONITOR_STOPPED
)


class ControlAuthError(RuntimeError):
    """No usable cluster key where one is required; the message says what to pass."""


@dataclass(frozen=True)
class ControlAuth:
    """How this process's control sockets authenticate: CURVE with ``key``, or not at all (None)."""

    key: ClusterKey | None

    @classmethod
    def insecure(cls) -> ControlAuth:
        return cls(None)

    @property
    def secure(self) -> bool:
        return self.key is not None

    def describe(self) -> str:
        if self.key is None:
            return "NOT authenticated (--insecure-control-plane)"
        return f"CURVE with cluster key {self.key.fingerprint}"

    def server(self, sock: zmq.Socket, label: str) -> ServerGuard:
        """Make ``sock`` (not yet bound) a CURVE server of the cluster key, with a ZAP handler in its
        context that admits only the cluster key and a watch that logs refused handshakes.
        At most one secure server per context (one ZAP handler each). Close the guard after the socket."""
        zap = None
        if self.key is not None:
            zap = ZapAuthenticator(sock.context, self.key, label)
            sock.zap_domain = ZAP_DOMAIN.encode()
            sock.curve_secretkey = self.key.secret
            sock.curve_publickey = self.key.public
            sock.curve_server = True
        return ServerGuard(zap, HandshakeWatch(sock, "server", label, self))

    def client(self, sock: zmq.Socket, label: str, link: LinkWatch | None = None) -> HandshakeWatch:
        """Make ``sock`` (not yet connected) a CURVE client presenting the cluster key; the returned
        watch logs failed handshakes and holds the latest one in ``error``. ``link``: also fed the
        connection events (a socket has one monitor, so the one watch serves both). Every client
        gives up one TCP connect after ``CONNECT_TIMEOUT_MS`` and reconnects, resolving the peer's
        name again."""
        # A vanished host answers no SYN: unbounded, the kernel retries for ~2 min before libzmq
        # reconnects, so a name that moved to a replacement host would not be followed for that long.
        sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        if self.key is not None:
            sock.curve_secretkey = self.key.secret
            sock.curve_publickey = self.key.public
            sock.curve_serverkey = self.key.public
        return HandshakeWatch(sock, "client", label, self, link)


def resolve_auth(key_file: str | None, insecure: bool, environ: Mapping[str, str] | None = None) -> ControlAuth:
    """This process's ``ControlAuth`` from ``--cluster-key FILE`` (``key_file``) or the secret key in
    ``PDSERVE_CLUSTER_SECRET_KEY``; with neither, insecure only if ``insecure`` was asked for, else
    ``ControlAuthError`` saying what to pass. A key, when there is one, wins over ``insecure``."""
    environ = os.environ if environ is None else environ
    secret = environ.get(ENV_SECRET)
    try:
        if key_file and secret:
            raise ControlAuthError(f"both --cluster-key ({key_file}) and {ENV_SECRET} are set: unset one")
        if key_file:
            key = read_key_file(key_file)
        elif secret:
            key = ClusterKey.from_secret(secret, ENV_SECRET)
        elif insecure:
            return ControlAuth.insecure()
        else:
            raise ControlAuthError(
                f"no cluster key: {KEYGEN_HINT} (or PDSERVE_CLUSTER_KEY=FILE); "
                f"--insecure-control-plane runs without authentication instead, and then "
                f"anyone who reaches a worker's port can submit, abort or shut it down"
            )
    except ClusterKeyError as e:
        raise ControlAuthError(str(e)) from None
    if insecure:
        log.warning("--insecure-control-plane ignored: a cluster key is given (%s)", key.fingerprint)
    return ControlAuth(key)


class ServerGuard:
    """What ``ControlAuth.server`` started for one server socket: its ZAP handler and watch."""

    def __init__(self, zap: ZapAuthenticator | None, watch: HandshakeWatch) -> None:
        self.zap = zap
        self.watch = watch

    @property
    def refused(self) -> int:
        """Connection attempts refused so far (failed handshakes: no key, another key, ZAP denial)."""
        return self.watch.failures

    def close(self) -> None:
        """Stop the ZAP handler (after the socket it served is closed)."""
        if self.zap is not None:
            self.zap.close()


class LogThrottle:
    """At most one log line per cause every ``every_s``; later lines say how many were skipped."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def log(self, level: int, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(message, -self.every_s - 1) < self.every_s:
            self._skipped[message] = self._skipped.get(message, 0) + 1
            return
        skipped = self._skipped.pop(message, 0)
        self._last[message] = now
        log.log(level, "%s%s", message, f" ({skipped} more like it in the last {self.every_s:.0f}s)" if skipped else "")


class ZapAuthenticator:
    """A ZAP handler (ZeroMQ RFC 27) on its own thread: admits a CURVE client whose public key is the
    cluster's, refuses (status 400) and logs anything else with the peer's address."""

    def __init__(self, ctx: zmq.Context, key: ClusterKey, label: str) -> None:
        self._allowed = z85.decode(key.public)
        self._label = label
        self._throttle = LogThrottle()
        self._sock = zmq.Context.shadow(ctx.underlying).socket(zmq.REP)
        self._sock.linger = 0
        try:
            self._sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as e:
            self._sock.close()
            raise RuntimeError(
                f"a ZAP handler already serves this ZMQ context ({e}): one secure server per context"
            ) from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    self._sock.send_multipart(self._reply(self._sock.recv_multipart()))
        except zmq.ZMQError:  # the context is being terminated
            pass
        finally:
            self._sock.close(0)

    def _reply(self, frames: list[bytes]) -> list[bytes]:
        """``[version, request id, status code, status text, user id, metadata]`` for one request."""
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *credentials = frames
        if mechanism == b"CURVE" and credentials and credentials[0] == self._allowed:
            return [version, request_id, b"200", b"OK", b"cluster", b""]
        self._throttle.log(
            logging.ERROR,
            f"{self._label}: refused a control connection from "
            f"{address.decode(errors='replace')}: its CURVE key is not this cluster's "
            f"(mechanism {mechanism.decode(errors='replace')}); the peer needs the "
            f"same --cluster-key as this process",
        )
        return [version, request_id, b"400", b"not this cluster's key (--cluster-key)", b"", b""]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


class HandshakeWatch:
    """Reads one socket's monitor events on a thread until the socket closes; each failed handshake
    becomes a (throttled) log line naming ``--cluster-key``; on a client the latest one is ``error``
    (None again once a handshake succeeds). With a ``link``, every event goes to it as well."""

    def __init__(
        self, sock: zmq.Socket, side: str, label: str, auth: ControlAuth, link: LinkWatch | None = None
    ) -> None:
        self.side = side
        self.link = link
        self.label = label
        self.auth = auth
        self.error: str | None = None
        self.failures = 0  # failed handshakes seen (one per refused connection attempt)
        self._throttle = LogThrottle()
        endpoint = f"inproc://handshake-watch-{id(self):x}-{time.monotonic_ns()}"
        sock.monitor(endpoint, _EVENTS | (LINK_EVENTS if link is not None else 0))
        self._mon = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self._mon.linger = 0
        self._mon.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name=f"handshake-watch-{label}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                event = recv_monitor_message(self._mon)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self._feed_link(event["event"])
                if not event["event"] & LINK_EVENTS:
                    self._on(event["event"], event["value"], event["endpoint"].decode(errors="replace"))
        except zmq.ZMQError:  # the context is being terminated
            pass
        finally:
            self._mon.close(0)

    def _feed_link(self, event: int) -> None:
        if self.link is None:
            return
        try:
            self.link.feed(event)
        except Exception:  # a bug in the verdict's callback must not end the handshake watch
            log.exception("%s: error handling connection event %d", self.label, event)

    def _on(self, event: int, value: int, endpoint: str) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.error = None
            return
        self.failures += 1
        message = self.explain(event, value, endpoint)
        if message is None:
            return
        if self.side == "client":
            self.error = message
        self._throttle.log(logging.ERROR, message)

    def explain(self, event: int, value: int, endpoint: str) -> str | None:
        """The log line for a failed handshake, or None for one the ZAP handler already logged."""
        ours = self.auth.describe()
        who = (
            f"{self.label}: "
            + ("refused a control connection on " if self.side == "server" else "cannot talk to ")
            + endpoint
        )
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if self.side == "server":
                return None
            return (
                f"{who}: it refused this process's CURVE key (ZAP status {value}); this side uses {ours}: "
                f"give both the same --cluster-key"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.auth.secure:
                return (
                    f"{who}: the peer speaks plain ZMTP (no --cluster-key, or --insecure-control-plane) while "
                    f"this side uses {ours}: give both the same --cluster-key"
                )
            return (
                f"{who}: the peer requires CURVE but this side has no cluster key: start it with the "
                f"cluster's --cluster-key FILE"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                f"{who}: CURVE handshake failed (the peer does not hold this cluster's key; this side uses "
                f"{ours}): give both the same --cluster-key"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self.side == "client" and self.auth.secure:
            return (
                f"{who}: the CURVE handshake was cut off (most often: the peer does not hold this process's "
                f"key; this side uses {ours}): give both the same --cluster-key"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self.side == "client":
            # a CURVE server may close on a plain client before the mechanism mismatch reaches it
            return (
                f"{who}: the handshake was cut off (most often: the peer requires CURVE but this side has no "
                f"cluster key): start it with the cluster's --cluster-key FILE"
            )
        return (
            f"{who}: handshake failed (ZMQ monitor event {event}, value {value}; this side uses {ours}): a peer "
            f"that should get in needs the same --cluster-key"
        )
