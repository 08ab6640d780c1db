"""A worker's KV event feed: its radix cache's page events on a ZMQ PUB socket, for routers.

``KvFeed(tree, control_addr, worker_id, instance, auth)`` attaches a ``cache.kv_events.KvEventLog``
to ``tree`` and binds a PUB socket on the control address's host at a free port (``port``, which
the worker reports in ``WorkerStats.kv_events_port``). The socket is a CURVE server of the cluster
key like the control socket (its own context, so its own ZAP handler): a router without the key
never receives a message. ``flush()`` publishes what the tree recorded since the last flush as
one ``KvEvents`` (nothing when nothing happened); ``snapshot()`` publishes a ``KvSnapshot`` of the
whole tree. Both number their message with the feed's next ``seq``. Call everything from the
thread that owns the tree (the worker loop). A subscriber that falls behind ZMQ's high-water mark
loses messages; the ``seq`` gap makes it ask for a snapshot (``KvSnapshotRequest``).
"""

from __future__ import annotations

import logging

import zmq

from cache.kv_events import POOL, KvEventLog, tree_hashes
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import KvEvents, KvSnapshot, encode, hashes_frame

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")


def feed_bind_host(control_addr: str) -> str | None:
    """The host to bind the feed on: the control address's (``*`` for a wildcard), None for a
    control address that is not TCP (no feed then)."""
    if not control_addr.startswith("tcp://"):
        return None
    host = control_addr.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return "*" if host in WILDCARD_HOSTS else host


class KvFeed:
    """One worker's KV event publisher (see the module docstring)."""

    def __init__(self, tree, control_addr: str, worker_id: str, instance: str, auth: ControlAuth) -> None:
        host = feed_bind_host(control_addr)
        if host is None:
            raise ValueError(f"a KV event feed needs a tcp:// control address, got {control_addr!r}")
        self.tree, self.worker_id, self.instance = tree, worker_id, instance
        self.log = KvEventLog(tree.page_size)
        tree.events = self.log
        self.seq = 0
        self.published = 0  # KvEvents messages sent
        self.snapshots = 0  # KvSnapshot messages sent
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self._guard = auth.server(self.sock, f"KV event feed of {worker_id}")
        bind = f"tcp://[{host}]" if ":" in host else f"tcp://{host}"
        self.port = self.sock.bind_to_random_port(bind)
        log.info("KV event feed of %s on %s:%d", worker_id, bind, self.port)

    def flush(self) -> None:
        """Publish the events the tree recorded since the last flush (one message, or none)."""
        events = self.log.take()
        if not events:
            return
        self.seq += 1
        msg = KvEvents(
            worker_id=self.worker_id,
            instance=self.instance,
            seq=self.seq,
            pool=POOL,
            kinds=[e.kind.value for e in events],
            counts=[len(e.hashes) for e in events],
        )
        self._send(encode(msg, hashes_frame([h for e in events for h in e.hashes])))
        self.published += 1

    def snapshot(self) -> None:
        """Publish pending events, then a ``KvSnapshot`` of every page the tree holds."""
        self.flush()
        self.seq += 1
        msg = KvSnapshot(worker_id=self.worker_id, instance=self.instance, seq=self.seq, pool=POOL)
        self._send(encode(msg, hashes_frame(tree_hashes(self.tree))))
        self.snapshots += 1

    def _send(self, parts: list[bytes]) -> None:
        try:
            self.sock.send_multipart(parts, flags=zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeps up: it sees the seq gap and asks for a snapshot
            log.debug("KV event feed of %s: message %d dropped (high-water mark)", self.worker_id, self.seq)

    def close(self) -> None:
        """Detach from the tree and close the socket."""
        self.tree.events = None
        self.sock.close(0)
        self._guard.close()
        self.ctx.term()
