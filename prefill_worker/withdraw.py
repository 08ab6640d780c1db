"""A decode worker takes back a prompt it asked this prefill worker for (``PrefillWithdrawn``).

- **No destination yet** (selective disaggregation: it prefills the request itself; or a
  switching decode worker hands a queued request back to the router): the job holds no decode
  pages and leaves without a word to anyone; a ``PrefillRequest`` that has not come yet is
  dropped on arrival (``BootstrapTable.gone``). A destination parked before its prompt came
  (``prefill_worker.bootstrap``) is answered ``PrefillFailed`` (``RELEASED``) at once.
- **Destination reserved** (a decode worker changing role does not wait for this worker's backlog
  to reach its pages): from the withdrawal on nothing more is written into those pages, and the
  decode worker gets ``PrefillFailed`` (503, ``RELEASED``) once nothing is being written into
  them: only then may it free them. The router hears nothing from here (the decode worker's 503,
  ``handed_back``, sends the request again). By how far the prompt got:

  - *not started* (in ``waiting``): the job leaves, its pages here are freed, answered at once;
  - *computing* (the chunked prompt: a prompt's KV is written once, after its last chunk, so
    nothing was written yet): answered at once; the prompt is computed to its end and its KV goes
    to the radix cache, with no write (``end_released``); no new prompt joins the batch of its last
    chunk (``admissible``), so that a re-send queued behind it is admitted with the KV cached;
  - *writing* (the write was posted): answered when that write ended (``settle``); the KV goes to
    the radix cache as after any write.

  Why a prompt under way is computed to its end rather than stopped between chunks: the router
  sends the request again at once (``TokenDelta.handed_back``), and with one prefill worker, or
  cache-aware routing, to this one, where it waits for its turn behind the prompts already queued.
  Computed now, at its place in line, its KV is in the radix cache by then and the retry's prefill
  is one token; stopped, the chunks computed so far would be thrown away (or cached, and the rest
  computed only when the retry's turn comes: the same work, done later). Either way the decode
  worker is answered at once, so its switch waits for neither.

The decode worker also ends such a request when its KV lands before this answer (the write was
under way): it frees the pages then (nothing more is written after a landing) and ignores the
answer that follows (``decode_worker.evacuate``). Every page, the write's lock and the job leave
this worker as after a completed prefill: ``free + used + cached == total`` holds throughout.
"""

from __future__ import annotations

import logging
from collections import deque

from engine.scheduler.base import Outcome
from prefill_worker.bootstrap import WITHDRAWN
from transfer.wire.enums import FinishReason
from transfer.wire.outbox import Outbox
from transfer.wire.protocol import PrefillFailed, PrefillWithdrawn

log = logging.getLogger(__name__)

#: ``PrefillFailed.error`` of a released destination (its request is sent again elsewhere).
RELEASED = "released by its decode worker, which is changing role: sent again to another pair"


def withdraw(s, msg: PrefillWithdrawn) -> Outbox:
    """Apply ``msg`` to prefill scheduler ``s`` (module docstring); the answer to its decode worker."""
    key = (msg.room, msg.generation)
    job = s.jobs.get(key)
    if job is None:
        return _not_here(s, key)
    if job.dest is None or job.req in s.waiting:
        return _leave(s, job)
    if job.released:
        return Outbox()  # asked again: answered (or to be) already
    job.released = True
    if job.writing:
        log.info("%s room %d withdrawn while its KV is written: answered once the write ended", msg.rid, msg.room)
        return Outbox()
    assert s.admission.chunked is job.req, "a started prompt that is not written is the chunked one"
    log.info("%s room %d withdrawn while computed: answered now, computed into the radix cache", msg.rid, msg.room)
    return answer(job)


def _not_here(s, key) -> Outbox:
    """A withdrawal of a room this worker holds no job for: a late ``PrefillRequest`` is dropped; a
    destination parked for it (it came before its prompt) is released now, not at its grace."""
    s.bootstrap.ended(key, WITHDRAWN)
    early = s.bootstrap.claim(key)
    out = Outbox()
    if early is not None:
        m = early.msg
        out.send(early.source, _released(m.rid, m.room, m.generation))
    return out


def _leave(s, job) -> Outbox:
    """A job whose prefill has not started leaves (its pages here freed); its decode worker is
    answered when it reserved a destination."""
    out = answer(job) if job.dest is not None else Outbox()
    s.bootstrap.ended(job.key, WITHDRAWN)
    for queue in (s.bootstrapping, s.waiting):
        if job.req in queue:
            queue.remove(job.req)
    del s.jobs[job.key]
    s.by_req.pop(id(job.req), None)
    s.kv.free(job.req.kv)
    job.req.finish(FinishReason.ABORT)
    s.withdrawn += 1
    return out


def answer(job) -> Outbox:
    """``PrefillFailed`` (``RELEASED``, 503) to ``job``'s decode worker: nothing is or will be
    written into its pages."""
    out = Outbox()
    if job.dest_conn is not None:
        out.send(job.dest_conn, _released(job.req.rid, job.room, job.generation))
    return out


def _released(rid: str, room: int, generation: int) -> PrefillFailed:
    return PrefillFailed(rid=rid, room=room, generation=generation, error=RELEASED, error_status=503)


def end_released(s, job, write_ended: bool) -> Outbox:
    """A released job's prompt is computed (``write_ended`` False: no write is posted) or its
    write ended (True: its decode worker is answered now): it ends, its KV into the radix cache."""
    out = answer(job) if write_ended else Outbox()
    s.withdrawn += 1
    return out.extend(s.finish(job, Outcome(FinishReason.LENGTH), counted=False))


def admissible(s) -> deque:
    """The queue prefill scheduler ``s`` admits new prompts from this step: none while a released
    prompt is the chunked one (its last chunk may leave room in the batch, and its re-send, queued
    behind it, is to find its KV in the radix cache)."""
    chunked = s.admission.chunked
    if chunked is not None and (job := s.by_req.get(id(chunked))) is not None and job.released:
        return deque()
    return s.waiting
