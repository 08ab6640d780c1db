"""Decode worker's view of its prefill workers: handshake, heartbeats, liveness. No sockets: it
returns what to send (to ``Peer(addr)``) and the worker loop owns the connections.

The handshake (model, KV layout, transport endpoint) goes out on first use of an address;
transfers to a peer are only requested once it acknowledged. Liveness and progress are judged
apart: heartbeat replies are received and stamped by the worker loop's pinger thread (``heard``),
so this worker's own long steps never count as the peer's silence.
- dead: the peer answered nothing for ``timeout_s`` (process gone, SIGSTOPped, unreachable);
- stuck: it answers, but its scheduler thread finished no loop iteration (the reply's
  ``stalled_s``) for ``progress_timeout_s`` (longer: a long step on a busy machine is not stuck).
Either way the scheduler fails what depends on it (``tick``). A dead peer that answers again
with progress, or one that reports a new process ``instance``, is handshaken again (rejoin).
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import dataclass, field

from transfer.wire.enums import Role
from transfer.wire.outbox import Outbox, Peer
from transfer.wire.protocol import KVHandshake, KVHandshakeAck, Message, WorkerStats

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillPeer:
    addr: str
    state: str = "connecting"  # connecting -> ready | failed; dead when silent
    worker_id: str | None = None
    instance: str | None = None
    error: str | None = None
    foreign: bool = False  # another deployment's (or a non-prefill) worker answers at addr
    last_seen: float = field(default_factory=time.monotonic)  # last sign of life
    progress_at: float = field(default_factory=time.monotonic)  # its scheduler last made progress

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def unusable(self) -> bool:
        return self.state in ("failed", "dead")


class PrefillPeers:
    def __init__(self, handshake: KVHandshake, timeout_s: float, progress_timeout_s: float) -> None:
        self.handshake = handshake
        self.timeout_s = timeout_s
        self.progress_timeout_s = progress_timeout_s
        self.by_addr: dict[str, PrefillPeer] = {}
        self._lost: list[PrefillPeer] = []
        self._fresh: list[PrefillPeer] = []

    def get(self, addr: str) -> PrefillPeer | None:
        return self.by_addr.get(addr)

    def connect(self, addr: str) -> Outbox:
        """Start knowing ``addr``: the first call returns its handshake; later calls nothing."""
        out = Outbox()
        if addr not in self.by_addr:
            peer = self.by_addr[addr] = PrefillPeer(addr)
            self._handshake(peer, out)
        return out

    def connect_all(self, addrs: list[str]) -> Outbox:
        """``connect`` each of ``addrs`` (the router's ``KVSources``): handshakes made before any
        transfer needs them."""
        out = Outbox()
        for addr in addrs:
            out.extend(self.connect(addr))
        return out

    def _handshake(self, peer: PrefillPeer, out: Outbox) -> None:
        peer.state = "connecting"
        peer.last_seen = peer.progress_at = time.monotonic()
        out.send(Peer(peer.addr), self.handshake)

    def on_message(self, addr: str, msg: Message) -> Outbox | None:
        """A message from the peer's scheduler thread (life and progress); process handshake acks
        and restarts. None if ``addr`` is unknown."""
        peer = self.by_addr.get(addr)
        if peer is None:
            return None
        if isinstance(msg, WorkerStats):  # a heartbeat reply that came this way: judged by its stalled_s
            return self.heard(addr, msg, time.monotonic())
        peer.last_seen = peer.progress_at = time.monotonic()
        if isinstance(msg, KVHandshakeAck):
            peer.worker_id = msg.worker_id
            peer.state, peer.error = ("ready", None) if msg.ok else ("failed", msg.error)
            log.log(
                logging.INFO if msg.ok else logging.ERROR,
                "prefill worker %s at %s: %s",
                msg.worker_id,
                peer.addr,
                "ready" if msg.ok else msg.error,
            )
        return Outbox()

    def heard(self, addr: str, stats: WorkerStats, at: float) -> Outbox:
        """A heartbeat reply that arrived at monotonic time ``at`` (the pinger thread's stamp)."""
        peer = self.by_addr.get(addr)
        if peer is None:
            return Outbox()
        peer.last_seen = max(peer.last_seen, at)
        peer.progress_at = max(peer.progress_at, at - stats.stalled_s)
        return self._on_stats(peer, stats)

    def _on_stats(self, peer: PrefillPeer, msg: WorkerStats) -> Outbox:
        out, was_dead = Outbox(), peer.state == "dead"
        if (error := self._foreign(peer, msg)) is not None:
            peer.state, peer.error, peer.foreign = "failed", error, True
            return out
        was_foreign, peer.foreign = peer.foreign, False
        restarted = peer.instance is not None and msg.instance != peer.instance
        peer.instance = msg.instance
        if restarted and not was_dead:  # its requests died with the old process
            peer.error = f"prefill worker at {peer.addr} restarted"
            log.error(peer.error)
            self._lost.append(peer)
        if restarted:  # the old process is gone: none of its writes can land any more
            self._fresh.append(peer)
        if was_dead and not restarted and self._stuck_for(peer, time.monotonic()) is not None:
            return out  # alive but still making no progress: stays failed
        if was_dead or restarted or was_foreign:
            log.warning("prefill worker at %s is back; handshaking again", peer.addr)
            self._handshake(peer, out)
        return out

    def _stuck_for(self, peer: PrefillPeer, now: float) -> float | None:
        stalled = now - peer.progress_at
        return stalled if stalled > self.progress_timeout_s else None

    def _foreign(self, peer: PrefillPeer, stats: WorkerStats) -> str | None:
        """Why the worker answering at ``peer.addr`` is not a prefill worker of our cluster, or None.
        Logged once per peer: requests that depend on it then fail with this error."""
        mine = self.handshake.cluster_id
        # a decode worker is a KV source too: the one a migrated request comes from
        if stats.role in (Role.PREFILL, Role.DECODE) and stats.cluster_id == mine:
            return None
        error = (
            f"the worker at {peer.addr} is {stats.worker_id} ({stats.role}) of cluster {stats.cluster_id!r}, "
            f"not a prefill worker of this decode worker's ({self.handshake.worker_id}) cluster {mine!r}: "
            f"another deployment's worker took the address (check --base-port / --cluster-id)"
        )
        if peer.error != error:
            log.error("%s", error)
        return error

    def restarted(self) -> list[str]:
        """Addresses of peers seen running as a new process since the last call."""
        fresh, self._fresh = self._fresh, []
        return [p.addr for p in fresh]

    def next_due_s(self) -> float | None:
        """Seconds until ``tick`` may have a peer to declare dead or stuck."""
        due = [
            t
            for p in self.by_addr.values()
            if p.state != "dead"
            for t in (p.last_seen + self.timeout_s, p.progress_at + self.progress_timeout_s)
        ]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def tick(self) -> tuple[Outbox, list[PrefillPeer]]:
        """(nothing to send: the loop's pinger sends heartbeats; peers that just went dead, stuck
        or restarted: what was in flight with them is lost)."""
        now, died = time.monotonic(), self._lost
        self._lost = []
        for peer in self.by_addr.values():
            if peer.state == "dead":
                continue
            if now - peer.last_seen > self.timeout_s:
                peer.error = f"prefill worker at {peer.addr} did not answer for {self.timeout_s:g}s (peer_timeout_s)"
            elif (stalled := self._stuck_for(peer, now)) is not None:
                peer.error = (
                    f"prefill worker at {peer.addr} answers heartbeats but its scheduler made no progress "
                    f"for {stalled:.0f}s (progress_timeout_s={self.progress_timeout_s:g})"
                )
            else:
                continue
            peer.state = "dead"
            log.error(peer.error)
            died.append(peer)
        return Outbox(), died


def make_handshake(worker_id: str, model: str, runner, transport, cluster_id: str = "") -> KVHandshake:
    """The handshake a decode worker sends each prefill worker it takes KV from (``runner``: its
    ``ModelRunner``: the KV descriptor both sides must share, and where its pools sit in its unit rows)."""
    g = runner.pools.geometry
    return KVHandshake(
        worker_id=worker_id,
        cluster_id=cluster_id,
        model=model,
        layout=runner.kv_descriptor(),
        pool_geometry=(g.full_pages, g.full_units, g.swa_units),
        transport=transport.backend,
        transport_metadata=base64.b64encode(transport.local_metadata()).decode(),
    )
