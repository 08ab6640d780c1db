"""Liveness of peer workers, measured on a thread that never waits on compute.

A worker that addresses peers (decode -> prefill) must not measure their liveness between its own
scheduler steps: a ping that goes out only after a long step, and a reply read only after the
next one, turn the worker's own slowness (a busy machine) into the peer's silence. ``PeerPinger``
owns one DEALER per watched address (apart from the scheduler thread's sockets), sends a
``StatsRequest`` to each every ``interval_s`` and stamps each ``WorkerStats`` reply with the
monotonic time it arrived. The scheduler thread collects the replies with ``take`` and judges
liveness (silence) and progress (the reply's ``stalled_s``) from those stamps.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from transfer.control_auth import ControlAuth
from transfer.wire.protocol import ProtocolError, StatsRequest, WorkerStats, decode, encode

log = logging.getLogger(__name__)


class PeerPinger:
    def __init__(self, ctx: zmq.Context, interval_s: float, *, auth: ControlAuth) -> None:
        """``auth``: how its sockets authenticate to the peers (the worker's own cluster key)."""
        self.ctx = ctx
        self.auth = auth
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._new: list[str] = []
        self._replies: dict[str, tuple[WorkerStats, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-pinger", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, addr: str) -> None:
        """Any thread: start pinging ``addr`` (idempotent)."""
        with self._lock:
            self._new.append(addr)

    def take(self) -> list[tuple[str, WorkerStats, float]]:
        """Any thread: ``(addr, latest reply, monotonic time it arrived)`` per peer that answered
        since the last call (older replies from the same peer are superseded)."""
        with self._lock:
            replies, self._replies = self._replies, {}
        return [(addr, stats, at) for addr, (stats, at) in replies.items()]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)

    def _run(self) -> None:
        socks: dict[zmq.Socket, str] = {}
        poller, next_ping = zmq.Poller(), time.monotonic()
        try:
            while not self._stop.is_set():
                self._connect_new(socks, poller)
                now = time.monotonic()
                if now >= next_ping:
                    next_ping = now + self.interval_s
                    for sock in socks:
                        self._ping(sock)
                timeout_ms = max(1, min(100, round((next_ping - time.monotonic()) * 1000)))
                if not socks:  # pyzmq returns at once from an empty poll: without this the thread spins
                    self._stop.wait(timeout_ms / 1000)
                    continue
                for sock, _ in poller.poll(timeout_ms):
                    self._receive(socks[sock], sock.recv_multipart())
        finally:
            for sock in socks:
                sock.close(0)

    def _connect_new(self, socks: dict[zmq.Socket, str], poller: zmq.Poller) -> None:
        with self._lock:
            new, self._new = self._new, []
        for addr in new:
            if addr in socks.values():
                continue
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            self.auth.client(sock, f"heartbeats to peer {addr}")
            sock.connect(addr)
            socks[sock] = addr
            poller.register(sock, zmq.POLLIN)
            self._ping(sock)

    @staticmethod
    def _ping(sock: zmq.Socket) -> None:
        try:  # a dead peer's queue fills up: drop pings rather than block this thread
            sock.send_multipart(encode(StatsRequest()), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _receive(self, addr: str, parts: list[bytes]) -> None:
        at = time.monotonic()
        try:
            msg, _ = decode(parts)
        except ProtocolError as e:
            log.error("bad heartbeat reply from peer worker %s: %s", addr, e)
            return
        if isinstance(msg, WorkerStats):
            with self._lock:
                self._replies[addr] = (msg, at)
