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
- ``stop``: the switch was abandoned (timed out): the old policy is back and parked jobs resume
  here as after any retract.
The worker is empty (``held_rids``) once every migration write ended: only then may its pools be
re-laid.
"""

from __future__ import annotations

import logging

from decode_worker.migration import MigrationPolicy

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
