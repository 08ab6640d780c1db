"""A worker's control plane: one ZMQ ROUTER socket in front of a scheduler.

The external ROUTER socket lives on a ``ControlIO`` thread that answers heartbeats even during a
long step; this loop sees the same frames on an inproc socket. The loop alternates between
draining control messages (non-blocking while there is work,
blocking up to ``idle_poll_ms`` when idle) and running one scheduler step, whose token events are
sent back, batched per step, to the connection that submitted each request.

Scheduler contract: ``add_request(rid, prompt_ids, params, **pd)`` (raises ``RequestRejected``;
``pd`` = ``room``/``prefill_addr`` for decode workers), ``abort(rid, message)``, ``step() ->
list[TokenEvent]`` (called every iteration), ``has_work``, ``snapshot() -> (counters, gauges)``,
``capacity_tokens``, ``max_model_len``, ``page_size``. Optional: ``handle(source, msg, frames) ->
bool`` for role-specific messages, ``sockets()`` (extra sockets to poll, e.g. connections to peer
workers; their messages go to ``handle`` with the socket as source), ``histograms()``.
"""
from __future__ import annotations

import logging
import signal
import time
import uuid
from collections import defaultdict

import zmq

from engine.scheduler.base import RequestRejected
from engine.scheduler.events import TokenEvent
from server.control_io import ControlIO
from transfer.protocol import (AbortRequest, GenerateRequest, HistogramData, Message, ProtocolError, Shutdown,
                               StatsRequest, TokenBatch, TokenEntry, WorkerStats, decode, encode, frame_ids,
                               ids_frame)

log = logging.getLogger(__name__)


class WorkerLoop:
    def __init__(self, control_addr: str, worker_id: str, role: str, model_name: str,
                 idle_poll_ms: int = 20) -> None:
        self.scheduler = None
        self.worker_id = worker_id
        self.role = role
        self.model_name = model_name
        self.idle_poll_ms = idle_poll_ms
        self.ctx = zmq.Context.instance()
        self.io = ControlIO(self.ctx, control_addr)
        self.sock = self.io.scheduler_end  # frames arrive as [identity, *parts], like a ROUTER's
        self.owner: dict[str, bytes] = {}   # rid -> identity of the connection that submitted it
        self.instance = uuid.uuid4().hex
        self.stopping = False
        self.stats_every_s = 0.1
        self._stats_at = 0.0

    def send(self, ident: bytes, msg: Message, *frames: bytes) -> None:
        """Send a message to the connection ``ident`` on this worker's control socket."""
        self.sock.send_multipart([ident, *encode(msg, *frames)])

    def run(self, scheduler) -> None:
        self.scheduler = scheduler
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        log.info("%s worker %s serving", self.role, self.worker_id)
        self.io.publish(self._stats(0))
        self.io.start()
        try:
            while not self.stopping:
                self._drain(block=not scheduler.has_work)
                self._publish(scheduler.step())
                self._heartbeat()
        finally:
            self.io.close()

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._stats_at >= self.stats_every_s:
            self._stats_at = now
            self.io.publish(self._stats(0))
        else:
            self.io.alive()

    def _sockets(self) -> list[zmq.Socket]:
        extra = getattr(self.scheduler, "sockets", None)
        return [self.sock, *(extra() if extra else [])]

    def _drain(self, block: bool) -> None:
        timeout = self.idle_poll_ms if block else 0
        while True:
            poller = zmq.Poller()
            for s in self._sockets():
                poller.register(s, zmq.POLLIN)
            ready = dict(poller.poll(timeout))
            if not ready:
                return
            for s in ready:
                if s is self.sock:
                    ident, *parts = s.recv_multipart()
                    self._handle(ident, parts)
                else:
                    self._handle_peer(s, s.recv_multipart())
            timeout = 0

    def _handle_peer(self, sock: zmq.Socket, parts: list[bytes]) -> None:
        try:
            msg, frames = decode(parts)
        except ProtocolError as e:
            log.error("bad message from a peer worker: %s", e)
            return
        if not self.scheduler.handle(sock, msg, frames):
            log.error("unexpected %s from a peer worker", type(msg).__name__)

    def _handle(self, ident: bytes, parts: list[bytes]) -> None:
        try:
            msg, frames = decode(parts)
        except ProtocolError as e:
            log.error("bad control message from %r: %s", ident, e)
            return
        if isinstance(msg, GenerateRequest):
            self._generate(ident, msg, frame_ids(frames[0]))
        elif isinstance(msg, AbortRequest):
            self._publish([ev for rid in msg.rids if (ev := self.scheduler.abort(rid, msg.reason))])
        elif isinstance(msg, StatsRequest):
            self.send(ident, self._stats(msg.nonce))
        elif isinstance(msg, Shutdown):
            self.stopping = True
        elif not (hasattr(self.scheduler, "handle") and self.scheduler.handle(ident, msg, frames)):
            log.error("%s worker cannot handle %s", self.role, type(msg).__name__)

    def _generate(self, ident: bytes, msg: GenerateRequest, prompt: list[int]) -> None:
        self.owner[msg.rid] = ident
        pd = {} if msg.room is None else {"room": msg.room, "prefill_addr": msg.prefill_addr}
        try:
            self.scheduler.add_request(msg.rid, prompt, msg.params, **pd)
        except (RequestRejected, ValueError, TypeError) as e:
            self._publish([TokenEvent(msg.rid, finish_reason="abort", error=str(e), error_status=400)])

    def _publish(self, events: list[TokenEvent]) -> None:
        by_owner: dict[bytes, list[TokenEvent]] = defaultdict(list)
        for ev in events:
            ident = self.owner.get(ev.rid)
            if ident is None:
                continue
            by_owner[ident].append(ev)
            if ev.finish_reason:
                del self.owner[ev.rid]
        for ident, evs in by_owner.items():
            entries = [TokenEntry(rid=e.rid, n=len(e.token_ids), logprobs=e.logprobs, top_logprobs=e.top_logprobs,
                                  finish_reason=e.finish_reason, error=e.error, error_status=e.error_status,
                                  prompt_tokens=e.prompt_tokens, cached_tokens=e.cached_tokens) for e in evs]
            ids = [t for e in evs for t in e.token_ids]
            self.send(ident, TokenBatch(entries=entries), ids_frame(ids))

    def _stats(self, nonce: int) -> WorkerStats:
        s = self.scheduler
        counters, gauges = s.snapshot()
        hists = getattr(s, "histograms", None)
        histograms = {k: HistogramData(**h.as_dict()) for k, h in (hists() if hists else {}).items()}
        return WorkerStats(nonce=nonce, worker_id=self.worker_id, instance=self.instance, role=self.role,
                           model=self.model_name,
                           capacity_tokens=s.capacity_tokens, max_model_len=s.max_model_len, page_size=s.page_size,
                           counters=counters, gauges=gauges, histograms=histograms)
