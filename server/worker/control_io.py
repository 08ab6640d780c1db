"""The worker's external control socket, served by its own thread.

Heartbeats (``StatsRequest``) are answered on this thread from the latest ``WorkerStats`` the
scheduler thread published, so a long scheduler step (a big prefill chunk on a busy CPU) never
looks like a dead worker; each answer carries ``stalled_s`` (seconds since the scheduler thread
last finished a loop iteration), so a peer can tell a live-but-stuck worker from a busy one. A
scheduler thread that has not finished a loop iteration for ``stall_limit_s`` (the configured
``progress_timeout_s``) gets no answers: a hung worker still times out for peers that only
watch silence. Every other message is relayed
to the scheduler thread over an inproc PAIR socket, framed exactly as a ROUTER delivers it
(``[identity, *parts]``), and what the scheduler thread sends on its end goes out the same way.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import zmq

from transfer.control_auth import ControlAuth
from transfer.wire.protocol import ProtocolError, StatsRequest, WorkerStats, decode, encode

log = logging.getLogger(__name__)


class ControlIO:
    def __init__(
        self,
        ctx: zmq.Context,
        control_addr: str,
        stall_limit_s: float = 120.0,
        listen_fd: int | None = None,
        *,
        auth: ControlAuth,
    ) -> None:
        """Bind ``control_addr``; with ``listen_fd``, serve on that already listening TCP socket
        instead (the launcher holds the port across worker restarts, see ``server.launch.ports``).
        ``auth``: the socket is a CURVE server of the cluster key (``transfer.control_auth``; a
        peer without the key never gets a message through), or plain with ``ControlAuth.insecure()``."""
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self._guard = auth.server(self.router, f"control socket {control_addr}")
        if listen_fd is not None:
            self.router.setsockopt(zmq.USE_FD, listen_fd)
        self.router.bind(control_addr)
        name = f"inproc://control-{uuid.uuid4().hex}"
        self._io_end = ctx.socket(zmq.PAIR)
        self._io_end.bind(name)
        self.scheduler_end = ctx.socket(zmq.PAIR)  # used only by the scheduler thread
        self.scheduler_end.connect(name)
        self.stall_limit_s = stall_limit_s
        self.latest: WorkerStats | None = None
        self.beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-io", daemon=True)

    @property
    def refused_connections(self) -> int:
        """Connection attempts this socket refused (a peer without the cluster key, or another one)."""
        return self._guard.refused

    def start(self) -> None:
        self._thread.start()

    def publish(self, stats: WorkerStats) -> None:
        """Scheduler thread: the stats heartbeats answer with, and proof that it is making progress."""
        self.latest = stats
        self.beat = time.monotonic()

    def alive(self) -> None:
        """Scheduler thread: finished a loop iteration (without new stats)."""
        self.beat = time.monotonic()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._io_end, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                if sock is self._io_end:
                    self.router.send_multipart(self._io_end.recv_multipart())
                else:
                    self._inbound(self.router.recv_multipart())

    def _inbound(self, frames: list[bytes]) -> None:
        ident, parts = frames[0], frames[1:]
        if parts and parts[0] == b"StatsRequest" and self.latest is not None:
            if time.monotonic() - self.beat > self.stall_limit_s:
                log.error("scheduler thread stalled for over %.0fs: not answering heartbeats", self.stall_limit_s)
                return
            try:
                msg, _ = decode(parts)
            except ProtocolError:
                msg = None
            if isinstance(msg, StatsRequest):
                stalled = round(time.monotonic() - self.beat, 3)
                reply = self.latest.model_copy(update={"nonce": msg.nonce, "stalled_s": stalled})
                self.router.send_multipart([ident, *encode(reply)])
                return
        self._io_end.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        for s in (self.router, self._io_end, self.scheduler_end):
            s.close(0)
        self._guard.close()
