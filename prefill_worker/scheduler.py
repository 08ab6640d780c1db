"""Prefill worker scheduler: compute prompts, sample the first token, ship the KV to a decode worker.

Per request (a ``PrefillJob``, keyed by ``(room, generation)``), in ``Phase`` terms:
  WAITING (in ``bootstrapping`` until the decode worker's ``KVDestination`` came, then in
  ``waiting``) -> PREFILLING -> TRANSFER (first token known, writing) -> FINISHED.

A prompt is prefilled only once its decode destination is reserved (SGLang's bootstrap queue does
the same). That rule is what keeps the two pools from deadlocking: every page this worker's
requests hold belongs to a request whose decode pages are already reserved, so it needs nothing
more from the decode worker to finish (compute, one write, done) and its pages always come back;
and the decode worker only reserves for requests this worker will then prefill in that order as
pages free up (a prompt larger than this pool is refused when it arrives). Before it, a prefill pool
full of finished KV that the decode worker had no room to ask for, with the decode pool held by
destinations of prompts that could not start here (recomputes of retracted requests queue behind
new prompts), waited for ``bootstrap_timeout_s``.

A decode worker that prefills a request itself (``--local-prefill-max-tokens``) says so with
``PrefillWithdrawn`` instead of a destination: the job leaves silently, or, when the withdrawal
came first, its ``PrefillRequest`` is dropped on arrival; a decode worker switching role withdraws
its reserved destinations, whatever their prefill's progress: nothing more is written into them and
it is answered once nothing is being written (``prefill_worker.withdraw``: a prompt under way is
computed into the radix cache).

A write's start is announced to its decode worker (``KVWriteStarted``, in the step that posts it):
the decode worker polls its transport for the landing from then on only, not all through the prefill.

The KV stays locked in this worker's pool until the write finished or failed, then goes to the
radix cache for prefix hits. A failure is reported to the decode worker (``PrefillFailed``: nothing
was or will be written to its pages) and, for generation 0, to the router as an abort delta. A
one-token request sent here alone is answered here (``prefill_worker.one_token``): no write.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from configs.schema import PdserveConfig
from engine.model_runner import ModelRunner
from engine.request import Phase, Request
from engine.scheduler.admission import Admission
from engine.scheduler.base import Outcome, RequestRejected, Snapshot, WorkerScheduler, sampler_state
from engine.scheduler.chunk_pace import ChunkPace
from engine.scheduler.executor import BatchExecutor
from engine.scheduler.stats import TRANSFER_BUCKETS, Histogram
from engine.scheduler.step_report import StepReport
from engine.scheduler.timeline import Timeline
from prefill_worker.bootstrap import WITHDRAWN, BootstrapTable, EarlyDestination, refusal
from prefill_worker.kv_sender import KVSender
from prefill_worker.one_token import answer, direct_refusal
from prefill_worker.withdraw import admissible, end_released, withdraw
from transfer.wire.enums import Role
from transfer.wire.outbox import Conn, Outbox
from transfer.wire.protocol import (
    GenerateRequest,
    KVDestination,
    KVHandshake,
    KVHandshakeAck,
    KVWriteStarted,
    Message,
    PrefillFailed,
    PrefillRequest,
    PrefillWithdrawn,
    TokenDelta,
    TransferManifest,
    frame_ids,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillJob:
    req: Request  # req.owner: the connection that sent the PrefillRequest
    room: int
    generation: int
    decode_worker: str
    created: float
    dest: KVDestination | None = None
    dest_conn: Conn | None = None  # the decode worker's connection that asked for the KV
    dest_pages: np.ndarray | None = None
    dest_swa: np.ndarray | None = None  # SWA pages by logical page (-1: not wanted); empty without SWA
    manifest: TransferManifest | None = None
    writing: bool = False
    released: bool = False  # withdrawn by its decode worker under way: no write after the one in flight, if any
    direct: bool = False  # a one-token request answered to the router here (``prefill_worker.one_token``)
    uncached: int = 0  # prompt tokens the radix cache did not hold on arrival (gauge prefill_backlog_tokens)

    @property
    def key(self) -> tuple[int, int]:
        return self.room, self.generation


class PrefillScheduler(WorkerScheduler):
    role = Role.PREFILL

    def __init__(
        self, runner: ModelRunner, cfg: PdserveConfig, sender: KVSender, model_name: str, worker_id: str
    ) -> None:
        super().__init__(runner, runner.make_kv_manager(cfg.scheduler.enable_radix_cache))
        self.cfg = cfg = cfg.model_copy(update={"scheduler": cfg.scheduler.for_device(runner.device.type)})
        self.worker_id = worker_id
        self.model_name = model_name
        self.admission = Admission(cfg.scheduler, self.kv, self.stats, reserve_decode=False)
        self.executor = BatchExecutor(runner, (), self.kv)
        self.eos_token_ids = tuple(runner.model_config.eos_token_ids)  # a direct answer's stop check
        self.pace = ChunkPace(cfg.scheduler.prefill_step_s)
        self.sender = sender
        self.bootstrapping: deque[Request] = deque()  # prompts whose decode destination has not come
        self.waiting: deque[Request] = deque()  # destination reserved: prefilled in this order
        self.jobs: dict[tuple[int, int], PrefillJob] = {}
        self.bootstrap = BootstrapTable()
        self.by_req: dict[int, PrefillJob] = {}
        self.transfer_bytes = 0
        self.transfer_failures = 0
        self.withdrawn = 0  # requests their decode worker prefilled itself (PrefillWithdrawn)
        self.transfer_seconds = Histogram(TRANSFER_BUCKETS)
        self.timeline = Timeline(self.role)

    # ---- messages ---------------------------------------------------------------------------
    def add(self, owner: bytes, msg: GenerateRequest, prompt: list[int]) -> Outbox:
        raise RequestRejected(
            "a prefill worker takes PrefillRequest (PD mode); send GenerateRequest to a decode or colocated worker"
        )

    def handle(self, source: Conn, msg: Message, frames: list[bytes]) -> Outbox | None:
        if isinstance(msg, PrefillRequest):
            return self._on_prefill(source, msg, frame_ids(frames[0]))
        if isinstance(msg, KVDestination):
            return self._on_destination(
                source, msg, np.frombuffer(frames[0], dtype="<i4").copy(), np.frombuffer(frames[1], dtype="<i4").copy()
            )
        if isinstance(msg, PrefillWithdrawn):
            return withdraw(self, msg)
        if isinstance(msg, KVHandshake):
            error = self.sender.accept_peer(
                source,
                msg,
                self.model_name,
                self.runner.kv_descriptor(),
                self.cfg.cluster.cluster_id or "",
                self.worker_id,
            )
            return _reply(source, KVHandshakeAck(ok=error is None, worker_id=self.worker_id, error=error))
        return None

    def _on_prefill(self, source: Conn, msg: PrefillRequest, ids: list[int]) -> Outbox:
        if self.bootstrap.gone((msg.room, msg.generation)) == WITHDRAWN:
            self.withdrawn += 1
            return Outbox()  # its decode worker prefills it itself and said so first
        why = direct_refusal(msg)
        if why is None and (msg.room, msg.generation) in self.jobs:
            why = f"duplicate room {msg.room} generation {msg.generation}"
        if why is not None:
            out = Outbox()
            out.token(source.ident, TokenDelta.failed(msg.rid, why, 400))
            return out
        # a recompute (generation > 0) only rebuilds KV: no prompt logprobs, no grammar (the decode worker's)
        params = (
            msg.params
            if msg.generation == 0
            else msg.params.model_copy(update={"prompt_logprobs": None, "structured": None})
        )
        try:
            state = sampler_state(self.runner, params, ids)
        except RequestRejected as e:
            out = Outbox()
            out.token(source.ident, TokenDelta.failed(msg.rid, str(e), 400))
            return out
        req = Request(msg.rid, ids, params, state, owner=source.ident, continuation=msg.continuation)
        cached = self.kv.tree.match_prefix(ids[: len(ids) - 1]).num_tokens if self.kv.tree is not None else 0
        job = PrefillJob(req, msg.room, msg.generation, msg.decode_worker, time.monotonic(), direct=msg.answer_router)
        job.uncached = len(ids) - cached
        try:
            self.counting_rejections(lambda: self._check_fits(len(ids)))
        except RequestRejected as e:
            return self.finish(job, Outcome.abort(str(e), 400))
        self.jobs[job.key], self.by_req[id(req)] = job, job
        self.stats.prompt_tokens += len(ids)
        (self.waiting if job.direct else self.bootstrapping).append(req)  # a direct job waits for no destination
        early = self.bootstrap.claim(job.key)
        return self._on_destination(early.source, early.msg, *early.pages) if early else Outbox()

    def _check_fits(self, n: int) -> None:
        """``FitCheck.prompt``: the prompt alone (its decode tokens are the decode worker's) and the
        SWA KV it holds at once while prefilled in chunks."""
        swa_tokens = self.budget.prefill_swa_tokens(n, self.cfg.scheduler.chunked_prefill_size)
        self.fit_check().prompt(n, self.budget.swa_pages_at_once(swa_tokens))

    def _on_destination(self, source: Conn, msg: KVDestination, pages: np.ndarray, swa: np.ndarray) -> Outbox:
        key = (msg.room, msg.generation)
        job = self.jobs.get(key)
        if job is None and (why := self.bootstrap.gone(key)) is None:
            self.bootstrap.park(key, EarlyDestination(source, msg, (pages, swa)))  # came before its PrefillRequest
            return Outbox()
        if job is None:  # it ended here: tell the decode side nothing will come
            return _reply(source, refusal(msg, why))
        job.dest_conn = source
        if msg.n_tokens != len(job.req.prompt_ids) or msg.decode_prefix_len % self.runner.page_size:
            return self.finish(
                job,
                Outcome.abort(
                    f"destination mismatch: decode expects {msg.n_tokens} tokens from "
                    f"{msg.decode_prefix_len}, prefill has {len(job.req.prompt_ids)}",
                    500,
                ),
            )
        job.dest, job.dest_pages, job.dest_swa = msg, pages, swa
        job.req.mark("destination")
        if job.req in self.bootstrapping:  # its decode pages are reserved: it may be prefilled now
            self.bootstrapping.remove(job.req)
            self.waiting.append(job.req)
        log.debug(
            "destination for %s room %d: %d pages from token %d", msg.rid, msg.room, len(pages), msg.decode_prefix_len
        )
        return Outbox()  # prefilled by a later step, whose KV write starts in that step

    def abort(self, rid: str, reason: str = "request aborted") -> Outbox:
        """A write in flight is left to finish (its KV is valid and goes to the radix cache), and so
        is a released prompt (``prefill_worker.withdraw``: computed into the radix cache)."""
        out = Outbox()
        for job in [j for j in self.jobs.values() if j.req.rid == rid and not j.writing and not j.released]:
            out.extend(self.finish(job, Outcome.abort(reason, 499)))
        return out

    # ---- loop ---------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.admission.chunked)

    def idle_wait_s(self) -> float | None:
        if self.sender.busy:
            return self.sender.transport.poll_interval_s
        timeout = self.cfg.cluster.bootstrap_timeout_s
        deadlines = [j.created + timeout for j in self.jobs.values() if j.dest is None and not j.direct]
        if (early := self.bootstrap.next_deadline()) is not None:
            deadlines.append(early)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def step(self) -> StepReport:
        """Finish landed writes (``settle``), prefill one batch (sized by ``prefill_step_s``, ``ChunkPace``:
        a withdrawal or a drain read between steps waits for one), start the writes it made possible."""
        report = self.settle()
        out = report.outbox
        items = self.admission.select(
            admissible(self), (), 0.0, self.pace.tokens(self.cfg.scheduler.chunked_prefill_size, 0)
        )
        if items:
            n = sum(i.length for i in items)
            self.stats.extend_steps += 1
            self.stats.prefill_computed_tokens += n
            t0 = self.pace.clock()
            deltas = self.executor.extend(items)
            seconds = self.pace.clock() - t0
            self.pace.observe(n, 0, seconds)  # the next chunks' size (prefill_step_s)
            # wall seconds of prefill forwards, counted with their tokens: the planner's prefill speed
            # (one batch counted once, however many prompts share it)
            self.stats.prefill_compute_seconds += seconds
            for req, delta in deltas:
                job = self.by_req[id(req)]
                if job.released:  # its decode worker took it back while computed: KV to the cache, no write
                    out.extend(end_released(self, job, write_ended=False))
                    continue
                if job.direct:
                    out.extend(answer(self, job, delta))
                    continue
                job.manifest = self._manifest(job, delta)
                req.status = Phase.TRANSFER
        out.extend(self._start_transfers())
        out.extend(self._expire())
        return report

    def _manifest(self, job: PrefillJob, delta: TokenDelta) -> TransferManifest:
        req = job.req
        lp = req.params.logprobs is not None
        return TransferManifest(
            rid=req.rid,
            room=job.room,
            generation=job.generation,
            n_tokens=req.kv_len,
            n_pages=0,
            first_token=req.output_ids[-1],
            first_logprob=(delta.logprobs or [delta.stop_logprob])[0] if lp else None,
            first_top_logprobs=(delta.top_logprobs or [delta.stop_top_logprobs])[0] if lp else None,
            prompt_logprobs=delta.prompt_logprobs,
        )

    def _start_transfers(self) -> Outbox:
        out = Outbox()
        for job in [j for j in self.jobs.values() if not j.writing and j.manifest and j.dest and not j.released]:
            first, last = job.dest.decode_prefix_len // self.kv.page_size, self.kv.pages_for(job.req.kv_len)
            full = np.asarray(job.req.kv.pages[first:last], dtype=np.int32)
            swa_src, swa_dst, missing = self._swa_pairs(job, first, last)
            manifest = job.manifest.model_copy(
                update={"n_pages": len(full), "swa_pages": len(swa_src), "swa_missing": missing}
            ).sealed()
            job.writing = True
            job.req.mark("write_start")
            log.debug("transfer %s room %d: %d pages + %d SWA pages", job.req.rid, job.room, len(full), len(swa_src))
            try:
                src = self.runner.pools.unit_rows(full, swa_src)
                dst = self.sender.dest_rows(job.decode_worker, job.dest_pages[first:last], swa_dst)
                self.sender.start(job, job.decode_worker, src, dst, manifest)
                if job.dest_conn is not None:  # the decode worker polls for this landing from now on
                    out.send(job.dest_conn, KVWriteStarted(rid=job.req.rid, room=job.room, generation=job.generation))
            except Exception as e:  # noqa: BLE001 - any transport error fails this request only
                job.writing = False
                out.extend(self.finish(job, Outcome.abort(f"KV transfer could not start: {e}", 503)))
        return out

    def _swa_pairs(self, job: PrefillJob, first: int, last: int) -> tuple[list[int], list[int], list[int]]:
        """(own SWA pages, the decode pages they go to, logical pages asked for but no longer
        here: margin pages outside the window that this worker's radix cache had tombstoned)."""
        mine, want = job.req.kv.swa_pages or [], job.dest_swa
        src, dst, missing = [], [], []
        for j in range(first, min(last, len(want))):
            if want[j] < 0:
                continue
            if j < len(mine) and mine[j] >= 0:
                src.append(mine[j])
                dst.append(int(want[j]))
            else:
                missing.append(j)
        return src, dst, missing

    def settle(self) -> StepReport:
        """Finish the writes that ended; each one that succeeded hands a request to its decode worker."""
        report = StepReport()
        out = report.outbox
        for w in self.sender.poll():
            job = w.job
            job.writing = False
            job.req.mark("write_done", at=w.ended_at)
            log.debug("transfer %s room %d ended ok=%s in %.4fs", job.req.rid, job.room, w.ok, w.seconds)
            if w.ok:
                self.transfer_bytes += w.nbytes
                self.transfer_seconds.observe(w.seconds)
            if job.released:  # withdrawn while written: answered now, its KV (valid here) to the cache
                out.extend(end_released(self, job, write_ended=True))
            elif w.ok:
                report.handoffs += 1
                out.extend(self.finish(job, Outcome("length")))
            else:
                self.transfer_failures += 1
                out.extend(self.finish(job, Outcome.abort(f"KV transfer to decode worker failed: {w.error}", 503)))
        return report

    def _expire(self) -> Outbox:
        out, timeout, t0 = Outbox(), self.cfg.cluster.bootstrap_timeout_s, time.monotonic()
        for job in [j for j in self.jobs.values() if j.dest is None and not j.direct and j.created < t0 - timeout]:
            out.extend(self.finish(job, Outcome.abort(f"decode worker did not ask for the KV within {timeout}s", 504)))
        for d in self.bootstrap.expired():
            out.send(
                d.source,
                PrefillFailed(
                    rid=d.msg.rid,
                    room=d.msg.room,
                    generation=d.msg.generation,
                    error="prefill worker has no such request (its prompt never came)",
                ),
            )
        return out

    # ---- the one ending -----------------------------------------------------------------------
    def finish(self, job: PrefillJob, outcome: Outcome, counted: bool = True) -> Outbox:
        """Shipped (``outcome.completed``): the KV goes to the radix cache. Failed: the decode
        worker gets ``PrefillFailed`` (on the connection that asked, else its handshake one), the
        router an abort delta for its own requests, and the KV is dropped. ``counted``: a finished
        request (not one its decode worker took back)."""
        req, out = job.req, Outbox()
        for queue in (self.bootstrapping, self.waiting):
            if req in queue:
                queue.remove(req)
        self.admission.drop(req)
        if self.jobs.pop(job.key, None) is not None and counted:
            self.stats.finished_requests += 1
        self.by_req.pop(id(req), None)
        self.bootstrap.ended(job.key, outcome.error or "finished")
        early = self.bootstrap.claim(job.key)  # a destination parked for a prompt refused at once
        req.finish(outcome.reason)
        self.timeline.done(req)
        if outcome.completed:
            self.kv.free_into_cache(req.kv, req.all_ids[: req.kv_len])
            return out
        self.kv.free(req.kv)
        log.warning("prefill %s room %d failed: %s", req.rid, job.room, outcome.error)
        if job.generation == 0:  # a recompute's owner is the decode worker: PrefillFailed tells it
            out.token(req.owner, outcome.delta(req.rid))
        to = job.dest_conn or (early.source if early else None) or self.sender.conn_of(job.decode_worker)
        if to is not None:
            out.send(
                to,
                PrefillFailed(
                    rid=req.rid,
                    room=job.room,
                    generation=job.generation,
                    error=outcome.error,
                    error_status=outcome.status,
                    handed_back=outcome.handed_back,
                ),
            )
        return out

    # ---- introspection --------------------------------------------------------------------
    def live_handles(self):
        return [j.req.kv for j in self.jobs.values()]

    def held_rids(self) -> set[str]:
        return {j.req.rid for j in self.jobs.values()}

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        snap.counters.update(
            kv_transfer_bytes=float(self.transfer_bytes), transfer_failures=float(self.transfer_failures)
        )
        chunked = self.admission.chunked
        snap.gauges.update(
            queue_waiting=len(self.waiting),
            queue_prefilling=int(chunked is not None),  # a prompt part-way through its chunks
            queue_bootstrap=len(self.bootstrapping),
            queue_transfer=sum(1 for j in self.jobs.values() if j.writing),
        )
        # prompt tokens not computed yet (uncached on arrival, or the chunked one's rest): what
        # cache-aware routing weighs this worker's load by (server/router/load.py, PrefillBacklog)
        snap.gauges["prefill_backlog_tokens"] = float(
            sum(self.by_req[id(r)].uncached for r in (*self.bootstrapping, *self.waiting) if id(r) in self.by_req)
            + (chunked.seq_len - chunked.kv_len if chunked is not None else 0)
        )
        snap.histograms.update(kv_transfer_seconds=self.transfer_seconds, **self.timeline.histograms)
        return snap


def _reply(to: Conn, msg: Message) -> Outbox:
    out = Outbox()
    out.send(to, msg)
    return out


def create_prefill_scheduler(
    runner: ModelRunner, cfg: PdserveConfig, transport, worker_id: str, model_name: str, threaded: bool = True
) -> PrefillScheduler:
    """A prefill scheduler over ``runner``'s pool, writing through ``transport`` (pool registered
    here); ``threaded=False`` runs writes inline (deterministic in-process tests)."""
    transport.register_pool(runner.pools.units, runner.pools.unit_bytes)
    sender = KVSender(transport, runner.pools.unit_bytes, threaded=threaded)
    return PrefillScheduler(runner, cfg, sender, model_name, worker_id)
