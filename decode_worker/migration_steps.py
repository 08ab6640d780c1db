"""The decode scheduler's migration turns, on both sides (``decode_worker.migration`` has the
protocol): the messages a source or target decode worker handles, and the source's per-step work.

Each function takes the ``DecodeScheduler`` ``s`` and returns what to send; none keeps state of
its own (the source's is ``s.migration``, the target's is an ordinary ``DecodeJob`` with
``migrated`` set, admitted through the normal prealloc queue, first in line).
"""

from __future__ import annotations

import logging

import numpy as np

from decode_worker.jobs import DecodeJob, DecodeState
from engine.request import Request
from engine.scheduler.base import Outcome
from transfer.wire.outbox import Conn, Outbox
from transfer.wire.protocol import (
    KVDestination,
    KVHandshake,
    KVHandshakeAck,
    Message,
    MigrateRequest,
    MigrationDeclined,
    MigrationEnded,
    frame_ids,
)

log = logging.getLogger(__name__)

MOVED = Outcome.abort("moved to a peer decode worker", 0)  # a moved job's end: the client hears nothing here


def handle_migration(s, source: Conn, msg: Message, frames: list[bytes]) -> Outbox | None:
    """A migration message on the control socket (router or peer decode worker); None if ``msg``
    is not one (or this worker takes no part in migrations)."""
    if isinstance(msg, MigrateRequest):
        return admit_migrated(s, source.ident, msg, frame_ids(frames[0]))
    m = s.migration
    if m is None and isinstance(msg, KVHandshake):  # a peer connecting ahead (``KVSources``) to one that never offers
        out = Outbox()
        out.send(
            source,
            KVHandshakeAck(
                ok=False,
                worker_id=s.worker_id,
                error=(f"decode worker {s.worker_id} migrates no requests (no --migrate-after): it is no KV source"),
            ),
        )
        return out
    if m is None:
        return None
    if isinstance(msg, KVHandshake):
        error = m.sender.accept_peer(
            source, msg, s.model_name, s.runner.kv_descriptor(), s.cfg.cluster.cluster_id or "", s.worker_id
        )
        out = Outbox()
        out.send(source, KVHandshakeAck(ok=error is None, worker_id=s.worker_id, error=error))
        return out
    if isinstance(msg, KVDestination):
        peer_id = next((wid for wid, p in m.sender.peers.items() if p.conn == source), None)
        pages = np.frombuffer(frames[0], dtype="<i4").copy()
        swa = np.frombuffer(frames[1], dtype="<i4").copy()
        try:
            return m.destination(source, msg, pages, swa, peer_id or "")
        except Exception as e:  # noqa: BLE001 - a write that cannot start fails this migration only
            log.error("migration write of %s could not start: %s", msg.rid, e)
            return _back(s, msg.rid, f"the write could not start: {e}", tell_router=True)
    if isinstance(msg, MigrationDeclined):
        m.stats.out_declined += 1
        return _back(s, msg.rid, msg.reason, tell_router=False)
    return None


def admit_migrated(s, owner: bytes, msg: MigrateRequest, ids: list[int]) -> Outbox:
    """Target side: take ``msg``'s request (prompt + output so far in ``ids``) as a QUEUED job first
    in the prealloc queue, its KV to come from ``msg.source_addr``; refuse (``MigrationEnded``, not
    ok, to the router) when it is already here, the ids do not match, or the pages plus the
    ``new_token_ratio`` reservation do not fit now beside what runs, waits or is retracted."""
    out = Outbox()
    ratio = s.running.ratio.value
    vocab = s.runner.model_config.vocab_size
    why = None
    if msg.rid in s.jobs:
        why = f"request {msg.rid!r} is already on this decode worker"
    elif not 0 < msg.prompt_len <= msg.n_tokens == len(ids) - 1 or max(ids) >= vocab or min(ids) < 0:
        why = f"ids do not match: prompt_len {msg.prompt_len}, n_tokens {msg.n_tokens}, {len(ids)} ids"
    elif s.retract.queue or any(not j.migrated for j in s.transfers.prealloc):
        why = "this decode worker has requests waiting for pages itself"
    if why is None:
        prompt = list(ids[: msg.prompt_len])
        # the runner's state: with a structured-output request's grammar matcher, which then consumes
        # the output so far (a bare SamplerState would drop the constraint for the rest of the stream)
        req = Request(msg.rid, prompt, msg.params, s.runner.sampler_state(msg.params, prompt), owner=owner)
        for t in ids[msg.prompt_len :]:
            req.output_ids.append(t)
            req.sampler_state.append(t)
        if s.spec is not None and msg.draft is not None:  # it drafts on as on its source
            s.spec.adopt(req, msg.draft)
        in_flight = [*s.running, *(j.req for j in s.transfers.inflight.values())]
        need = s.budget.full_pages_to_admit(req, ratio, msg.n_tokens)
        need += sum(s.budget.pages_for(j.n_tokens) for j in s.transfers.prealloc)  # migrated ones taken already
        if s.budget.headroom(in_flight, ratio).full < need:
            why = f"no room: {need} pages needed with the reservation"
    if why is not None:
        s.migration_stats.in_refused += 1
        out.send(Conn(owner), MigrationEnded(rid=msg.rid, ok=False, error=f"peer refused: {why}"))
        return out
    # waits for pages first in line, like a recompute whose "prefill worker" is the source (no PrefillRequest)
    job = DecodeJob(
        req,
        msg.room,
        msg.source_addr,
        generation=msg.generation,
        n_tokens=msg.n_tokens,
        migrated=True,
        state=DecodeState.RECOMPUTING,
    )
    s.jobs[msg.rid] = job
    s.transfers.queue_recompute(job)
    log.info("migrated request %s admitted from %s (%d tokens)", msg.rid, msg.source_addr, msg.n_tokens)
    return out.extend(s.peers.connect(msg.source_addr))


def _back(s, rid: str, why: str, tell_router: bool) -> Outbox:
    """MIGRATING -> HOST_PARKED for ``rid`` (see ``MigrationSource.back``); the router hears when asked."""
    out = Outbox()
    job = s.migration.back(rid, s.retract.queue, why)
    if job is not None and job.answered:
        out.extend(s.finish(job, job.answered))
    elif job is not None and tell_router:
        out.send(Conn(job.req.owner), MigrationEnded(rid=rid, ok=False, error=why))
    return out


def migration_step(s) -> Outbox:
    """Source side, once per scheduler step: settle ended writes (done: forget the request; failed:
    park it again), withdraw expired offers, offer what waited too long."""
    m, out = s.migration, Outbox()
    for job, ok, error, nbytes, secs in m.ended():
        rid = job.req.rid
        if ok:
            owner, answered = job.req.owner, job.answered
            job.answered = answered or MOVED
            out.extend(s.finish(job, job.answered))
            if answered is None:
                log.info("migrated %s: %d bytes in %.4fs", rid, nbytes, secs)
                out.send(Conn(owner), MigrationEnded(rid=rid, ok=True, nbytes=nbytes, seconds=secs))
        else:
            out.extend(_back(s, rid, f"KV write to the peer failed: {error}", tell_router=True))
    for rid in m.expired():
        out.extend(
            _back(s, rid, f"no peer asked for the KV within {m.timeout_s:g}s (migrate_timeout_s)", tell_router=True)
        )
    if s.retract.queue:
        record = s.spec.record if s.spec is not None else None
        out.extend(m.offer(s.retract.queue, s.running.ratio.value, s.retract.host_copy_whole, record))
    return out
