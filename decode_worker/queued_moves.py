"""Requests that wait for pages move before their prefill (``--migrate-queued``).

A retracted request moves with its KV (``decode_worker.migration``); a request still in the
prealloc queue has no KV anywhere yet (its prefill worker waits for this worker's destination), so
moving it is a re-route: this worker offers it to the router (``QueuedOffer``), the router picks a
peer decode worker with room and sends the request there with its prefill worker under a new
request id, and tells this worker (``QueuedMove``), which drops it without a word to the client and
withdraws its prefill (``PrefillWithdrawn``). No peer: ``MigrationDeclined``, and it waits here.

Which requests: QUEUED (pages not reserved, so no ``KVDestination`` went out), the router's first
prefill (generation 0, not migrated in), nothing decoded yet, and waiting here for
``--migrate-after`` (steps or seconds, as parked requests). While an offer is out the request is
*held*: admission skips it (``TransferTracker.admit``), so it can never be both admitted here and
sent elsewhere. An offer not answered within ``migrate_timeout_s`` is dropped, and the request
waits another ``--migrate-after`` before its next offer, as after a decline.

Under a steady skewed load this is what spreads the load: retracted requests are few (admission
keeps them rare), the overload waits in the prealloc queue.
"""

from __future__ import annotations

import logging
import time

from decode_worker.jobs import DecodeJob, DecodeState
from decode_worker.migration import MigrationPolicy
from engine.scheduler.base import Outcome
from transfer.wire.outbox import Conn, Outbox, Peer
from transfer.wire.protocol import Message, MigrationDeclined, PrefillWithdrawn, QueuedMove, QueuedOffer

log = logging.getLogger(__name__)

#: How a moved job ends here: the client hears nothing (its stream continues from the peer).
QUEUED_MOVED = Outcome.abort("moved to a peer decode worker before its prefill", 0)


def movable(job: DecodeJob) -> bool:
    """Whether ``job`` could move by a re-route: queued, the router's first prefill, nothing decoded."""
    return (
        job.state is DecodeState.QUEUED
        and job.generation == 0
        and not job.migrated
        and not job.answered
        and not job.req.output_ids
    )


class QueuedMoves:
    """Offers of queued requests and their answers, for one decode worker (module docstring)."""

    def __init__(self, policy: MigrationPolicy, timeout_s: float) -> None:
        self.policy, self.timeout_s = policy, timeout_s
        self.offered: dict[str, float] = {}  # rid -> monotonic time of the offer: held, not admitted
        self._since: dict[str, tuple[int, float]] = {}  # rid -> (step, time) its current wait began
        self.step_count = 0

    def offer(self, prealloc, pages_of) -> Outbox:
        """Offer every due movable job of ``prealloc`` to its router; ``pages_of(job)``: the full
        pages it needs with the ``new_token_ratio`` reservation. Drops unanswered offers first."""
        self.step_count += 1
        out, now = Outbox(), time.monotonic()
        for rid, at in list(self.offered.items()):
            if now - at > self.timeout_s:
                self.declined(rid, now)
        for job in prealloc:
            rid = job.req.rid
            if rid in self.offered or not movable(job):
                continue
            step, since = self._since.setdefault(rid, (self.step_count, now))
            if not self.policy.waited(step, since, self.step_count, now):
                continue
            self.offered[rid] = now
            log.info("offering queued %s (waited %.2fs for pages) to a peer decode worker", rid, now - since)
            out.send(Conn(job.req.owner), QueuedOffer(rid=rid, pages=pages_of(job), waited_s=now - since))
        return out

    def declined(self, rid: str, now: float | None = None) -> None:
        """No peer took ``rid`` (or no answer came): it waits here another ``--migrate-after``."""
        if self.offered.pop(rid, None) is not None:
            self._since[rid] = (self.step_count, time.monotonic() if now is None else now)

    def move(self, job: DecodeJob | None, rid: str) -> tuple[Outbox, bool]:
        """The router sent ``rid`` elsewhere: ``(PrefillWithdrawn to its prefill worker, True)`` if
        it was offered and still movable (the caller then finishes it with ``QUEUED_MOVED``), else
        ``(nothing, False)``."""
        if self.offered.pop(rid, None) is None or job is None or not movable(job):
            return Outbox(), False
        log.info("queued %s moved to a peer decode worker before its prefill", rid)
        out = Outbox()
        out.send(Peer(job.prefill_addr), PrefillWithdrawn(rid=rid, room=job.room))
        return out, True

    def forget(self, rid: str) -> None:
        """``rid`` ended here (or was admitted): drop what is kept for it."""
        self.offered.pop(rid, None)
        self._since.pop(rid, None)


# ---- the decode scheduler's turns (``s`` is the ``DecodeScheduler``, ``s.queued`` set) --------------
def queued_step(s) -> Outbox:
    """Once per step: offer the due queued jobs, each needing its prompt's full pages plus the
    ``new_token_ratio`` reservation on a peer."""
    ratio = s.running.ratio.value

    def pages_of(job: DecodeJob) -> int:
        return s.budget.full_pages_to_admit(job.req, ratio, job.n_tokens)

    return s.queued.offer(s.transfers.prealloc, pages_of)


def queued_answer(s, msg: Message) -> Outbox | None:
    """The router's answer to a ``QueuedOffer``; None if ``msg`` is not one (or queued moves are
    off). A ``QueuedMove`` drops the request whatever its state now: the router already sent it
    elsewhere."""
    if s.queued is None:
        return None
    if isinstance(msg, MigrationDeclined) and msg.rid in s.queued.offered:
        s.queued.declined(msg.rid)
        return Outbox()
    if not isinstance(msg, QueuedMove):
        return None
    job = s.jobs.get(msg.rid)
    out, withdrawn = s.queued.move(job, msg.rid)
    if job is not None and not job.answered:
        if not withdrawn:
            log.warning("queued %s moved to %s after it left the queue here: dropped", msg.rid, msg.target)
        job.answered = QUEUED_MOVED  # answered first: the client hears nothing from here
        out.extend(s.finish(job, QUEUED_MOVED))
    return out
