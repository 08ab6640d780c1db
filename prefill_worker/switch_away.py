"""A prefill worker changing role to decode (``server.worker.role_switch``) gives back the prompts it
has not written, so that its switch waits for the KV writes under way, not for its backlog.

``hand_back_unwritten``, every turn of the switch: each job of the router's own first prefill
(generation 0) whose KV write has not been posted (queued for its decode destination or for its
turn, or the prompt being computed, ``Admission.chunked``) ends here with a 503 marked
``handed_back``: the router gets it in the job's abort delta, the decode worker in
``PrefillFailed`` (its reserved pages, if any, are free at once: nothing was or will be written into
them), and whichever reaches the router first makes it send the request again to another pair
without using a retry (``server.router.session``: the switching worker is out of rotation); the
later one finds the old attempt closed. A destination that comes after the job left is refused the
same way (``prefill_worker.bootstrap.refusal``). The prompt being computed goes back too, its chunks
so far dropped: its re-send cannot come back here (the radix cache is evicted when the switch ends),
and finishing it would hold the switch for the rest of a long prompt (35 s of a 2,500-token prompt on
one core of a 2-core host: ``python -m benchmarks.switch_time``). What finishes here before the
switch: the writes under way (their KV is on its way to the decode worker) and recomputes of
retracted or failed-over requests (generation > 0: their decode worker owns them, and the router
could not send them again). Repeated each turn, it also takes a prompt the router sent before it
took this worker out of rotation.

Invariant: a job given back holds no page here afterwards (``finish`` frees them and drops it from
the admission state), and no write was posted for it.
"""

from __future__ import annotations

from engine.scheduler.base import Outcome
from transfer.wire.outbox import Outbox

#: Why a prompt a switching prefill worker gave back ended there (the request goes out again).
SWITCHING_AWAY = "its prefill worker is changing role before writing its KV: sent again to another pair"


def unwritten(job) -> bool:
    """Whether ``job`` is the router's first prefill and no write of its KV was posted."""
    return job.generation == 0 and not job.writing


def hand_back_unwritten(s) -> Outbox:
    """End every ``unwritten`` job of prefill scheduler ``s`` as handed back (module docstring); the
    messages to send."""
    out = Outbox()
    for job in [j for j in s.jobs.values() if unwritten(j)]:
        out.extend(s.finish(job, Outcome.abort(SWITCHING_AWAY, 503, handed_back=True), counted=False))
    return out
