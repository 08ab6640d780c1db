"""Control messages of moving a request between decode workers (decode <-> router): a retracted
request with its host KV (``decode_worker.migration``), or a queued one before its prefill
(``decode_worker.queued_moves``). Re-exported by ``transfer.wire.protocol``, which registers them."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from transfer.wire.message import Message
from transfer.wire.sampling_params import SamplingParams


class DraftRecord(BaseModel):
    """A moving request's speculative-decoding record (``engine.spec``), so that it drafts on the peer as
    it would have gone on drafting here: its decayed verify record (``hits``: draft tokens accepted,
    ``misses``: drafts whose run ended on a rejection) and its back-off (``wait``: steps left before it
    drafts again, ``backoff``: the wait after its next wholly rejected draft). Absent: the request had
    no record (it never drafted, or the source does not speculate) and starts at the prior."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hits: float = Field(ge=0, allow_inf_nan=False)
    misses: float = Field(ge=0, allow_inf_nan=False)
    wait: int = Field(ge=0)
    backoff: int = Field(ge=0)


class MigrationOffer(Message):
    """Source decode worker -> router: request ``rid`` is parked in my host pool and could not
    resume here within ``--migrate-after``; move it to a peer decode worker with room for
    ``pages`` full pages (its KV plus the ``new_token_ratio`` reservation) if there is one. Frame
    0: prompt + output so far (int32; the first ``prompt_len`` are the prompt), which the router
    forwards in the ``MigrateRequest`` with ``params`` and ``draft``."""

    rid: str
    n_tokens: int  # tokens whose KV is in the host copy (prompt + output so far, minus the next input)
    pages: int
    prompt_len: int
    params: SamplingParams
    draft: DraftRecord | None = None
    n_frames: ClassVar[int] = 1


class QueuedOffer(Message):
    """Decode worker -> router (``--migrate-queued``): request ``rid`` has waited here for pages,
    not prefilled yet, for ``--migrate-after``; if a peer decode worker has room for ``pages`` full
    pages (its prompt plus the ``new_token_ratio`` reservation), send it there instead. The worker
    admits nothing it offered until the answer: ``QueuedMove`` or ``MigrationDeclined``."""

    rid: str
    pages: int
    waited_s: float


class QueuedMove(Message):
    """Router -> decode worker: the offered request ``rid`` goes to decode worker ``target`` (the
    router sends it there, with its prefill worker, under a new request id); drop it here without a
    word to the client and withdraw its prefill (``PrefillWithdrawn``)."""

    rid: str
    target: str


class MigrationDeclined(Message):
    """Router -> source decode worker: no peer takes ``rid`` now; resume it locally (or offer
    it again after another ``--migrate-after``). Also the answer to a ``QueuedOffer`` nobody
    takes: the request waits for pages here."""

    rid: str
    reason: str


class MigrateRequest(Message):
    """Router -> target decode worker: admit ``rid`` (prompt + output so far in frame 0, the first
    ``prompt_len`` ids are the prompt) under ``room``; its KV of the first ``n_tokens`` ids comes
    from the decode worker at ``source_addr`` (which the target handshakes and sends a
    ``KVDestination`` exactly as to a prefill worker; generation ``generation`` > 0). ``draft``: its
    speculative-decoding record from the source, which the target's speculator takes over."""

    rid: str
    params: SamplingParams
    room: int
    generation: int = 1
    source_addr: str
    prompt_len: int
    n_tokens: int
    draft: DraftRecord | None = None
    n_frames: ClassVar[int] = 1


class MigrationEnded(Message):
    """Source decode worker -> router: the migration of ``rid`` ended. ``ok``: the target has the
    KV and streams from now on (the source forgot the request); else ``error`` says why and the
    source keeps the request (its token stream is the source's again)."""

    rid: str
    ok: bool
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
