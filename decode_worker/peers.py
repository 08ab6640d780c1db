"""Decode worker's connections to prefill workers: handshake, heartbeats, liveness.

One DEALER socket per prefill worker control address. The handshake (model, KV layout, transport
endpoint) is sent on connect; transfers to a peer are only requested once it acknowledged. A peer
that answered nothing (heartbeats are ``StatsRequest`` pings) for ``peer_timeout_s`` is dead: the
scheduler fails what depends on it. A dead peer that answers again is re-handshaken (rejoin).
"""
from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass, field

import zmq

from transfer.protocol import KVHandshake, KVHandshakeAck, Message, StatsRequest, WorkerStats, encode

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillPeer:
    addr: str
    sock: zmq.Socket
    state: str = "connecting"  # connecting -> ready | failed; dead when silent
    worker_id: str | None = None
    instance: str | None = None
    error: str | None = None
    last_seen: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0

    @property
    def ready(self) -> bool:
        return self.state == "ready"


class PrefillPeers:
    def __init__(self, handshake: KVHandshake, heartbeat_s: float, timeout_s: float) -> None:
        self.handshake = handshake
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.ctx = zmq.Context.instance()
        self.by_addr: dict[str, PrefillPeer] = {}
        self.by_sock: dict[zmq.Socket, PrefillPeer] = {}
        self._lost: list[PrefillPeer] = []
        self._fresh: list[PrefillPeer] = []

    def get(self, addr: str) -> PrefillPeer:
        """The peer at ``addr``, connecting (and sending the handshake) on first use."""
        peer = self.by_addr.get(addr)
        if peer is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(addr)
            peer = PrefillPeer(addr, sock)
            self.by_addr[addr], self.by_sock[sock] = peer, peer
            self._send_handshake(peer)
        return peer

    def _send_handshake(self, peer: PrefillPeer) -> None:
        peer.state = "connecting"
        peer.last_seen = time.monotonic()
        self.send(peer, self.handshake)

    def send(self, peer: PrefillPeer, msg: Message, *frames: bytes) -> None:
        peer.sock.send_multipart(encode(msg, *frames))

    def sockets(self) -> list[zmq.Socket]:
        return list(self.by_sock)

    def on_message(self, sock: zmq.Socket, msg: Message) -> PrefillPeer | None:
        """Record liveness; process handshake acks. Returns the peer the message came from."""
        peer = self.by_sock.get(sock)
        if peer is None:
            return None
        was_dead = peer.state == "dead"
        peer.last_seen = time.monotonic()
        if isinstance(msg, KVHandshakeAck):
            peer.worker_id = msg.worker_id
            peer.state, peer.error = ("ready", None) if msg.ok else ("failed", msg.error)
            log.log(logging.INFO if msg.ok else logging.ERROR, "prefill worker %s at %s: %s", msg.worker_id,
                    peer.addr, "ready" if msg.ok else msg.error)
        elif isinstance(msg, WorkerStats):
            restarted = peer.instance is not None and msg.instance != peer.instance
            peer.instance = msg.instance
            if restarted and not was_dead:  # its requests died with the old process
                peer.error = f"prefill worker at {peer.addr} restarted"
                log.error(peer.error)
                self._lost.append(peer)
            if restarted:  # the old process is gone: none of its writes can land any more
                self._fresh.append(peer)
            if was_dead or restarted:
                log.warning("prefill worker at %s is back; handshaking again", peer.addr)
                self._send_handshake(peer)
        return peer

    def restarted(self) -> list[PrefillPeer]:
        """Peers seen running as a new process since the last call."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def tick(self) -> list[PrefillPeer]:
        """Send due heartbeats; return peers that just went dead or restarted (what was in flight
        with them is lost)."""
        now, died = time.monotonic(), self._lost
        self._lost = []
        for peer in self.by_addr.values():
            if now - peer.last_ping >= self.heartbeat_s:
                peer.last_ping = now
                self.send(peer, StatsRequest())
            if peer.state != "dead" and now - peer.last_seen > self.timeout_s:
                peer.state = "dead"
                peer.error = f"prefill worker at {peer.addr} did not answer for {self.timeout_s:.0f}s"
                log.error(peer.error)
                died.append(peer)
        return died

    def close(self) -> None:
        for s in self.by_sock:
            s.close(0)


def make_handshake(worker_id: str, model: str, layout: dict, transport) -> KVHandshake:
    return KVHandshake(worker_id=worker_id, model=model, layout=layout, transport=transport.backend,
                       transport_metadata=base64.b64encode(transport.local_metadata()).decode())
