"""A decode worker's evacuation before it changes role (``server.worker.role_switch``): every
request it holds leaves for a peer decode worker over the migration path
(``decode_worker.migration``), none is dropped.

- ``start``: from then on the scheduler resumes nothing locally (``DecodeScheduler.evacuating``)
  and every host-parked job is due for an offer at once (the migration policy becomes "after 0
  steps"). Needs the migration source (``--migrate-after`` and a host pool): without it the
  switch is refused, nothing changed.
- ``evacuate``, before each scheduler step: every running request leaves the batch for the host
  pool (an offload; a recompute when the host pool has no room, and the request lands here again
  later), so that step's ``migration_step`` offers it. Requests still waiting for pages or KV
  are admitted and land as usual and leave on a later turn; a declined offer parks the job again
  and it is offered again next step.
- ``release_unprefilled``, in each step: requests that sent no token yet and whose KV has not
  landed do not hold the switch up behind a prefill backlog, however far their prefill got. Each
  ends here with a 503 marked ``handed_back``, which makes the router send it again to another
  pair without using a retry (``server.router.session``). A queued one (no pages, no
  ``KVDestination`` sent) withdraws its prefill (``PrefillWithdrawn``) and ends at once, and so
  does one this worker was to prefill itself (``LOCAL_PREFILL``, selective disaggregation: nothing
  but its own compute writes its pages, and none runs between steps). One with
  reserved pages asks its prefill worker back (``PrefillWithdrawn`` with its generation) and keeps
  its pages until nothing can be written into them any more: the prefill worker's answer
  (``PrefillFailed``, ``RELEASED``), which comes at once when the prompt is still queued or being
  computed (nothing is written into the pages from then on) and once the write ended when it was
  under way (``prefill_worker.withdraw``); or the KV's landing, if that comes first (the write
  ended: ``landed``). Only then are its pages freed. Recomputes and migrated-in requests (tokens
  streamed already) wait for their KV as before.
- ``stop``: the switch was abandoned (timed out): the old policy is back and parked jobs resume
  here as after any retract.
The worker is empty (``held_rids``) once every migration write ended: only then may its pools be
re-laid.
"""

from __future__ import annotations

import logging

from decode_worker.jobs import DecodeJob, DecodeState
from decode_worker.migration import MigrationPolicy
from engine.scheduler.base import Outcome
from transfer.wire.outbox import Outbox, Peer
from transfer.wire.protocol import PrefillWithdrawn

log = logging.getLogger(__name__)

_DUE_AT_ONCE = MigrationPolicy(steps=0)


def start(s) -> str | None:
    """Begin evacuating decode scheduler ``s``; None, or why it cannot (nothing changed then)."""
    if s.migration is None:
        return (
            f"decode worker {s.worker_id} has no migration path to move its requests over "
            "(start it with --migrate-after and --host-kv-pool-gb > 0)"
        )
    s.evacuating, s.evacuation_policy = True, s.migration.policy
    s.migration.policy = _DUE_AT_ONCE
    return None


def stop(s) -> None:
    """Abandon the evacuation: serve as before (parked jobs resume here)."""
    if s.evacuating:
        s.evacuating, s.migration.policy = False, s.evacuation_policy


def evacuate(s) -> int:
    """Take every running request of ``s`` out of its batch into the host pool (or to a recompute
    when the host pool cannot hold it); returns how many left the batch."""
    moved = 0
    for req in list(s.running.reqs):
        job = s.jobs[req.rid]
        s.running.discard(req)
        if s.retract.can_offload(req):
            s.retract.offload(job)
        else:
            log.warning("host pool full: %s is recomputed before it can move", req.rid)
            s.retract.recompute(job)
        moved += 1
    return moved


#: How a queued request leaves a switching decode worker: a 503 before any token, so the router
#: sends it again to another pair.
SWITCHING_AWAY = "its decode worker is changing role before its prefill: sent again to another pair"


def handed_back(error: str) -> Outcome:
    """How a request a switching decode worker gives back ends here: a 503 the router answers by
    sending it again to another pair, without using a retry (``TokenDelta.handed_back``)."""
    return Outcome.abort(error, 503, handed_back=True)


def unprefilled(job: DecodeJob) -> bool:
    """Whether ``job`` may go elsewhere by a re-send: the router's first prefill, nothing streamed
    (its KV has not landed), not answered and not withdrawn already."""
    return (
        job.generation == 0 and not job.migrated and not job.answered and not job.withdrawn and not job.req.output_ids
    )


def release_unprefilled(s) -> Outbox:
    """Withdraw the prefills of ``s``'s unprefilled requests (module docstring): the queued ones and
    those to prefill here end now (503, handed back), the reserved ones when nothing can be written
    into their pages any more (``released``)."""
    out = Outbox()
    held = s.queued.offered if s.queued is not None else {}
    for job in list(s.transfers.prealloc):
        if job.state is DecodeState.QUEUED and unprefilled(job) and job.req.rid not in held:
            job.withdrawn = True
            out.send(Peer(job.prefill_addr), PrefillWithdrawn(rid=job.req.rid, room=job.room))
            out.extend(s.finish(job, handed_back(SWITCHING_AWAY)))
    for job in [j for j in s.jobs.values() if j.state is DecodeState.LOCAL_PREFILL and unprefilled(j)]:
        out.extend(s.finish(job, handed_back(SWITCHING_AWAY)))
    for job in list(s.transfers.inflight.values()):
        if unprefilled(job):
            job.withdrawn = True
            out.send(
                Peer(job.prefill_addr), PrefillWithdrawn(rid=job.req.rid, room=job.room, generation=job.generation)
            )
    return out


def released(s, job: DecodeJob, why: str) -> Outbox:
    """``job``, withdrawn, can be written no more (its prefill worker answered ``why``, or its KV
    landed): it leaves, handed back to the router; its pages are freed."""
    return s.finish(job, handed_back(why))
