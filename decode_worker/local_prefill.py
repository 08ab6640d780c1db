"""Selective disaggregation: whether a decode worker prefills a new request itself.

``--local-prefill-max-tokens N`` (default 0 = off). A PD request whose uncached suffix (its
prompt minus the longest prefix this decode worker's radix cache holds) is at most ``N`` tokens is computed by
the decode worker, in chunks within its own steps, instead of by a prefill worker: short prompts
and follow-up turns stop paying the handoff (prefill queue, KV write, completion notification)
when the decode worker has the room. The inputs and their order (the first that refuses names the
reason, ``LocalPrefillReason``, counted in ``pdserve_local_prefill_total{reason}``):

1. **retract pressure**: a decode worker with a non-empty retracted queue, or that retracted in
   its last ``RETRACT_COOLDOWN_STEPS`` decode steps, sends everything to prefill (its pages are
   spoken for; a local prefill would take what a resume needs).
2. **size**: the uncached suffix must be at most ``max_tokens``; this also bounds the decode
   batch's stall: each step's prefill chunk is at most ``chunked_prefill_size`` (and
   ``max_num_batched_tokens`` minus the decode rows with mixed batches).
   With ``--local-prefill-backlog-ratio R`` > 0 (default 1) a longer request is still taken
   (``TAKEN_BACKLOG``) when the prefill workers are the queue: the uncached prompt tokens this
   decode worker waits for from them (``remote_backlog_tokens``: its prealloc queue and the
   reserved transfers whose write has not started) are at least ``R`` times its own local backlog
   plus this request's suffix once per decode row it would stall:
   ``remote >= R * (backlog + suffix * (1 + rows))``. Without the rows term this says the local
   queue would finish first even if it prefills ``R`` times slower than a prefill worker (it
   decodes too); with it, the request's gain (its wait on the prefill workers) must also cover
   what its chunks add to each of the ``rows`` running requests' next tokens. So a decode worker
   with an idle or small batch takes long prompts off a prefill worker that is the queue (a
   summarization load on 2 cores: the prefill worker was the bottleneck while the decode worker
   had most of a core to spare), and one decoding a full batch of short-prompt requests (a chat
   closed loop, where the prefill queue is a few short prompts) leaves them to the prefill worker
   and keeps its inter-token latency.
3. **busy**: the tokens already waiting for a local prefill plus this suffix must stay within
   ``max_tokens``, so a burst is split: the decode worker takes its share, the rest goes to
   the prefill worker at once instead of queueing behind the decode worker's own prefills.
4. **KV headroom**: nothing may wait in the prealloc queue (FCFS: a local request must not
   overtake a remote one that waits for pages) and the suffix's pages plus the request's
   ``max_new_tokens * new_token_ratio`` reservation must fit the headroom admission sees now
   (obtainable pages minus the running and in-flight requests' reservations).

**Where it is decided: on the decode worker, when the ``GenerateRequest`` arrives.** Only the
decode worker knows its radix prefix, headroom and retracts now (the router sees them one
heartbeat late), and the router sends every PD request to both workers either way: the
decision costs one new message, ``PrefillWithdrawn`` (decode -> prefill), and no new race. The
prefill worker never prefills a request before its decode worker's ``KVDestination`` (bootstrap
rule), and a locally prefilled request never sends one, so the withdrawn job holds no pages and
has computed nothing; a withdrawal that overtakes the router's ``PrefillRequest`` is remembered
and that request dropped on arrival. The router tracks the request as any other: the decode worker
streams its tokens, and the prefill worker never answers for it. A retract of a locally
prefilled request goes the usual way (host offload and resume, or a recompute by the prefill
worker as generation 1).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

RETRACT_COOLDOWN_STEPS = 64  # decode steps after a retract during which nothing is prefilled locally


class LocalPrefillReason(enum.StrEnum):
    """Outcome of one decision: taken, or why the request went to a prefill worker."""

    TAKEN = "taken"
    TAKEN_BACKLOG = "taken_backlog"  # above the size bound, taken because the prefill workers are the queue
    RETRACT_PRESSURE = "retract_pressure"  # retracted queue not empty, or a retract within the cooldown
    TOO_LONG = "too_long"  # uncached suffix above --local-prefill-max-tokens
    BUSY = "busy"  # local prefill backlog + this suffix above the bound
    NO_HEADROOM = "no_headroom"  # prealloc queue not empty, or pages + reservation do not fit


@dataclass(frozen=True)
class LocalPrefillInputs:
    """What the decode worker knows about a new request and itself when it arrives.

    ``cached_tokens``: its radix prefix hit; ``backlog_tokens``: uncached tokens already waiting
    for (or in) a local prefill; ``steps_since_retract``: decode steps since the last retract
    (None: never); ``need_pages``/``headroom_pages``: full-pool pages the suffix plus its decode
    reservation takes, and what admission may hand out now; ``remote_backlog_tokens``: uncached
    prompt tokens of this worker's requests whose prefill workers have not started their write;
    ``decode_rows``: requests in its running decode batch (each one a local chunk would stall)."""

    prompt_tokens: int
    cached_tokens: int
    backlog_tokens: int
    retracted_queue: int
    steps_since_retract: int | None
    prealloc_queue: int
    need_pages: int
    headroom_pages: int
    remote_backlog_tokens: int = 0
    decode_rows: int = 0

    @property
    def suffix_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class LocalPrefillDecision:
    """``local``: prefill on the decode worker; ``reason``: why (``TAKEN`` iff ``local``)."""

    reason: LocalPrefillReason
    suffix_tokens: int

    @property
    def local(self) -> bool:
        return self.reason in (LocalPrefillReason.TAKEN, LocalPrefillReason.TAKEN_BACKLOG)


@dataclass(frozen=True)
class LocalPrefillPolicy:
    """The cost model of the module docstring; ``max_tokens`` and ``backlog_ratio`` both 0 turn
    it off (``enabled``)."""

    max_tokens: int
    retract_cooldown_steps: int = RETRACT_COOLDOWN_STEPS
    backlog_ratio: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0 or self.backlog_ratio > 0

    def decide(self, x: LocalPrefillInputs) -> LocalPrefillDecision:
        """The decision for one request (the inputs are checked in the module docstring's order)."""
        return LocalPrefillDecision(self._reason(x), x.suffix_tokens)

    def _reason(self, x: LocalPrefillInputs) -> LocalPrefillReason:
        recent = x.steps_since_retract is not None and x.steps_since_retract < self.retract_cooldown_steps
        if x.retracted_queue or recent:
            return LocalPrefillReason.RETRACT_PRESSURE
        if x.suffix_tokens > self.max_tokens:
            if not self._remote_is_the_queue(x):
                return LocalPrefillReason.TOO_LONG
            taken = LocalPrefillReason.TAKEN_BACKLOG
        elif x.backlog_tokens + x.suffix_tokens > self.max_tokens:
            return LocalPrefillReason.BUSY
        else:
            taken = LocalPrefillReason.TAKEN
        if x.prealloc_queue or x.need_pages > x.headroom_pages:
            return LocalPrefillReason.NO_HEADROOM
        return taken

    def _remote_is_the_queue(self, x: LocalPrefillInputs) -> bool:
        """The prefill workers' backlog is at least ``backlog_ratio`` times the local one with ``x``,
        its suffix counted once more per decode row it would stall."""
        local = x.backlog_tokens + x.suffix_tokens * (1 + x.decode_rows)
        return self.backlog_ratio > 0 and x.remote_backlog_tokens >= self.backlog_ratio * local
