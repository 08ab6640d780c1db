"""Migration of host-parked (retracted) requests from this decode worker to a peer decode worker.

Source side (``MigrationSource``), one edge pair out of HOST_PARKED (``decode_worker.jobs``):

1. ``offer``: a job parked longer than ``--migrate-after`` (decode steps or seconds), or with
   ``--migrate-on-retract`` one just retracted (never offered since it entered HOST_PARKED from
   RUNNING: live migration for balance, its KV copied to the host pool by the retract), leaves the
   retracted queue (HOST_PARKED -> MIGRATING) and a ``MigrationOffer`` goes to the router that
   owns its stream (its host copy first made whole: a prefix it kept on the device, shared with
   other requests, is copied to the host too, ``RetractManager.host_copy_whole``; without host room
   for it the job stays parked). The router picks a peer with room and sends it a ``MigrateRequest``, or
   answers ``MigrationDeclined`` (-> ``back``).
2. The peer treats this worker as the request's "prefill worker": it handshakes (``KVHandshake``,
   answered by ``handshake`` through a ``KVSender`` over a second transport whose registered pool
   is the host pool) and, once admitted, sends a ``KVDestination``. ``destination`` writes the
   host rows (full pages from the peer's radix prefix on, then the SWA window pages) straight
   from the host pool into the peer's pages with the same sealed ``TransferManifest`` as a
   prefill write (a logical SWA page asked for but not in the host copy is ``swa_missing``).
3. ``ended``: writes that finished. Done: the caller frees the host copy, forgets the request and
   tells the router (``MigrationEnded(ok=True)``); the peer streams from now on. Failed (peer dead,
   transport error): the job goes back to the front of the retracted queue (MIGRATING ->
   HOST_PARKED) with its host copy intact and resumes or recomputes here. An offer that got no
   destination within ``migrate_timeout_s`` is withdrawn the same way (``expired``); a
   destination that comes later is answered ``PrefillFailed`` and the peer's pages are freed by
   its fence, as for a prefill write that never came.

The host copy is never freed while a write that reads it is in flight (``writing``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cache.host_pool import HostKVPool
from cache.kv_budget import PageBudget
from configs.schema import migrate_bound
from decode_worker.jobs import DecodeJob, DecodeState
from engine.request import Request
from engine.scheduler.stats import Histogram
from prefill_worker.kv_sender import KVSender
from transfer.wire.outbox import Conn, Outbox
from transfer.wire.protocol import (
    DraftRecord,
    KVDestination,
    MigrationOffer,
    PrefillFailed,
    TransferManifest,
    ids_frame,
)

log = logging.getLogger(__name__)

MIGRATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class MigrationStats:
    """Cumulative counts by direction (out: this worker was the source; in: the target) and outcome."""

    out_done: int = 0
    out_failed: int = 0
    out_declined: int = 0
    in_done: int = 0
    in_failed: int = 0
    in_refused: int = 0
    out_bytes: int = 0


@dataclass(frozen=True)
class MigrationPolicy:
    """When a parked job is offered: after ``steps`` decode steps or ``seconds`` in the retracted
    queue (exactly one of them is set; ``from_flag`` parses ``--migrate-after``), or, with
    ``on_retract`` (``--migrate-on-retract``), at once when it was just retracted."""

    steps: int | None = None
    seconds: float | None = None
    on_retract: bool = False

    @classmethod
    def from_flag(cls, text: str, on_retract: bool = False) -> MigrationPolicy:
        steps, seconds = migrate_bound(text)
        return cls(steps, seconds, on_retract)

    def due(self, job: DecodeJob, step: int, now: float, fresh: bool = False) -> bool:
        """True when ``job`` (HOST_PARKED since ``parked_step``/``parked_at``) waited long enough;
        ``fresh``: it came from the running batch (a retract) and was not offered since."""
        if fresh and self.on_retract:
            return True
        return self.waited(job.parked_step, job.parked_at, step, now)

    def waited(self, since_step: int, since: float, step: int, now: float) -> bool:
        """Whether a wait that began at step ``since_step`` / time ``since`` has reached the bound."""
        if self.steps is not None:
            return step - since_step >= self.steps
        return now - since >= self.seconds


class MigrationSource:
    """The source side of migrations (module docstring). ``sender`` writes from the host pool
    (its transport has ``host.buffer`` registered); ``budget`` sizes offers."""

    def __init__(
        self,
        policy: MigrationPolicy,
        host: HostKVPool,
        sender: KVSender,
        budget: PageBudget,
        timeout_s: float,
        stats: MigrationStats,
    ) -> None:
        self.policy, self.host, self.sender, self.budget = policy, host, sender, budget
        self.timeout_s = timeout_s
        self.offered: dict[str, DecodeJob] = {}  # rid -> MIGRATING job
        self._offered_at: dict[str, float] = {}
        self._timeline: dict[str, tuple[float, float]] = {}  # rid -> (offered, destination came): for the log
        self._writing: set[str] = set()
        self.stats = stats
        self.seconds = Histogram(MIGRATION_BUCKETS)
        self.step_count = 0

    def writing(self, job: DecodeJob) -> bool:
        """True while a write that reads ``job``'s host copy may be in flight."""
        return job.req.rid in self._writing

    def offer(
        self,
        queue,
        ratio: float,
        whole: Callable[[DecodeJob], bool],
        record: Callable[[Request], DraftRecord | None] | None = None,
    ) -> Outbox:
        """Offer every due job of the retracted ``queue`` (a deque of HOST_PARKED jobs, which it
        leaves) to its router; ``ratio``: the ``new_token_ratio`` the peer's reservation uses;
        ``whole(job)`` makes the job's host copy hold its whole KV (``RetractManager.host_copy_whole``)
        or says it cannot: such a job stays parked here. ``record``: a request's speculative-decoding
        record (``NgramSpeculator.record``), sent with the offer for the peer to take over."""
        self.step_count += 1
        out, now = Outbox(), time.monotonic()
        for job in list(queue):
            fresh = job.parked_step < 0  # entered HOST_PARKED by a retract (``back`` stamps its step)
            if fresh:
                job.parked_step = self.step_count
            if job.answered or not self.policy.due(job, self.step_count, now, fresh) or not whole(job):
                continue
            queue.remove(job)
            job.enter(DecodeState.MIGRATING)
            req = job.req
            pages = self.budget.full_pages_to_admit(req, ratio, req.kv_len)
            self.offered[req.rid], self._offered_at[req.rid] = job, now
            log.info(
                "offering retracted %s (%d tokens, %d pages with reservation) to a peer decode worker",
                req.rid,
                req.kv_len,
                pages,
            )
            offer = MigrationOffer(
                rid=req.rid,
                n_tokens=req.kv_len,
                pages=pages,
                prompt_len=len(req.prompt_ids),
                params=req.params,
                draft=record(req) if record is not None else None,
            )
            out.send(Conn(req.owner), offer, ids_frame(req.all_ids))
        return out

    def back(self, rid: str, queue, why: str) -> DecodeJob | None:
        """MIGRATING -> HOST_PARKED, first in ``queue``, unless a write is in flight; the job or None."""
        job = self.offered.get(rid)
        if job is None or rid in self._writing:
            return None
        del self.offered[rid]
        self._offered_at.pop(rid, None)
        log.warning("migration of %s did not happen (%s): it stays here", rid, why)
        job.enter(DecodeState.HOST_PARKED)
        job.parked_step = self.step_count
        if not job.answered:
            queue.appendleft(job)
        return job

    def expired(self) -> list[str]:
        """Offers that got no destination within ``timeout_s`` (no write started)."""
        now = time.monotonic()
        return [rid for rid, t in self._offered_at.items() if rid not in self._writing and now - t > self.timeout_s]

    def destination(self, source: Conn, msg: KVDestination, pages: np.ndarray, swa: np.ndarray, peer_id: str) -> Outbox:
        """The peer's pages for an offered job: start the write from the host copy. A destination
        for no offered job (withdrawn, finished) is answered ``PrefillFailed``."""
        job = self.offered.get(msg.rid)
        if job is None or msg.rid in self._writing or msg.n_tokens != job.req.kv_len or job.answered:
            out = Outbox()
            out.send(
                source,
                PrefillFailed(
                    rid=msg.rid,
                    room=msg.room,
                    generation=msg.generation,
                    error=(f"decode worker has no migration of {msg.rid} to offer any more (withdrawn or finished)"),
                    error_status=503,
                ),
            )
            return out
        page_size = self.budget.kv.page_size
        first, last = msg.decode_prefix_len // page_size, self.budget.pages_for(msg.n_tokens)
        kv = job.host_kv
        assert kv.first_page == 0, "offered jobs hold their whole KV on the host (host_copy_whole)"
        n_full = len(kv.pages) - len(kv.swa_index)
        src = list(kv.pages[first : min(last, n_full)])
        swa_src, swa_dst, missing = [], [], []
        host_swa = dict(zip(kv.swa_index, kv.pages[n_full:]))
        for j in range(first, min(last, len(swa))):
            if swa[j] < 0:
                continue
            if j in host_swa:
                swa_src.append(host_swa[j])
                swa_dst.append(int(swa[j]))
            else:
                missing.append(j)
        manifest = TransferManifest(
            rid=msg.rid,
            room=msg.room,
            generation=msg.generation,
            n_tokens=msg.n_tokens,
            n_pages=len(src),
            swa_pages=len(swa_src),
            swa_missing=missing,
            first_token=job.req.all_ids[-1],
        ).sealed()
        dst = self.sender.dest_rows(peer_id, pages[first : first + len(src)], np.asarray(swa_dst, dtype=np.int32))
        self.sender.start(job, peer_id, np.asarray(src + swa_src, dtype=np.int32), dst, manifest)
        self._writing.add(msg.rid)
        offered = self._offered_at.pop(msg.rid, None)
        self._timeline[msg.rid] = (offered if offered is not None else time.monotonic(), time.monotonic())
        return Outbox()

    def ended(self) -> list[tuple[DecodeJob, bool, str | None, int, float]]:
        """Writes that ended: ``(job, ok, error, nbytes, seconds)``; counts and times them. A done
        job leaves ``offered`` (the caller finishes it); a failed one stays for ``back``."""
        done = []
        for w in self.sender.poll():
            job, ok, error, nbytes, secs = w.job, w.ok, w.error, w.nbytes, w.seconds
            rid = job.req.rid
            self._writing.discard(rid)
            self._log_phases(rid, ok, nbytes, secs)
            if ok:
                self.offered.pop(rid, None)
                self.stats.out_done += 1
                self.stats.out_bytes += nbytes
                self.seconds.observe(secs)
            else:
                self.stats.out_failed += 1
            done.append((job, ok, error, nbytes, secs))
        return done

    def _log_phases(self, rid: str, ok: bool, nbytes: int, secs: float) -> None:
        """One INFO line per ended write: where the migration's time went, source side."""
        offered, dest = self._timeline.pop(rid, (None, None))
        if offered is None:
            return
        now = time.monotonic()
        log.info(
            "migration of %s %s: offer -> KV destination %.1f ms (router pick, peer admission, handshake), "
            "destination -> write ended %.1f ms, of which the write %.1f ms (%d bytes, %.2f GB/s)",
            rid,
            "done" if ok else "failed",
            (dest - offered) * 1e3,
            (now - dest) * 1e3,
            secs * 1e3,
            nbytes,
            nbytes / secs / 1e9 if secs > 0 else 0.0,
        )

    def forget(self, rid: str) -> None:
        """The job ended here otherwise (abort, no write in flight): drop its offer."""
        self.offered.pop(rid, None)
        self._offered_at.pop(rid, None)
