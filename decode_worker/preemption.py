"""Preemption on a decode worker for requests of API keys under their share (``GenerateRequest.preempt``).

Such a job stands first in the prealloc queue (``TransferTracker.queue``). When the batch
(``max_running_requests``) has no place for it, ``preempt_for_waiting`` retracts the newest running
request without the mark, like a memory-pressure victim (``RetractManager.retract``: offloaded to
the host pool, or recomputed without room there); the victim resumes when a place frees
(``RetractManager.resume_ready`` takes at most ``places_left``). Only a place is made, never pages:
the jobs counted are those whose pages (prompt plus decode reserve, no cached prefix assumed) fit
the headroom already, so a job short of pages waits like any other and nobody is retracted for it
again and again.
"""

from __future__ import annotations

import logging

from engine.request import Request

log = logging.getLogger(__name__)


def admitted(running, transfers, local) -> list[Request]:
    """Every request of a decode worker whose pages are reserved: ``running``, with KV in flight
    (``transfers``), being prefilled there (``local``'s chunked one)."""
    chunked = local.chunked
    return [*running, *(j.req for j in transfers.inflight.values()), *([chunked] if chunked else [])]


def places_left(sched) -> int:
    """Places left in ``sched``'s batch: ``max_running_requests`` less every admitted request."""
    return sched.cfg.scheduler.max_running_requests - len(admitted(sched.running, sched.transfers, sched.local))


def preempt_for_waiting(sched) -> None:
    """Retract ``sched``'s newest running requests without ``preempt``, one per preempting job whose
    prefill worker is ready, whose pages fit, and that finds no place in the batch (module docstring)."""
    prealloc = sched.transfers.prealloc
    if not prealloc or not prealloc[0].preempt:  # they stand first: none waits (every step without preemption)
        return
    ratio, budget = sched.running.ratio.value, sched.budget
    room = budget.headroom(admitted(sched.running, sched.transfers, sched.local), ratio)
    waiting = 0
    for job in prealloc:
        if not job.preempt:
            break
        if not ((p := sched.peers.get(job.prefill_addr)) and p.ready):
            continue
        need = budget.prompt_growth(0, job.n_tokens + budget.reserved_tokens(job.req, ratio))
        if not room.covers(need):
            break
        room, waiting = room - need, waiting + 1
    short = waiting - places_left(sched)
    if short <= 0:
        return
    for req in [r for r in reversed(sched.running.reqs) if not sched.jobs[r.rid].preempt][:short]:
        sched.running.discard(req)
        how = sched.retract.retract(sched.jobs[req.rid])
        sched.stats.preemptions += 1
        log.info("preempt %s (%s): a request of an API key under its share takes its place", req.rid, how)
