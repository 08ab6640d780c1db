"""One ZMQ DEALER connection from the router to one worker's ROUTER socket (``zmq.asyncio``).

Sends are non-blocking (``NOBLOCK``) and synchronous, so they can run in ``finally`` blocks of
cancelled tasks; a full send queue (worker gone for long) raises ``WorkerUnavailable``. One
background task receives everything the worker sends: each ``TokenBatch`` entry goes to
``on_tokens(worker_id, delta)`` and each ``WorkerStats`` to ``on_stats(worker_id, stats)``.

Addresses may name hosts by DNS (``tcp://decode-0:29500``). libzmq resolves the name on every
connection attempt, so a worker whose name does not resolve yet (a container not started) joins
once it does, and a worker that came back at another address is found again. ZMTP heartbeats
drop a connection whose peer went silent (a killed container's address answers nothing, and TCP
alone would wait minutes), which makes libzmq reconnect and resolve again; :meth:`reconnect` does
the same on demand.

The socket is a CURVE client of the cluster key (``transfer.control_auth``); a handshake the
worker refuses (another key, no key) is logged naming ``--cluster-key`` and kept in
``handshake_error`` until a handshake succeeds, so ``/health`` can say why a worker never answers.

The same monitor tells when the worker's process is gone (``transfer.link_watch``: the connection
dropped and the reconnect was refused): ``on_link_lost(worker_id, reason)`` is then called on the
event loop, once per drop, while the socket is still this client's. Nothing of it runs per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from transfer.control_auth import ControlAuth, HandshakeWatch
from transfer.link_watch import LinkWatch
from transfer.wire.enums import Role
from transfer.wire.protocol import (
    AbortRequest,
    DraftRecord,
    Drain,
    GenerateRequest,
    KvSnapshotRequest,
    KVSources,
    Message,
    MigrateRequest,
    MigrationDeclined,
    MigrationEnded,
    MigrationOffer,
    PrefilledLocally,
    PrefillRequest,
    ProtocolError,
    QueuedMove,
    QueuedOffer,
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
    ids_frame,
)
from transfer.wire.sampling_params import SamplingParams

log = logging.getLogger(__name__)

TokensCallback = Callable[[str, TokenDelta], None]
StatsCallback = Callable[[str, WorkerStats], None]
LinkLostCallback = Callable[[str, str], None]


class WorkerUnavailable(RuntimeError):
    """The worker's socket cannot take more messages (it is not reading them)."""


class WorkerClient:
    """Typed control channel to one worker. Call :meth:`start` inside the event loop."""

    def __init__(
        self,
        worker_id: str,
        addr: str,
        ctx: zmq.asyncio.Context,
        on_tokens: TokensCallback,
        on_stats: StatsCallback,
        *,
        auth: ControlAuth,
    ) -> None:
        """Prepare a DEALER for ``addr`` (e.g. ``tcp://127.0.0.1:29500``) authenticated by ``auth``;
        nothing connects yet."""
        self.worker_id = worker_id
        self.addr = addr
        self.auth = auth
        self._watch: HandshakeWatch | None = None
        self._ctx = ctx
        self._on_tokens = on_tokens
        self._on_stats = on_stats
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        # migration messages (``MigrationOffer`` with its ids, ``MigrationEnded``, ``QueuedOffer``): set by the registry
        self.on_migration: Callable[[str, Message, list[int]], None] | None = None
        self._role_answer: asyncio.Future | None = None  # the pending ``switch_role``'s answer
        # a continuation the decode worker prefills itself (``PrefilledLocally``): set by the registry
        self.on_local: Callable[[str, str], None] | None = None
        # the worker's process is gone (its connection closed, the reconnect refused): set by the registry
        self.on_link_lost: LinkLostCallback | None = None
        self._lost: set[asyncio.Future] = set()  # verdicts on their way to on_link_lost (held against GC)

    async def start(self) -> None:
        """Connect (the worker may bind later; messages queue until it does) and start receiving."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        loop = asyncio.get_running_loop()

        def lost(reason: str) -> None:  # on the monitor's thread: hand the verdict to the loop
            with contextlib.suppress(RuntimeError):  # a closed loop takes nothing
                loop.call_soon_threadsafe(
                    lambda: self._lost.add(asyncio.ensure_future(_report_lost(self, sock, reason)))
                )

        link = LinkWatch(self.addr, lost)
        self._watch = self.auth.client(sock, f"router -> worker {self.worker_id}", link)
        sock.connect(self.addr)
        self._sock = sock
        self._task = asyncio.create_task(self._recv_loop(), name=f"recv-{self.worker_id}")

    @property
    def handshake_error(self) -> str | None:
        """Why the latest control handshake with the worker failed (names ``--cluster-key``), or
        None when none failed since the last one that succeeded."""
        return self._watch.error if self._watch is not None else None

    async def reconnect(self) -> None:
        """Drop the connection and its queued messages, connect again (resolving the name anew)."""
        await self.close()
        await self.start()

    def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        room: int | None = None,
        prefill_addr: str | None = None,
        preempt: bool = False,
        resume_output_ids: list[int] = (),
    ) -> None:
        """Send a ``GenerateRequest`` (PD decode workers also get ``room``, the prefill worker's
        address and ``preempt``; a continuation its output so far); raises ``WorkerUnavailable`` if it
        cannot be queued."""
        self._send(
            GenerateRequest(
                rid=rid,
                params=params,
                room=room,
                prefill_addr=prefill_addr,
                preempt=preempt,
                resume_output_ids=list(resume_output_ids),
            ),
            ids_frame(prompt_ids),
        )

    def prefill(
        self,
        rid: str,
        room: int,
        prompt_ids: list[int],
        params: SamplingParams,
        decode_worker: str,
        answer_router: bool = False,
    ) -> None:
        """Send a ``PrefillRequest`` to a PD prefill worker (``answer_router``: a one-token request it
        answers itself, ``decode_worker`` empty); ``WorkerUnavailable`` if it cannot be queued."""
        msg = PrefillRequest(
            rid=rid, room=room, params=params, decode_worker=decode_worker, answer_router=answer_router
        )
        self._send(msg, ids_frame(prompt_ids))

    def migrate(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        room: int,
        source_addr: str,
        prompt_len: int,
        n_tokens: int,
        draft: DraftRecord | None = None,
    ) -> None:
        """Send a ``MigrateRequest`` to a decode worker; ``WorkerUnavailable`` if it cannot be queued."""
        self._send(
            MigrateRequest(
                rid=rid,
                params=params,
                room=room,
                source_addr=source_addr,
                prompt_len=prompt_len,
                n_tokens=n_tokens,
                draft=draft,
            ),
            ids_frame(ids),
        )

    def decline_migration(self, rid: str, reason: str) -> None:
        """Tell a decode worker no peer takes ``rid`` (``MigrationDeclined``); ``WorkerUnavailable``."""
        self._send(MigrationDeclined(rid=rid, reason=reason))

    def move_queued(self, rid: str, target: str) -> None:
        """Tell a decode worker its offered queued ``rid`` went to ``target`` (``QueuedMove``);
        ``WorkerUnavailable`` if it cannot be queued."""
        self._send(QueuedMove(rid=rid, target=target))

    def kv_sources(self, msg: KVSources) -> None:
        """Send a decode worker the workers it may take KV from; ``WorkerUnavailable``."""
        self._send(msg)

    def abort(self, rids: list[str], reason: str) -> None:
        """Send an ``AbortRequest`` (best effort: errors are logged, never raised)."""
        try:
            self._send(AbortRequest(rids=rids, reason=reason))
        except WorkerUnavailable as e:
            log.warning("abort of %s not delivered: %s", rids, e)

    def request_stats(self, nonce: int) -> None:
        """Send a ``StatsRequest`` (heartbeat); raises ``WorkerUnavailable`` if it cannot be queued."""
        self._send(StatsRequest(nonce=nonce))

    def request_kv_snapshot(self, reason: str) -> None:
        """Ask the worker to publish a ``KvSnapshot`` on its KV event feed; ``WorkerUnavailable``
        if it cannot be queued."""
        self._send(KvSnapshotRequest(reason=reason))

    async def switch_role(self, role: Role, timeout_s: float) -> RoleSwitched:
        """Ask the worker to switch to ``role`` and wait for its ``RoleSwitched``; ``WorkerUnavailable``
        if the request cannot be sent, ``TimeoutError`` past ``timeout_s``. One at a time."""
        fut = self._role_answer = asyncio.get_running_loop().create_future()
        try:
            self._send(SwitchRole(role=role))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._role_answer = None

    def drain(self, reason: str) -> None:
        """Ask the worker to drain (finish what it holds, take nothing new, exit); best effort."""
        try:
            self._send(Drain(reason=reason))
        except WorkerUnavailable as e:
            log.warning("drain of worker %s not delivered: %s", self.worker_id, e)

    def shutdown(self) -> None:
        """Ask the worker process to exit (best effort)."""
        try:
            self._send(Shutdown())
        except WorkerUnavailable:
            pass

    async def close(self) -> None:
        """Stop receiving and close the socket."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(0)
        self._sock = self._task = None

    def _send(self, msg: Message, *frames: bytes) -> None:
        if self._sock is None:
            raise WorkerUnavailable(f"worker {self.worker_id}: not connected")
        fut = self._sock.send_multipart(encode(msg, *frames), flags=zmq.NOBLOCK)
        exc = fut.exception() if fut.done() else None  # always done: nothing ever waits to send
        if isinstance(exc, zmq.Again):
            raise WorkerUnavailable(f"worker {self.worker_id} at {self.addr} is not accepting messages")
        if exc is not None:
            raise WorkerUnavailable(f"worker {self.worker_id}: send failed: {exc}")

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            parts = await self._sock.recv_multipart()
            try:
                self._handle(parts)
            except ProtocolError as e:
                log.error("bad message from worker %s: %s", self.worker_id, e)
            except Exception:  # a bug in a callback must not kill the receive loop
                log.exception("error handling a message from worker %s", self.worker_id)

    def _handle(self, parts: list[bytes]) -> None:
        msg, frames = decode(parts)
        if isinstance(msg, TokenBatch):
            for delta in msg.unpack(frames[0]):
                self._on_tokens(self.worker_id, delta)
        elif isinstance(msg, WorkerStats):
            self._on_stats(self.worker_id, msg)
        elif isinstance(msg, (MigrationOffer, MigrationEnded, QueuedOffer)) and self.on_migration is not None:
            self.on_migration(self.worker_id, msg, frame_ids(frames[0]) if frames else [])
        elif isinstance(msg, PrefilledLocally) and self.on_local is not None:
            self.on_local(self.worker_id, msg.rid)
        elif isinstance(msg, RoleSwitched) and self._role_answer is not None and not self._role_answer.done():
            self._role_answer.set_result(msg)
        else:
            log.warning("unexpected %s from worker %s", type(msg).__name__, self.worker_id)


async def _report_lost(client: WorkerClient, sock: zmq.asyncio.Socket, reason: str) -> None:
    """On the loop: report ``client``'s lost connection unless the socket was closed or replaced
    since. What the worker sent before its connection closed (its last tokens, a final delta) is
    handled first, so a request it finished is not failed over."""
    try:
        for _ in range(1000):  # the receive loop empties the socket; at most about a second
            if sock.closed or not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            await asyncio.sleep(0.001)
        await asyncio.sleep(0)  # a message already received is handled in the receive loop's next step
        if sock is client._sock and client.on_link_lost is not None:
            client.on_link_lost(client.worker_id, reason)
    finally:
        client._lost.discard(asyncio.current_task())
