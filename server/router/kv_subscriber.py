"""The router's end of the workers' KV event feeds: one SUB socket, feeding ``KvIndex``.

Every ``tick()`` (the run loop's, about every ``tick_s``) looks at the registry's handles: a
worker whose stats report a feed (``WorkerStats.kv_events_port``) gets the SUB socket connected to
that port on its control address's host (again when the port changes: a new process); a worker
the index does not hold in sync gets a ``KvSnapshotRequest`` (at most one per ``resync_s``), and a
worker that left the registry is forgotten. Messages are matched to handles by the id the worker
reports (``WorkerHandle.reported_id``). The socket is a CURVE client of the cluster key
(``transfer.control_auth``), like the control sockets.

A gap (``KvEvents.seq`` skipping) asks for a snapshot at once; so does a heartbeat that reported
a later ``seq`` (``WorkerStats.kv_events_seq``) than the index reached ``resync_s`` earlier (the
last messages were lost and nothing came after them). ``resyncs`` counts the snapshot
requests sent, by cause (``initial``, ``gap``, ``restart``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import zmq
import zmq.asyncio

from server.router.kv_index import KvIndex
from server.router.workers import WorkerHandle
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import KvEvents, KvSnapshot, ProtocolError, decode, frame_hashes

log = logging.getLogger(__name__)


def feed_addr(control_addr: str, port: int) -> str:
    """The feed's address: ``port`` on the host of ``control_addr`` (``tcp://host:port``)."""
    host = control_addr.removeprefix("tcp://").rpartition(":")[0]
    return f"tcp://{host}:{port}"


class KvSubscriber:
    """Connects to the workers' feeds and keeps ``index`` in sync (see the module docstring)."""

    def __init__(
        self,
        index: KvIndex,
        handles: Callable[[], Mapping[str, WorkerHandle]],
        auth: ControlAuth,
        zctx: zmq.asyncio.Context | None = None,
        *,
        resync_s: float = 2.0,
        tick_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index, self.handles, self.auth = index, handles, auth
        self.zctx = zctx
        self.resync_s, self.tick_s, self.clock = resync_s, tick_s, clock
        self.connected: dict[str, str] = {}  # worker id -> feed address the socket is connected to
        self.asked_at: dict[str, float] = {}  # worker id -> when a snapshot was last requested
        self.resyncs: dict[str, int] = {"initial": 0, "gap": 0, "restart": 0}
        self.behind: dict[str, tuple[int, float]] = {}  # worker id -> (seq its stats reported, when seen)
        self.cause: dict[str, str] = {}  # worker id -> why its index is out of sync (gap, restart; else initial)
        self.sock: zmq.asyncio.Socket | None = None

    def open(self) -> None:
        """Create the SUB socket (subscribed to everything)."""
        zctx = self.zctx or zmq.asyncio.Context.instance()
        self.sock = zctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 10000)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 200)
        self.auth.client(self.sock, "router -> KV event feeds")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")

    async def run(self) -> None:
        """Receive feed messages forever, ticking between them."""
        if self.sock is None:
            self.open()
        next_tick = 0.0
        try:
            while True:
                if self.clock() >= next_tick:
                    self.tick()
                    next_tick = self.clock() + self.tick_s
                if await self.sock.poll(int(self.tick_s * 1000), zmq.POLLIN):
                    self.on_message(await self.sock.recv_multipart())
        finally:
            self.sock.close(0)
            self.sock = None

    def tick(self) -> None:
        """Connect new feeds, forget workers that left, ask unsynced workers for a snapshot."""
        handles = self.handles()
        for wid in [w for w in self.connected if w not in handles]:
            self._disconnect(wid)
            self.index.forget(wid)
        for h in handles.values():
            port = h.stats.kv_events_port if h.stats is not None else 0
            if not port:
                continue
            addr = feed_addr(h.spec.addr, port)
            if self.connected.get(h.worker_id) != addr:
                self._disconnect(h.worker_id)
                if self.sock is not None:
                    self.sock.connect(addr)
                self.connected[h.worker_id] = addr
                # the first ask waits a tick: a snapshot published before the connection is up is lost
                self.asked_at[h.worker_id] = self.clock() - self.resync_s + self.tick_s
            if self.index.observe_instance(h.worker_id, h.stats.instance):
                self.cause[h.worker_id] = "restart"
            self._check_behind(h)
            if self.index.needs_snapshot(h.worker_id):
                self.ask(h, self.cause.get(h.worker_id, "initial"))
            else:
                self.cause.pop(h.worker_id, None)

    def _check_behind(self, h: WorkerHandle) -> None:
        """A heartbeat reported a feed ``seq`` the index has not reached: if it still has not after
        ``resync_s`` (the messages were lost, and no later one showed the gap), re-sync."""
        reported, applied = h.stats.kv_events_seq, self.index.seq(h.worker_id)
        if self.index.needs_snapshot(h.worker_id) or reported <= applied:
            self.behind.pop(h.worker_id, None)
            return
        seen = self.behind.setdefault(h.worker_id, (reported, self.clock()))
        if applied < seen[0] and self.clock() - seen[1] >= self.resync_s:
            log.info(
                "KV event feed of %s: index at message %d, the worker reported %d: re-syncing",
                h.worker_id,
                applied,
                seen[0],
            )
            self.behind.pop(h.worker_id, None)
            self.index.mark_lost(h.worker_id)
            self.cause[h.worker_id] = "gap"

    def _disconnect(self, worker_id: str) -> None:
        addr = self.connected.pop(worker_id, None)
        if addr is not None and self.sock is not None:
            try:
                self.sock.disconnect(addr)
            except zmq.ZMQError:
                pass

    def ask(self, h: WorkerHandle, cause: str) -> None:
        """Send ``h`` a ``KvSnapshotRequest`` unless one went out less than ``resync_s`` ago."""
        now = self.clock()
        last = self.asked_at.get(h.worker_id)
        if last is not None and now - last < self.resync_s:
            return
        request = getattr(h.client, "request_kv_snapshot", None)
        if request is None:
            return
        self.asked_at[h.worker_id] = now
        self.resyncs[cause] += 1
        try:
            request(cause)
        except Exception as e:  # WorkerUnavailable: the next tick asks again
            log.debug("KV snapshot request to %s not sent: %s", h.worker_id, e)

    def _handle_of(self, reported_id: str) -> WorkerHandle | None:
        for h in self.handles().values():
            if h.reported_id == reported_id:
                return h
        return None

    def on_message(self, parts: list[bytes]) -> None:
        """Apply one feed message to the index (a gap asks for a snapshot at once)."""
        try:
            msg, frames = decode(parts)
            if not isinstance(msg, (KvEvents, KvSnapshot)):
                raise ProtocolError(f"unexpected {type(msg).__name__} on a KV event feed")
            h = self._handle_of(msg.worker_id)
            if h is None:
                return
            if isinstance(msg, KvSnapshot):
                self.index.apply_snapshot(h.worker_id, msg.instance, msg.seq, frame_hashes(frames[0]))
                return
            was_synced = not self.index.needs_snapshot(h.worker_id)
            known = self.index.workers.get(h.worker_id)
            restarted = known is not None and bool(known.instance) and known.instance != msg.instance
            if not self.index.apply_events(h.worker_id, msg.instance, msg.seq, msg.unpack(frames[0])) and was_synced:
                self.cause[h.worker_id] = "restart" if restarted else "gap"
                self.asked_at.pop(h.worker_id, None)
                self.ask(h, self.cause[h.worker_id])
        except ProtocolError as e:
            log.error("bad KV event feed message: %s", e)
