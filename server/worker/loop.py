"""A worker's control plane: it owns every socket and drives one ``WorkerScheduler``.

Sockets: the external ROUTER socket lives on a ``ControlIO`` thread that answers heartbeats even
during a long step (this loop sees the same frames on an inproc socket), plus one DEALER per
peer worker the scheduler addresses as ``Peer(addr)`` (decode -> prefill), connected on first
use. The loop alternates between draining inbound messages and one scheduler step. It blocks
on its sockets whenever the scheduler has nothing to compute (``has_work``), for as long as the
scheduler allows (``idle_wait_s``: a transfer to poll, a heartbeat or deadline) and at most the
stats cadence; a message that arrives during a step is handled right after it. Whatever a scheduler call
returns (an ``Outbox``; a turn's ``StepReport`` carries one) is delivered at once: token deltas
batched into one ``TokenBatch`` per owner connection, control messages to their ``Conn``/``Peer``.

Core lending (``cores``) is decided here, from the scheduler's state and its step reports: before
blocking and before each turn the loop publishes ``has_model_work`` and ``has_queued_model_work``,
picks the turn's threads (``begin_step``) when there is work, and tells its slot about KV handoffs a turn reports
(``handed_off``); a turn that finished handoffs pauses before computing (``server.worker.turn``).

Liveness apart from progress: peers' heartbeats are sent and their replies stamped on a
``PeerPinger`` thread (every watched ``Peer`` address, every ``heartbeat_s``) and handed to the
scheduler (``peer_heartbeat``) before each step, so this worker's own long step never reads as a
peer's silence. ``progress_timeout_s`` is the ControlIO's stall limit: a scheduler thread stuck
that long stops answering heartbeats.
"""

from __future__ import annotations

import logging
import signal
import time
import uuid
from collections import defaultdict

import zmq

from engine.scheduler.base import RequestRejected, WorkerScheduler
from server.worker.control_io import ControlIO
from server.worker.core_lending import CoreLending
from server.worker.drain import Drain, Verdict, as_unavailable
from server.worker.kv_feed import KvFeed, feed_bind_host
from server.worker.peer_pinger import PeerPinger
from server.worker.role_switch import RoleSwitcher
from server.worker.turn import Turns
from transfer.control_auth import ControlAuth
from transfer.wire.outbox import Conn, Outbox, Peer
from transfer.wire.protocol import (
    AbortRequest,
    GenerateRequest,
    HistogramData,
    KvSnapshotRequest,
    Message,
    PrefillRequest,
    ProtocolError,
    RoleSwitched,
    Shutdown,
    StatsRequest,
    SwitchRole,
    TokenBatch,
    TokenDelta,
    WorkerStats,
    decode,
    encode,
    frame_ids,
)
from transfer.wire.protocol import Drain as DrainMessage

log = logging.getLogger(__name__)

# the process exit code after a ``Shutdown`` message: not 0, which a launcher reads as "drained, leave
# it down" (``server.launch.supervisor``); a worker stopped by a message is restarted as before
EXIT_SHUTDOWN = 3


class WorkerLoop:
    def __init__(
        self,
        control_addr: str,
        worker_id: str,
        model_name: str,
        cluster_id: str = "",
        listen_fd: int | None = None,
        heartbeat_s: float = 1.0,
        progress_timeout_s: float = 120.0,
        step_delay_s: float = 0.0,
        cores: CoreLending | None = None,
        drain_timeout_s: float = 60.0,
        *,
        auth: ControlAuth,
    ) -> None:
        """Serve at ``control_addr`` (on ``listen_fd`` when the launcher passed its socket);
        heartbeats report ``cluster_id`` so routers and peers of another deployment refuse us.
        SIGTERM or a ``Drain`` message drains the worker, SIGUSR1 without the quiet period
        (``server.worker.drain``; the scheduler must also be a ``HoldsRequests``): :meth:`run`
        returns once it holds nothing, or after ``drain_timeout_s`` with the rest failed (503).
        ``step_delay_s`` (testing): sleep after every step that had work, like a slow machine.
        ``cores``: this worker's slot of its launch's core ledger (``server.worker.core_lending``).
        ``auth``: CURVE (or not) on every socket: the control socket and the peer sockets, which
        carry the KV handshake with the transport's metadata (``transfer.control_auth``)."""
        self.worker_id = worker_id
        self.control_addr = control_addr
        self.kv_feed: KvFeed | None = None  # the radix cache's event feed (``server.worker.kv_feed``)
        self.model_name = model_name
        self.cluster_id = cluster_id
        self.auth = auth
        self.ctx = zmq.Context()  # its own: one ZAP handler per context
        self.io = ControlIO(self.ctx, control_addr, stall_limit_s=progress_timeout_s, listen_fd=listen_fd, auth=auth)
        self.pinger = PeerPinger(self.ctx, heartbeat_s, auth=auth)
        self.step_delay_s = step_delay_s
        self.cores = cores
        self.sock = self.io.scheduler_end  # frames arrive as [identity, *parts], like a ROUTER's
        self.scheduler: WorkerScheduler | None = None
        self.turns: Turns | None = None
        self.peers: dict[str, zmq.Socket] = {}
        self.peer_addr: dict[zmq.Socket, str] = {}
        self.instance = uuid.uuid4().hex
        self.stopping = False
        self.exit_code = 0  # what the process exits with once ``run`` returns
        self.drain = Drain(drain_timeout_s, quiet_s=3 * heartbeat_s)
        self.on_drain: list = []  # callables run once when draining starts (leave discovery)
        self.switcher: RoleSwitcher | None = None  # live role switches (server.worker.role_switch), when enabled
        self.stats_every_s = 0.1
        self._stats_at = 0.0

    def run(self, scheduler: WorkerScheduler) -> None:
        self._serve_with(scheduler)
        signal.signal(signal.SIGTERM, lambda *_: self.begin_drain("SIGTERM"))
        signal.signal(
            signal.SIGUSR1, lambda *_: self.begin_drain("SIGUSR1: the launcher stops the cluster", quiet_s=0.0)
        )
        log.info("%s worker %s serving; control plane: %s", scheduler.role, self.worker_id, self.auth.describe())
        self.io.publish(self._stats(0))
        self.io.start()
        self.pinger.start()
        try:
            while not self.stopping:
                self._publish()
                self._drain(0.0 if self.scheduler.has_work else self._idle_timeout())
                self._flush_kv_events()
                scheduler = self.scheduler  # the same for the whole turn (a role switch replaces it after)
                for addr, stats, at in self.pinger.take():
                    self.deliver(scheduler.peer_heartbeat(addr, stats, at))
                if self.switcher is not None:
                    self.deliver(self.switcher.before_turn(scheduler))
                busy = scheduler.has_work
                self._publish()
                if busy and self.cores is not None:
                    self.cores.begin_step(yield_to_peers=scheduler.awaits_peer_compute)
                self._turn()
                self._flush_kv_events()
                self._switch_check()
                if self.step_delay_s and (busy or scheduler.has_work):
                    time.sleep(self.step_delay_s)
                self._heartbeat()
                self._drain_check()
        finally:
            self.pinger.close()
            self.io.close()
            for s in self.peers.values():
                s.close(0)
            if self.kv_feed is not None:
                self.kv_feed.close()
            self.ctx.destroy(linger=0)

    def _serve_with(self, scheduler: WorkerScheduler) -> None:
        """Serve ``scheduler`` from the next turn on, with its radix cache's event feed."""
        self.scheduler = scheduler
        self.turns = Turns(scheduler)
        if self.kv_feed is not None:
            self.kv_feed.close()
            self.kv_feed = None
        tree = getattr(getattr(scheduler, "kv", None), "tree", None)
        if tree is not None and feed_bind_host(self.control_addr) is not None:
            self.kv_feed = KvFeed(tree, self.control_addr, self.worker_id, self.instance, self.auth)

    def _switch_check(self) -> None:
        """A role switch that ended: serve its scheduler as a new instance (peers handshake again
        with the new transport) and answer the router that asked."""
        done = self.switcher.after_turn(self.scheduler) if self.switcher is not None else None
        if done is None:
            return
        scheduler, answer, requester = done
        if answer.ok:
            self.instance = uuid.uuid4().hex
            self._serve_with(scheduler)
            answer = answer.model_copy(update={"instance": self.instance})
        self.sock.send_multipart([requester, *encode(answer)])
        self.io.publish(self._stats(0))

    def _flush_kv_events(self) -> None:
        if self.kv_feed is not None:
            self.kv_feed.flush()

    def begin_drain(self, reason: str, quiet_s: float | None = None) -> None:
        """Start draining: report it in the stats at once and run the ``on_drain`` hooks
        (``quiet_s``: ``Drain.begin``'s)."""
        if self.drain.begin(reason, quiet_s):
            self.io.publish(self._stats(0))
            for hook in self.on_drain:
                hook()

    def _drain_check(self) -> None:
        """While draining: stop once nothing is held; past the timeout fail what is left (503)."""
        if not self.drain.active:
            return
        held = self.scheduler.held_rids()
        verdict = self.drain.verdict(len(held))
        if verdict is Verdict.EXPIRED:
            log.error("drain timed out with %d request(s) held: failing them with 503", len(held))
            out = Outbox()
            for rid in sorted(held):
                out.extend(self.scheduler.abort(rid, self.drain.expired_error()))
            self.deliver(as_unavailable(out, self.drain.expired_error()))
            self.stopping = True
        elif verdict is Verdict.EXIT:
            log.warning("drained: no request held; exiting")
            self.stopping = True

    def _publish(self) -> None:
        """Tell the launch's other workers whether this one is about to run the model."""
        if self.cores is not None:
            self.cores.publish(self.scheduler.has_model_work, self.scheduler.has_queued_model_work)

    def _turn(self) -> None:
        """One scheduler turn, delivered; KV handoffs it reports keep this worker from borrowing
        cores for a while (the decode workers that got the KV are about to be busy)."""
        report = self.turns.run()
        if report.handoffs and self.cores is not None:
            self.cores.handed_off()
        self.deliver(report.outbox)

    # ---- outbound -------------------------------------------------------------------------------
    def deliver(self, out: Outbox) -> None:
        by_owner: dict[bytes, list[TokenDelta]] = defaultdict(list)
        for owner, delta in out.tokens:
            by_owner[owner].append(delta)
        for owner, deltas in by_owner.items():
            batch, frame = TokenBatch.pack(deltas)
            self.sock.send_multipart([owner, *encode(batch, frame)])
        for m in out.messages:
            if isinstance(m.to, Conn):
                self.sock.send_multipart([m.to.ident, *encode(m.msg, *m.frames)])
            else:
                self._peer_socket(m.to.addr).send_multipart(encode(m.msg, *m.frames))

    def _peer_socket(self, addr: str) -> zmq.Socket:
        sock = self.peers.get(addr)
        if sock is None:
            sock = self.peers[addr] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            self.auth.client(sock, f"peer {addr}")
            sock.connect(addr)
            self.peer_addr[sock] = addr
            self.pinger.watch(addr)
        return sock

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._stats_at >= self.stats_every_s:
            self._stats_at = now
            self.io.publish(self._stats(0))
        else:
            self.io.alive()

    # ---- inbound --------------------------------------------------------------------------------
    def _idle_timeout(self) -> float:
        """Block at most until the scheduler's next due step, and no longer than the stats cadence."""
        wait = self.scheduler.idle_wait_s()
        return self.stats_every_s if wait is None else min(wait, self.stats_every_s)

    def _drain(self, timeout_s: float) -> None:
        """Handle every message that is there, waiting up to ``timeout_s`` for the first one."""
        timeout = 0 if timeout_s <= 0 else max(1, round(timeout_s * 1000))
        while True:
            poller = zmq.Poller()
            for s in (self.sock, *self.peers.values()):
                poller.register(s, zmq.POLLIN)
            ready = dict(poller.poll(timeout))
            if not ready:
                return
            for s in ready:
                if s is self.sock:
                    ident, *parts = s.recv_multipart()
                    self._on_control(ident, parts)
                else:
                    self._on_peer(self.peer_addr[s], s.recv_multipart())
            timeout = 0

    def _on_peer(self, addr: str, parts: list[bytes]) -> None:
        try:
            msg, frames = decode(parts)
        except ProtocolError as e:
            log.error("bad message from peer worker %s: %s", addr, e)
            return
        self._to_scheduler(Peer(addr), msg, frames)

    def _on_control(self, ident: bytes, parts: list[bytes]) -> None:
        try:
            msg, frames = decode(parts)
        except ProtocolError as e:
            log.error("bad control message from %r: %s", ident, e)
            return
        if isinstance(msg, (GenerateRequest, PrefillRequest)) and not getattr(msg, "generation", 0):
            self.drain.took_request()
        if isinstance(msg, GenerateRequest):
            self._generate(ident, msg, frames)
        elif isinstance(msg, AbortRequest):
            for rid in msg.rids:
                self.deliver(self.scheduler.abort(rid, msg.reason))
        elif isinstance(msg, StatsRequest):
            self.sock.send_multipart([ident, *encode(self._stats(msg.nonce))])
        elif isinstance(msg, Shutdown):
            log.warning("Shutdown message from %r: exiting with code %d", ident, EXIT_SHUTDOWN)
            self.stopping, self.exit_code = True, EXIT_SHUTDOWN
        elif isinstance(msg, DrainMessage):
            self.begin_drain(msg.reason)
        elif isinstance(msg, SwitchRole):
            refusal = self.switcher.begin(self.scheduler, ident, msg.role) if self.switcher is not None else None
            if self.switcher is None:
                refusal = RoleSwitched(ok=False, role=self.scheduler.role, error="this worker cannot switch roles")
            if refusal is not None:
                self.sock.send_multipart([ident, *encode(refusal)])
        elif isinstance(msg, KvSnapshotRequest):
            if self.kv_feed is not None:
                self.kv_feed.snapshot()
        else:
            self._to_scheduler(Conn(ident), msg, frames)

    def _to_scheduler(self, source: Conn | Peer, msg: Message, frames: list[bytes]) -> None:
        out = self.scheduler.handle(source, msg, frames)
        if out is None:
            log.error("%s worker cannot handle %s from %s", self.scheduler.role, type(msg).__name__, source)
        else:
            self.deliver(out)

    def _generate(self, ident: bytes, msg: GenerateRequest, frames: list[bytes]) -> None:
        try:
            self.deliver(self.scheduler.add(ident, msg, frame_ids(frames[0])))
        except (RequestRejected, ProtocolError, ValueError, TypeError) as e:
            out = Outbox()
            out.token(ident, TokenDelta.failed(msg.rid, str(e), 400))
            self.deliver(out)

    def _stats(self, nonce: int) -> WorkerStats:
        stats = worker_stats(
            self.scheduler, self.worker_id, self.instance, self.model_name, nonce, self.cluster_id, self.cores
        )
        stats.counters["refused_control_connections"] = float(self.io.refused_connections)
        if self.kv_feed is not None:
            stats.counters["kv_events_published"] = float(self.kv_feed.published)
            stats.counters["kv_snapshots_published"] = float(self.kv_feed.snapshots)
            stats = stats.model_copy(update={"kv_events_port": self.kv_feed.port, "kv_events_seq": self.kv_feed.seq})
        if not self.drain.active:
            return stats
        return stats.model_copy(update={"draining": True, "holding": len(self.scheduler.held_rids())})


def worker_stats(
    s: WorkerScheduler,
    worker_id: str,
    instance: str,
    model: str,
    nonce: int = 0,
    cluster_id: str = "",
    cores: CoreLending | None = None,
) -> WorkerStats:
    """The ``WorkerStats`` a worker answers heartbeats with: identity, capacity, metrics (the
    scheduler's, plus its core lending's when it has a slot)."""
    snap = s.snapshot()
    if cores is not None:
        counters, gauges = cores.stats()
        snap.counters.update(counters)
        snap.gauges.update(gauges)
    histograms = {k: HistogramData(**h.as_dict()) for k, h in snap.histograms.items()}
    return WorkerStats(
        nonce=nonce,
        worker_id=worker_id,
        cluster_id=cluster_id,
        instance=instance,
        role=s.role,
        model=model,
        capacity_tokens=s.capacity_tokens,
        max_model_len=s.max_model_len,
        page_size=s.kv.page_size,
        counters=snap.counters,
        gauges=snap.gauges,
        histograms=histograms,
    )
