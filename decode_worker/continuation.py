"""A continuation on a PD decode worker: a request whose stream failed over from a dead worker
(``GenerateRequest.resume_output_ids``), prefilled here or recomputed by its prefill worker."""

from __future__ import annotations

from decode_worker.jobs import DecodeJob, DecodeState
from decode_worker.preemption import admitted
from engine.request import Request
from engine.scheduler.base import sampler_state
from transfer.wire.outbox import Conn, Outbox
from transfer.wire.protocol import GenerateRequest, PrefilledLocally


def add_continuation(s, owner: bytes, msg: GenerateRequest, prompt: list[int]) -> Outbox:
    """A continuation (``GenerateRequest.resume_output_ids``; the router sends no ``PrefillRequest``)
    is prefilled here when the local prefill queue takes it (``LocalPrefillQueue.take_continuation``:
    prompt + output so far, its first sampled token the next output token, as a colocated worker
    does), and the router hears so (``PrefilledLocally``: its prefill worker is out of it); else it
    enters as a recompute does: this worker ``s`` (the ``DecodeScheduler``) asks the
    prefill worker for prompt + output so far but the last token (generation 1), and decoding
    resumes from that last token."""
    resumed = list(msg.resume_output_ids)
    state = sampler_state(s.runner, msg.params, prompt, resumed)
    req = Request(msg.rid, list(prompt), msg.params, state, owner=owner, output_ids=resumed, continuation=True)
    s.stats.prompt_tokens += len(prompt)
    out = s.peers.connect(msg.prefill_addr)  # a retract of it later recomputes there
    if s.local.take_continuation(
        req,
        lambda: admitted(s.running, s.transfers, s.local),
        s.running.ratio.value,
        len(s.retract.queue),
        s.transfers.backlog_tokens(),
    ):
        job = DecodeJob(req, msg.room, msg.prefill_addr, generation=1, n_tokens=req.seq_len, preempt=msg.preempt)
        s.jobs[msg.rid] = job
        job.enter(DecodeState.LOCAL_PREFILL)
        out.send(Conn(owner), PrefilledLocally(rid=msg.rid))
        return out
    job = DecodeJob(
        req,
        msg.room,
        msg.prefill_addr,
        generation=1,
        n_tokens=req.seq_len - 1,
        state=DecodeState.RECOMPUTING,
        preempt=msg.preempt,
    )
    s.jobs[msg.rid] = job
    s.transfers.queue_recompute(job)
    return out
