"""Typed, versioned control messages over ZMQ multipart frames. No pickle anywhere.

Wire form: ``[kind, header_json, *raw_frames]``. ``kind`` is the ASCII name of the header model;
``header_json`` is the model's JSON (with ``version``); raw frames carry token ids as
little-endian int32 arrays (``ids_frame``/``frame_ids``). ``decode`` refuses unknown kinds and
versions with ``ProtocolError`` naming what it got and what it supports.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from transfer.wire.base import (  # noqa: F401
    PROTOCOL_VERSION,
    PromptLogprobs,
    ProtocolError,
    frame_hashes,
    frame_ids,
    hashes_frame,
    ids_frame,
)
from transfer.wire.enums import FinishReason, Role
from transfer.wire.failover_messages import PrefilledLocally  # noqa: F401
from transfer.wire.manifest import TransferManifest  # noqa: F401 (re-exported)
from transfer.wire.message import Message
from transfer.wire.migration_messages import (  # noqa: F401
    DraftRecord,
    MigrateRequest,
    MigrationDeclined,
    MigrationEnded,
    MigrationOffer,
    QueuedMove,
    QueuedOffer,
)
from transfer.wire.role_messages import RoleSwitched, SwitchRole  # noqa: F401
from transfer.wire.sampling_params import SamplingParams


# ---- router -> worker ---------------------------------------------------------------------
class GenerateRequest(Message):
    """Start a request. Frame 0: prompt token ids (int32).

    PD mode (sent to a decode worker): ``room`` identifies the KV transfer and ``prefill_addr``
    is the control address of the prefill worker that computes the prompt. ``preempt``: the
    router granted it to an API key under its share while another key is over its own; a PD decode
    worker whose batch is full retracts a running request without the flag to start it at once.

    ``resume_output_ids``: a continuation (router failover): the output tokens a worker that died
    already streamed. The worker computes prompt + these tokens and continues at output index
    ``k = len(resume_output_ids)``: ``max_new_tokens`` counts them, penalties see them as output,
    seeded sampling draws token ``k`` with the seed of index ``k``, the grammar matcher has consumed
    them. Its deltas carry only the tokens after them. Empty: a new request.
    """

    rid: str
    params: SamplingParams
    room: int | None = None
    prefill_addr: str | None = None
    preempt: bool = False
    resume_output_ids: list[int] = []
    n_frames: ClassVar[int] = 1


class KVSources(Message):
    """Router -> PD decode worker: the control addresses of the workers it may take KV from: the
    ``prefill`` workers of its model and its ``decode`` peers (sources of migrated requests). It
    handshakes each one it does not know yet (decode peers only when it migrates itself), so that
    the first transfer from a source finds the connection made. Sent again when the list changes."""

    prefill: list[str] = []
    decode: list[str] = []


# ---- PD: router/decode -> prefill, decode <-> prefill ----------------------------------------
class PrefillRequest(Message):
    """Compute the KV of the ids in frame 0 and ship it to ``decode_worker``.

    Sent by the router for a new request (generation 0) and by the decode worker itself to
    re-prefill prompt + output of a request it had to drop (generation > 0). ``continuation``: the
    recompute of a failover continuation (the output a dead worker streamed), whose computed tokens
    the prefill worker counts apart (``SchedulerStats.continuation_prefill_tokens``).

    ``answer_router``: a one-token request (``params.max_new_tokens`` 1, generation 0) that no
    decode worker takes part in: the prefill worker samples its token and answers the router with
    the ``TokenDelta`` a colocated worker would send (``decode_worker`` is empty); the prompt's KV
    goes to its radix cache, nothing is written anywhere.
    """

    rid: str
    room: int
    generation: int = 0
    params: SamplingParams
    decode_worker: str
    continuation: bool = False
    answer_router: bool = False
    n_frames: ClassVar[int] = 1


class KVHandshake(Message):
    """Decode -> prefill before the first transfer: who I am, my KV layout, my transport endpoint.
    ``cluster_id``: the deployment the decode worker belongs to; the prefill side refuses another."""

    worker_id: str
    cluster_id: str = ""
    model: str
    layout: dict
    pool_geometry: tuple[int, int, int] = (0, 1, 0)  # cache.kv_pools.PoolGeometry of the decode pools
    transport: str
    transport_metadata: str  # base64


class KVHandshakeAck(Message):
    ok: bool
    worker_id: str
    error: str | None = None


class KVDestination(Message):
    """Decode -> prefill: write tokens ``[decode_prefix_len, n_tokens)`` into these pages.

    Frame 0: int32 full-pool page ids covering the whole prompt (page j holds tokens
    ``[j*P, (j+1)*P)``); ``decode_prefix_len`` is page aligned (the decode side's radix cache
    holds the prefix). Frame 1: the SWA-pool pages by logical page (-1: not wanted), empty for
    models without an SWA pool; only the SWA tail is preallocated.
    """

    rid: str
    room: int
    generation: int
    decode_prefix_len: int
    n_tokens: int
    n_frames: ClassVar[int] = 2


class PrefillFailed(Message):
    """Prefill -> decode: nothing was or will be written for this room/generation. ``handed_back``:
    the prefill worker is changing role and gives back a prompt whose KV it has not written; the decode worker
    ends the request as handed back (``TokenDelta.handed_back``), so the router sends it again to
    another pair without using a retry."""

    rid: str
    room: int
    generation: int
    error: str
    error_status: int = 500
    handed_back: bool = False


class PrefillWithdrawn(Message):
    """Decode -> prefill: the decode worker prefills this room/generation itself (selective
    disaggregation, ``--local-prefill-max-tokens``); drop it without an answer to anyone. It may
    come before the router's ``PrefillRequest``: that one is then dropped when it arrives. For a
    room with a destination (a decode worker changing role) nothing more is written into it and
    the answer is ``PrefillFailed`` once nothing is being written (``prefill_worker.withdraw``)."""

    rid: str
    room: int
    generation: int = 0


class KVWriteStarted(Message):
    """Prefill -> decode: the KV write into this room/generation's pages was posted in this step;
    its completion notification follows on the data plane. Until this comes the decode worker does
    not poll its transport for the room (the prefill worker is still computing it): the wait is
    event-driven, not a poll every few ms that takes CPU from the prefill compute."""

    rid: str
    room: int
    generation: int = 0


class AbortRequest(Message):
    rids: list[str]
    reason: str = "aborted by client"


class StatsRequest(Message):
    """Ask for a ``WorkerStats`` reply (health checks and /metrics)."""

    nonce: int = 0


class Shutdown(Message):
    pass


class KvSnapshotRequest(Message):
    """Router -> worker: publish a ``KvSnapshot`` of your radix cache on your KV event feed (the
    router lost track: a sequence gap, a new worker process, or it just subscribed)."""

    reason: str = ""


class Drain(Message):
    """Router -> worker: stop taking new requests, finish the ones held (within the worker's
    ``drain_timeout_s``), then exit 0, exactly as on SIGTERM. ``reason`` goes to the worker's log."""

    reason: str = "drain requested by the router"


# ---- worker -> router ---------------------------------------------------------------------
class TokenDelta(BaseModel):
    """New tokens of one request: the one shape a token update has from the scheduler step that
    produced it, through the wire (inside a ``TokenBatch``), to the router session that streams it.

    ``finish_reason`` is set on the request's last delta: "stop", "length" or "abort"; an abort
    carries ``error`` (a message for the client) and ``error_status`` (the HTTP status to answer
    with); ``handed_back`` marks an abort by a decode worker changing role of a request that streamed
    nothing (the router sends it again without using a retry, ``server.router.session``).
    ``stop_token_id`` (with ``stop_logprob`` / ``stop_top_logprobs`` when logprobs were asked
    for) is the stop token (EOS or a ``stop_token_ids`` id) that finished the request: not in
    ``token_ids`` (it is not text), but the router counts and shows it as vLLM does (usage,
    ``token_ids``, logprobs). ``prompt_logprobs`` (the request's first delta, when asked for) holds
    one ``PromptLogprobs`` entry per prompt token. On the wire ``token_ids`` travel in the batch's int32 frame, not in
    the JSON header.
    """

    model_config = ConfigDict(extra="forbid")
    rid: str
    token_ids: list[int] = Field(default_factory=list, exclude=True)
    logprobs: list[float | None] = []
    top_logprobs: list[list[tuple[int, float]] | None] = []
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    stop_logprob: float | None = None
    stop_top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None
    error_status: int | None = None
    handed_back: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # on the first delta, when params.prompt_logprobs is set

    @classmethod
    def failed(cls, rid: str, error: str, status: int, handed_back: bool = False) -> TokenDelta:
        """The last delta of a request that ends with an error and no new tokens."""
        return cls(rid=rid, finish_reason=FinishReason.ABORT, error=error, error_status=status, handed_back=handed_back)


class TokenBatch(Message):
    """Every delta of one scheduler step for one connection. ``counts[i]`` ids of frame 0 (all
    deltas' ids concatenated) belong to ``entries[i]``. Build with ``pack``, read with ``unpack``."""

    entries: list[TokenDelta]
    counts: list[int]
    n_frames: ClassVar[int] = 1

    @classmethod
    def pack(cls, deltas: list[TokenDelta]) -> tuple[TokenBatch, bytes]:
        ids = [t for d in deltas for t in d.token_ids]
        return cls(entries=deltas, counts=[len(d.token_ids) for d in deltas]), ids_frame(ids)

    def unpack(self, frame: bytes) -> list[TokenDelta]:
        """The deltas with their ids; ``ProtocolError`` if the frame does not match ``counts``."""
        ids = frame_ids(frame)
        if len(self.counts) != len(self.entries) or sum(self.counts) != len(ids) or min(self.counts, default=0) < 0:
            raise ProtocolError(
                f"TokenBatch: counts {self.counts} do not match {len(self.entries)} entries and {len(ids)} ids"
            )
        out, pos = [], 0
        for entry, n in zip(self.entries, self.counts):
            out.append(entry.model_copy(update={"token_ids": ids[pos : pos + n]}))
            pos += n
        return out


class HistogramData(BaseModel):
    """Non-cumulative bucket counts (``counts[i]`` for ``value <= buckets[i]``, last is +Inf)."""

    model_config = ConfigDict(extra="forbid")
    buckets: list[float]
    counts: list[int]
    sum: float


class WorkerStats(Message):
    """Worker identity, capacity and counters (``counters``: cumulative, ``gauges``: current).
    ``cluster_id``: the deployment the worker belongs to (routers and peers refuse another)."""

    nonce: int = 0
    worker_id: str
    cluster_id: str = ""
    instance: str = ""  # random per process start: a new value means the worker restarted
    role: Role
    model: str
    capacity_tokens: int
    max_model_len: int
    page_size: int
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    histograms: dict[str, HistogramData] = {}
    # seconds since the worker's scheduler thread last finished a loop iteration, as its control
    # thread saw it when answering: an answer proves liveness, this tells progress apart
    stalled_s: float = 0.0
    # the worker is draining (SIGTERM or ``Drain``): route nothing new to it; it exits once it
    # holds no request (``holding``: how many it still holds)
    draining: bool = False
    holding: int = 0
    # the TCP port of the worker's KV event feed (``KvEvents``/``KvSnapshot`` on a ZMQ PUB socket, on
    # the control address's host); 0: the worker publishes none (no radix cache)
    kv_events_port: int = 0
    kv_events_seq: int = 0  # the feed's last message number: a router that saw fewer lost the rest


# ---- worker -> routers, on the worker's KV event feed (ZMQ PUB) ------------------------------
class KvEvents(Message):
    """Pages that entered or left a worker's radix cache since its previous ``KvEvents``.

    ``seq`` counts this process's feed messages (``KvEvents`` and ``KvSnapshot``) from 1 up, one
    per message: a subscriber that sees ``seq`` jump missed something and asks for a snapshot.
    ``instance`` is the worker process's (a new one starts a new sequence). ``kinds[i]`` is
    "stored", "removed" or "cleared"; ``counts[i]`` of frame 0's hashes (little-endian uint64,
    ``cache.page_hash`` chained page hashes, all events' concatenated) belong to event ``i``.
    ``pool``: the KV pool the pages are in ("full").
    """

    worker_id: str
    instance: str
    seq: int
    pool: str
    kinds: list[str]
    counts: list[int]
    n_frames: ClassVar[int] = 1

    def unpack(self, frame: bytes) -> list[tuple[str, list[int]]]:
        """``(kind, hashes)`` per event; ``ProtocolError`` if the frame does not match ``counts``."""
        hashes = frame_hashes(frame)
        if len(self.kinds) != len(self.counts) or sum(self.counts) != len(hashes) or min(self.counts, default=0) < 0:
            raise ProtocolError(
                f"KvEvents: counts {self.counts} do not match {len(self.kinds)} events and {len(hashes)} hashes"
            )
        out, pos = [], 0
        for kind, n in zip(self.kinds, self.counts):
            out.append((kind, hashes[pos : pos + n]))
            pos += n
        return out


class KvSnapshot(Message):
    """Every page hash a worker's radix cache holds (frame 0, little-endian uint64), as of feed
    message ``seq`` (this one): a subscriber replaces what it knew and applies ``KvEvents`` from
    ``seq + 1`` on. Published on the feed itself, so it arrives in order with the events."""

    worker_id: str
    instance: str
    seq: int
    pool: str
    n_frames: ClassVar[int] = 1


MESSAGES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (
        GenerateRequest,
        AbortRequest,
        StatsRequest,
        Shutdown,
        Drain,
        TokenBatch,
        WorkerStats,
        PrefillRequest,
        KVHandshake,
        KVHandshakeAck,
        KVDestination,
        PrefillFailed,
        PrefillWithdrawn,
        KVWriteStarted,
        KvSnapshotRequest,
        KvEvents,
        KvSnapshot,
        MigrationOffer,
        MigrationDeclined,
        MigrateRequest,
        MigrationEnded,
        QueuedOffer,
        QueuedMove,
        KVSources,
        SwitchRole,
        RoleSwitched,
        PrefilledLocally,
    )
}


def encode(msg: Message, *frames: bytes) -> list[bytes]:
    if len(frames) != msg.n_frames:
        raise ProtocolError(f"{type(msg).__name__} takes {msg.n_frames} raw frames, got {len(frames)}")
    return [type(msg).__name__.encode(), msg.model_dump_json().encode(), *frames]


def decode(parts: list[bytes]) -> tuple[Message, list[bytes]]:
    """Parse ``[kind, header, *frames]``; raises ``ProtocolError`` with a clear reason."""
    if len(parts) < 2:
        raise ProtocolError(f"expected [kind, header, ...] frames, got {len(parts)} frame(s)")
    kind = bytes(parts[0]).decode(errors="replace")
    cls = MESSAGES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}; known: {', '.join(MESSAGES)}")
    try:
        import json

        header = json.loads(bytes(parts[1]))
    except ValueError as e:
        raise ProtocolError(f"{kind}: header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("version") != PROTOCOL_VERSION:
        got = header.get("version") if isinstance(header, dict) else None
        raise ProtocolError(f"{kind}: protocol version {got!r} not supported (this side speaks {PROTOCOL_VERSION})")
    try:
        msg = cls.model_validate(header)
    except ValidationError as e:
        raise ProtocolError(f"{kind}: invalid header: {e}") from None
    frames = [bytes(f) for f in parts[2:]]
    if len(frames) != cls.n_frames:
        raise ProtocolError(f"{kind} takes {cls.n_frames} raw frames, got {len(frames)}")
    return msg, frames
