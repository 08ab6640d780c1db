"""Decode worker scheduler (PD mode): wires the prefill peers, the transfer tracker (prealloc and
in-flight KV), the retract manager (``retracted_queue`` in the host pool) and the running batch.

Every ``step``: peers' liveness -> fences -> landed transfers -> ``resume_ready`` (first, within
the batch's free places; while anything waits there no new request is admitted, so resumes cannot
starve, but for preempting ones) -> admission -> one decode step whose victims are offloaded or
recomputed. Preemption for API keys under their share: ``decode_worker.preemption``. With
``--local-prefill-max-tokens`` a new request may be prefilled here instead of by its prefill worker
(``decode_worker.local_prefill``: decided in ``add``; ``decode_worker.local_queue``: its chunks ride
in the decode steps). A step
that has first tokens of landed requests (or errors) to answer returns them before decoding, and
the next step decodes whatever it finds (so time to first token never waits for a decode step,
and at most every other step skips its decode). Every ending goes through ``finish``.
"""

from __future__ import annotations

import time

from cache.host_pool import HostKVPool
from cache.kv_manager import KVManager
from cache.prefix_share import share_prefix
from configs.schema import PdserveConfig
from decode_worker.continuation import add_continuation
from decode_worker.evacuate import release_unprefilled, released, unprefilled
from decode_worker.jobs import DecodeJob, DecodeState
from decode_worker.local_prefill import LocalPrefillPolicy
from decode_worker.local_queue import LocalPrefillQueue
from decode_worker.migration import MigrationPolicy, MigrationSource, MigrationStats
from decode_worker.migration_steps import handle_migration, migration_step
from decode_worker.peers import PrefillPeers, make_handshake
from decode_worker.preemption import admitted, places_left, preempt_for_waiting
from decode_worker.queued_moves import QueuedMoves, queued_answer, queued_step
from decode_worker.retract import RetractManager
from decode_worker.stats import decode_snapshot
from decode_worker.transfers import Landing, TransferTracker
from engine.kernels import gather_pages
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler.base import Outcome, RequestRejected, Snapshot, WorkerScheduler, check_resume, sampler_state
from engine.scheduler.executor import BatchExecutor, token_delta
from engine.scheduler.running_batch import RunningBatch
from engine.scheduler.step_report import StepReport
from engine.scheduler.timeline import Timeline
from engine.spec.verify import speculator_for
from prefill_worker.kv_sender import KVSender
from prefill_worker.withdraw import RELEASED
from transfer.wire.enums import Role
from transfer.wire.outbox import Conn, Outbox, Peer
from transfer.wire.protocol import (
    GenerateRequest,
    KVSources,
    KVWriteStarted,
    Message,
    PrefilledLocally,
    PrefillFailed,
    PrefillWithdrawn,
    TokenDelta,
)


class DecodeScheduler(WorkerScheduler):
    role = Role.DECODE

    def __init__(
        self,
        runner: ModelRunner,
        cfg: PdserveConfig,
        kv: KVManager,
        transfers: TransferTracker,
        retract: RetractManager,
        peers: PrefillPeers,
        eos_token_ids: tuple[int, ...],
        migration: MigrationSource | None = None,
        worker_id: str = "",
        model_name: str = "",
    ) -> None:
        """``migration``: the source side of migrations (``--migrate-after``); any decode worker
        takes migrated requests in (``decode_worker.migration_steps``)."""
        super().__init__(runner, kv)
        self.migration, self.worker_id, self.model_name = migration, worker_id, model_name
        self.migration_stats = migration.stats if migration is not None else MigrationStats()
        self.cfg = cfg = cfg.model_copy(update={"scheduler": cfg.scheduler.for_device(runner.device.type)})
        self.transfers, self.retract, self.peers = transfers, retract, peers
        # speculation (--speculative-method): the decode rows' drafts are verified in the same forward
        # and roll back before the step ends, so retracts, offloads and migrations see kv_len's pages only
        self.spec = speculator_for(cfg.scheduler, kv, runner.max_model_len)
        self.executor = BatchExecutor(runner, eos_token_ids, kv, self.spec)
        self.running = RunningBatch(kv, self.executor, cfg.scheduler, self.stats)
        self.jobs: dict[str, DecodeJob] = {}
        self.evacuating = False  # changing role: nothing resumes here, parked jobs migrate (decode_worker.evacuate)
        self.transfer_failures = 0
        self.timeline = Timeline(self.role)
        self._decode_deferred = False  # the last step sent what it had and skipped its decode
        policy = LocalPrefillPolicy(
            cfg.cluster.local_prefill_max_tokens, backlog_ratio=cfg.cluster.local_prefill_backlog_ratio
        )
        self.local = LocalPrefillQueue(policy, cfg.scheduler, kv, self.stats)
        self.queued: QueuedMoves | None = None  # --migrate-queued: queued requests move before their prefill
        if cfg.cluster.migrate_queued and cfg.cluster.migrate_after is not None:
            self.queued = QueuedMoves(
                MigrationPolicy.from_flag(cfg.cluster.migrate_after), cfg.cluster.migrate_timeout_s
            )

    def add(self, owner: bytes, msg: GenerateRequest, prompt: list[int]) -> Outbox:
        if msg.room is None or msg.prefill_addr is None:
            raise RequestRejected("a decode worker needs room and prefill_addr (PD mode)")
        if msg.rid in self.jobs:
            raise RequestRejected(f"duplicate request id {msg.rid!r}")
        tail = len(prompt) - self.budget.prealloc_start(len(prompt)) if self.kv.has_swa else 0
        self.reject_if_unfit(len(prompt), msg.params.max_new_tokens, "decode KV cache pool", swa_tokens=tail)
        check_resume(msg)
        if msg.resume_output_ids:
            return add_continuation(self, owner, msg, prompt)
        req = Request(msg.rid, list(prompt), msg.params, sampler_state(self.runner, msg.params, prompt), owner=owner)
        job = self.jobs[msg.rid] = DecodeJob(req, msg.room, msg.prefill_addr, n_tokens=len(prompt), preempt=msg.preempt)
        self.stats.prompt_tokens += len(prompt)
        out = self.peers.connect(msg.prefill_addr)  # a recompute after a retract needs it either way
        decision = self.local.consider(
            req,
            lambda: admitted(self.running, self.transfers, self.local),
            self.running.ratio.value,
            len(self.retract.queue),
            len(self.transfers.prealloc),
            self.transfers.backlog_tokens,
            rows=len(self.running.reqs),
        )
        if decision is None or not decision.local:
            self.transfers.queue(job)
            return out
        job.enter(DecodeState.LOCAL_PREFILL)
        out.send(Peer(msg.prefill_addr), PrefillWithdrawn(rid=msg.rid, room=msg.room))
        out.send(Conn(owner), PrefilledLocally(rid=msg.rid))
        return out

    def abort(self, rid: str, reason: str = "request aborted") -> Outbox:
        job = self.jobs.get(rid)
        if job is None or job.answered:
            return Outbox()
        self.stats.aborted_requests += 1
        return self.finish(job, Outcome.abort(reason, 499))

    def finish(self, job: DecodeJob, outcome: Outcome) -> Outbox:
        """The one way a job ends. The client hears once (an abort's delta; a completed request's
        last token went out with its step). While a remote write may still land the pages stay
        fenced; a later ``finish`` (transfer settled) frees them."""
        out = Outbox()
        if job.answered is None:
            job.answered = outcome
            if not outcome.completed:
                out.token(job.req.owner, outcome.delta(job.req.rid))
        if self.migration is not None and self.migration.writing(job):
            return out  # the host copy is being read: freed when the write ends
        if self.transfers.writing(job):
            job.fenced_at = job.fenced_at or time.monotonic()
            return out
        req = job.req
        if job.migrated and job.state in (DecodeState.RECOMPUTING, DecodeState.AWAITING_KV):
            self.migration_stats.in_failed += 1
        if self.migration is not None:
            self.migration.forget(req.rid)
        if self.queued is not None:
            self.queued.forget(req.rid)
        self.transfers.discard(job)
        self.local.discard(req)
        self.retract.discard(job)
        self.running.discard(req)
        if job.answered.completed:
            self.kv.free_into_cache(req.kv, req.all_ids[: req.kv_len])
            self.stats.finished_requests += 1
        else:
            self.kv.free(req.kv)
        job.enter(DecodeState.FINISHED)
        req.finish(job.answered.reason)
        self.timeline.done(req)
        self.jobs.pop(req.rid, None)
        return out

    def handle(self, source, msg: Message, frames: list[bytes]) -> Outbox | None:
        if isinstance(msg, KVSources):  # its decode peers are KV sources when it migrates (a deployment-wide flag)
            migrates = self.cfg.cluster.migrate_after is not None
            return self.peers.connect_all(msg.prefill + (msg.decode if migrates else []))
        if not isinstance(source, Peer):
            answer = queued_answer(self, msg)
            return answer if answer is not None else handle_migration(self, source, msg, frames)
        out = self.peers.on_message(source.addr, msg)
        if isinstance(msg, KVWriteStarted):
            self.transfers.posted(msg)
        if isinstance(msg, PrefillFailed) and (job := self.transfers.failed(msg)) is not None:
            out = (out or Outbox()).extend(
                released(self, job, msg.error)
                if (job.withdrawn and not job.answered and msg.error_status == 503)
                or (msg.handed_back and unprefilled(job))
                else self.finish(job, Outcome.abort(f"prefill failed: {msg.error}", msg.error_status))
            )
        return out

    def peer_heartbeat(self, addr: str, stats, at: float) -> Outbox:
        return self.peers.heard(addr, stats, at)

    @property
    def has_work(self) -> bool:
        """A batch to decode, or (with no transfer in flight that could be holding the pages) a
        retracted request to resume or a queued one whose prefill worker is ready."""
        if self.running or self.local.chunked:
            return True
        if self.transfers.inflight:
            return False  # what could start now waits for pages they hold: poll them instead
        return bool(
            self.retract.queue
            or self.local
            or any((p := self.peers.get(j.prefill_addr)) and p.ready for j in self.transfers.prealloc)
        )

    @property
    def has_model_work(self) -> bool:
        """A batch to decode or a retracted request to resume; admitting from the prealloc queue
        only reserves pages and sends ``KVDestination`` (no forward pass)."""
        return bool(self.running or self.retract.queue or self.local)

    @property
    def has_queued_model_work(self) -> bool:
        """A request waiting for pages or KV that decodes once its KV lands: a recomputed or migrated
        one, or a new one with more than the first token (the prefill worker's) to generate."""
        jobs = (*self.transfers.prealloc, *self.transfers.inflight.values())
        return any(
            j.answered is None and (j.generation > 0 or j.migrated or j.req.remaining_new_tokens() > 1) for j in jobs
        )

    @property
    def awaits_peer_compute(self) -> bool:
        """Requests waiting for pages or for their KV: their prompts are (or are about to be) on a
        prefill worker."""
        return len(self.transfers) > 0

    def idle_wait_s(self) -> float | None:
        if self.transfers.polling:  # a write under way; its notification has no file descriptor: poll it
            return self.transfers.transport.poll_interval_s
        if self.migration is not None and (self.migration.offered or self.retract.queue):
            return self.migration.sender.transport.poll_interval_s
        return self.peers.next_due_s()

    def step(self) -> StepReport:
        self.local.observe()
        out, died = self.peers.tick()
        for peer in died:
            for job in self.transfers.waiting_on(peer.addr):
                out.extend(self.finish(job, Outcome.abort(peer.error, 503)))
        for job in self.transfers.release_fences(self.peers.restarted(), self.cfg.cluster.transfer_fence_s):
            out.extend(self.finish(job, job.answered))
        for landing in self.transfers.landed():
            out.extend(self._landed(landing))
        for job in (
            ()
            if self.evacuating
            else self.retract.resume_ready(
                self.running.reqs, self.cfg.scheduler.retract_decode_steps, places_left(self)
            )
        ):
            self.running.add(job.req)
        if self.evacuating:  # requests whose prefill has not started go to another pair
            out.extend(release_unprefilled(self))
        if self.migration is not None:
            out.extend(migration_step(self))
        if self.queued is not None and self.transfers.prealloc:
            out.extend(queued_step(self))
        out.extend(self._admit())
        if self.running and out and not self._decode_deferred:
            # first tokens and control messages (KV destinations, migration offers and endings) out
            # now, not after a decode step's forward (tens of ms); the decode runs next turn
            self._decode_deferred = True
            return StepReport(out)
        self._decode_deferred = False
        if self.running or self.local:
            out.extend(self._decode())
            # a NIXL write's notification needs two polls here (the write's completion, then the
            # notification its writer sends after it): one each side of the forward lands it a step sooner
            for landing in self.transfers.landed() if self.transfers.inflight else ():
                out.extend(self._landed(landing))
        elif not self.transfers:
            self.running.ratio.idle()
        return StepReport(out)

    def _landed(self, landing: Landing) -> Outbox:
        job, req = landing.job, landing.job.req
        if job.answered:
            return self.finish(job, job.answered)
        if job.withdrawn:  # taken back by a switch: nothing more is written into its pages now
            return released(self, job, RELEASED)
        if landing.error:
            self.transfer_failures += 1
            return self.finish(job, Outcome.abort(f"KV transfer rejected: {landing.error}", 500))
        job.enter(DecodeState.RUNNING)
        req.kv_len = job.n_tokens
        self.kv.drop_swa(req.kv, landing.manifest.swa_missing)
        req.mark("landed")
        if job.generation > 0:  # recomputed or migrated KV: resume decoding from the last output token
            self.migration_stats.in_done += job.migrated
            self.running.add(req)
            return Outbox()
        self.stats.cached_prompt_tokens += job.decode_prefix_len
        m, out = landing.manifest, Outbox()
        req.mark("first_token")
        req.prompt_logprobs = m.prompt_logprobs  # computed by the prefill worker; token_delta sends them
        out.token(
            req.owner,
            token_delta(
                req, m.first_token, m.first_logprob, m.first_top_logprobs, self.executor.eos, self.max_model_len
            ),
        )
        self.stats.generation_tokens += 1
        if req.finished:
            return out.extend(self.finish(job, Outcome(req.finish_reason)))
        # insert on landing: the prompt's full pages go to the decode radix cache now, not when the
        # request ends, so the other choices of an n > 1 request (sent once this one has its first
        # token) match them and the prefill worker ships only their last page (copy on write there)
        share_prefix(self.kv, req.kv, req.prompt_ids[: job.n_tokens])
        self.running.add(req)
        return out

    def _admit(self) -> Outbox:
        """Reserve pages for queued requests; while a retracted one waits to resume (resumes
        first) only for preempting ones, after ``preempt_for_waiting`` made them places."""
        preempt_for_waiting(self)
        ratio = self.running.ratio.value
        in_flight = admitted(self.running, self.transfers, self.local)
        free = self.budget.headroom(in_flight, ratio)
        slots = self.cfg.scheduler.max_running_requests - len(in_flight)
        held = self.queued.offered if self.queued is not None else ()
        out, unusable = self.transfers.admit(
            self.peers, free, ratio, slots, only_preempting=bool(self.retract.queue), held=held
        )
        for job in unusable:
            out.extend(
                self.finish(
                    job, Outcome.abort(self.peers.get(job.prefill_addr).error or "prefill worker unavailable", 503)
                )
            )
        return out

    def _decode(self) -> Outbox:
        """One decode step of the running batch plus this step's local prefill chunk (one mixed
        forward with ``mixed_batches``, else an extend forward right before the decode one), timed
        for the next chunks' size (``LocalPrefillQueue.timing``)."""
        # a victim's KV goes to the host pool, or is freed with a recompute queued
        res = self.running.prepare_decode(
            lambda req: self.retract.retract(self.jobs[req.rid]), park_last=bool(self.transfers.inflight)
        )
        rows = list(self.running.reqs)
        admit_new = not (self.retract.queue or res.retracted)  # resumes and recomputes first
        items = []
        if self.local:  # a request queued or chunked for local prefill
            reserved = admitted(self.running, self.transfers, self.local)
            items = self.local.select(len(rows), reserved, self.running.ratio.value, admit_new)
        with self.local.timing(items, len(rows)):
            if self.cfg.scheduler.mixed_batches:
                decoded, prefilled = self.executor.mixed(rows, items)
            else:
                prefilled = self.executor.extend(items) if items else []
                decoded = self.executor.decode(rows) if rows else []
        if rows:
            self.running.absorb(res, decoded)
        out = Outbox()
        if res.aborted is not None:
            out.extend(self.finish(self.jobs[res.aborted.rid], self.running.oom_outcome(res.aborted)))
        for req, delta in res.tokens:
            out.token(req.owner, delta)
        for req in res.finished:
            out.extend(self.finish(self.jobs[req.rid], Outcome(req.finish_reason)))
        return out.extend(self._prefilled(prefilled))

    def _prefilled(self, results: list[tuple[Request, TokenDelta]]) -> Outbox:
        """Locally prefilled requests' first tokens out; they join the running batch (or end)."""
        out = Outbox()
        for req, delta in results:
            job = self.jobs[req.rid]
            req.mark("first_token")
            self.stats.generation_tokens += 1
            out.token(req.owner, delta)
            if req.finished:  # its first token stopped it: LOCAL_PREFILL -> FINISHED
                out.extend(self.finish(job, Outcome(req.finish_reason)))
            else:
                job.enter(DecodeState.RUNNING)
                self.running.add(req)
        return out

    def live_handles(self):
        return [j.req.kv for j in self.jobs.values()]

    def held_rids(self) -> set[str]:
        return set(self.jobs)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.retract.check_integrity(self.jobs.values())

    def snapshot(self) -> Snapshot:
        return decode_snapshot(self, super().snapshot())


def create_decode_scheduler(
    runner: ModelRunner,
    cfg: PdserveConfig,
    transport,
    worker_id: str,
    model_name: str,
    eos_token_ids: tuple[int, ...] | None = None,
    migration_transport=None,
    threaded: bool = True,
) -> DecodeScheduler:
    """A decode scheduler over ``runner``'s pool, with ``transport`` (pool registered here), its
    prefill peers and, when ``cluster.host_kv_pool_gb > 0``, a host pool for retracted KV.
    ``eos_token_ids`` defaults to the model's. With ``cluster.migrate_after`` and a host pool,
    ``migration_transport`` (a second transport of the same backend) gets the host pool registered
    and writes migrated requests' KV to peers (``threaded=False``: writes inline, for unit tests)."""
    transport.register_pool(runner.pools.units, runner.pools.unit_bytes)
    kv = runner.make_kv_manager(cfg.scheduler.enable_radix_cache)
    host = None
    if cfg.cluster.host_kv_pool_gb > 0:
        host = HostKVPool.for_device_pool(runner.pools.units, int(cfg.cluster.host_kv_pool_gb * 2**30))
    hs = make_handshake(worker_id, model_name, runner, transport, cfg.cluster.cluster_id or "")
    peers = PrefillPeers(hs, cfg.cluster.peer_timeout_s, cfg.cluster.progress_timeout_s)
    transfers = TransferTracker(kv, transport, worker_id)
    retract = RetractManager(kv, runner.pools, host, transfers, gather_pages)
    eos = tuple(runner.model_config.eos_token_ids) if eos_token_ids is None else eos_token_ids
    migration = None
    if migration_transport is not None and host is not None and cfg.cluster.migrate_after is not None:
        migration_transport.register_pool(host.buffer, host.page_bytes)
        sender = KVSender(migration_transport, host.page_bytes, threaded=threaded)
        policy = MigrationPolicy.from_flag(cfg.cluster.migrate_after, cfg.cluster.migrate_on_retract)
        migration = MigrationSource(
            policy, host, sender, retract.budget, cfg.cluster.migrate_timeout_s, MigrationStats()
        )
    return DecodeScheduler(runner, cfg, kv, transfers, retract, peers, eos, migration, worker_id, model_name)
