"""A decode worker takes back a prompt it asked this prefill worker for (``PrefillWithdrawn``).

- **No destination yet** (selective disaggregation: it prefills the request itself; or a
  switching decode worker hands a queued request back to the router): the job holds no decode
  pages and leaves without a word to anyone; a ``PrefillRequest`` that has not come yet is
  dropped on arrival (``BootstrapTable.gone``).
- **Destination reserved, prefill not started** (still in ``waiting``: a decode worker that
  switches role does not wait for a backlog to reach its pages): the job leaves and the decode
  worker gets ``PrefillFailed`` (503): nothing was or will be written into those pages, so only now
  may it free them. The router hears nothing from here (the decode worker's 503 sends the request
  to another pair).
- **Prefill or write under way**: ignored; the KV lands as usual (the decode worker waits for it).
"""

from __future__ import annotations

import logging

from prefill_worker.bootstrap import WITHDRAWN
from transfer.wire.enums import FinishReason
from transfer.wire.outbox import Outbox
from transfer.wire.protocol import PrefillFailed, PrefillWithdrawn

log = logging.getLogger(__name__)

#: ``PrefillFailed.error`` of a released destination (its request is sent again elsewhere).
RELEASED = "withdrawn by its decode worker before its prefill started"


def withdraw(s, msg: PrefillWithdrawn) -> Outbox:
    """Apply ``msg`` to prefill scheduler ``s`` (module docstring); the answer to its decode worker."""
    key = (msg.room, msg.generation)
    job = s.jobs.get(key)
    out = Outbox()
    if job is not None and job.dest is not None:
        if job.writing or job.req not in s.waiting:
            log.info("%s room %d withdrawn after its prefill started: its KV lands as usual", msg.rid, msg.room)
            return out
        out.send(
            job.dest_conn,
            PrefillFailed(rid=msg.rid, room=msg.room, generation=msg.generation, error=RELEASED, error_status=503),
        )
    s.bootstrap.ended(key, WITHDRAWN)
    if job is not None:
        for queue in (s.bootstrapping, s.waiting):
            if job.req in queue:
                queue.remove(job.req)
        del s.jobs[key]
        s.by_req.pop(id(job.req), None)
        s.kv.free(job.req.kv)
        job.req.finish(FinishReason.ABORT)
        s.withdrawn += 1
    return out
