"""Decode worker scheduler (PD mode).

Queues: ``prealloc`` (admission: prompt pages minus the decode radix prefix, plus
``max_new_tokens * new_token_ratio`` reserved, then a ``KVDestination`` goes to the prefill
worker), ``transfer`` (pages reserved, waiting for the completion notification), ``running``
(continuous decode), ``retracted`` (KV parked in the host pool). Every ``step``:
peers' liveness -> transfer completions -> ``resume_retracted`` (first, and while anything waits
there no new request is admitted, so resumes cannot starve) -> admission -> one decode step
(``check_decode_mem``; ``retract_decode`` with offload or recompute when short).
"""
from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np

from cache.host_pool import HostKVPool
from cache.kv_manager import KVManager
from configs.schema import PdserveConfig
from decode_worker.jobs import DecodeJob
from decode_worker.manifest import manifest_error, parse_manifest
from decode_worker.peers import PrefillPeers
from decode_worker.retract import RetractManager
from engine.model_runner import ModelRunner
from engine.request import ReqStatus, Request
from engine.sampling import SamplerState, SamplingParams, check_stop
from engine.scheduler.admission import reserved_tokens, running_reservation_pages
from engine.scheduler.base import RequestRejected, WorkerScheduler, check_fits
from engine.scheduler.decode_memory import OOM_ABORT_MESSAGE, check_decode_mem, decode_pages_needed, retract_decode
from engine.scheduler.events import TokenEvent
from engine.scheduler.executor import BatchExecutor
from engine.scheduler.ratio import NewTokenRatioTracker
from engine.scheduler.stats import SchedulerStats
from transfer.protocol import KVDestination, Message, PrefillFailed, PrefillRequest, TransferManifest, ids_frame

log = logging.getLogger(__name__)


class DecodeScheduler(WorkerScheduler):
    role = "decode"

    def __init__(self, runner: ModelRunner, cfg: PdserveConfig, transport, peers: PrefillPeers,
                 host: HostKVPool | None, eos_token_ids: tuple[int, ...], worker_id: str) -> None:
        self.runner, self.cfg, self.transport, self.peers = runner, cfg, transport, peers
        self.worker_id = worker_id
        self.kv = KVManager(runner.allocator, runner.page_size, cfg.scheduler.enable_radix_cache)
        self.executor = BatchExecutor(runner, eos_token_ids)
        self.eos = frozenset(eos_token_ids)
        self.ratio = NewTokenRatioTracker(cfg.scheduler)
        self.retract = RetractManager(self.kv, runner.pool.buffer, host)
        self.stats = SchedulerStats()
        self.prealloc: deque[DecodeJob] = deque()
        self.transfer: dict[tuple[int, int], DecodeJob] = {}
        self.running: list[Request] = []
        self.retracted: deque[DecodeJob] = deque()
        self.jobs: dict[str, DecodeJob] = {}
        self.by_req: dict[int, DecodeJob] = {}
        self.pending_events: list[TokenEvent] = []
        self.transfer_failures = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams, room: int | None = None,
                    prefill_addr: str | None = None) -> Request:
        if room is None or prefill_addr is None:
            raise RequestRejected("a decode worker needs room and prefill_addr (PD mode)")
        if rid in self.jobs:
            raise RequestRejected(f"duplicate request id {rid!r}")
        self._check_fits(len(prompt_ids), params.max_new_tokens)
        req = Request(rid, list(prompt_ids), params,
                      SamplerState.new(params, self.runner.model_config.vocab_size, prompt_ids))
        job = DecodeJob(req, room, prefill_addr, n_tokens=len(prompt_ids))
        self.jobs[rid], self.by_req[id(req)] = job, job
        self.prealloc.append(job)
        self.peers.get(prefill_addr)
        self.stats.prompt_tokens += len(prompt_ids)
        return req

    def _check_fits(self, prompt_len: int, max_new: int) -> None:
        try:
            check_fits(prompt_len, max_new, self.capacity_tokens, self.max_model_len, "decode KV cache pool")
        except RequestRejected:
            self.stats.rejected_requests += 1
            raise

    def abort(self, rid: str, message: str = "request aborted") -> TokenEvent | None:
        """Idempotent. A request whose KV may still be written keeps its pages until the
        prefill side answers (notification or ``PrefillFailed``) or is declared dead."""
        job = self.jobs.get(rid)
        if job is None or job.aborted:
            return None
        self.stats.aborted_requests += 1
        if job.phase == "transfer":
            return self._fence(job, message, 499)
        return self._end(job, "abort", message, 499)[0]

    def _fence(self, job: DecodeJob, message: str, status: int) -> TokenEvent:
        """Answer the client now but keep the pages: a remote write into them may still land.
        They are freed on the transfer's notification or ``PrefillFailed``, when the prefill
        worker is seen as a new process, or after ``transfer_fence_s``."""
        job.aborted = message
        job.fenced_at = time.monotonic()
        return TokenEvent(job.req.rid, finish_reason="abort", error=message, error_status=status)

    # ---- messages from prefill workers ---------------------------------------------------------
    def sockets(self):
        return self.peers.sockets()

    def handle(self, source, msg: Message, frames: list[bytes]) -> bool:
        peer = self.peers.on_message(source, msg) if not isinstance(source, bytes) else None
        if isinstance(msg, PrefillFailed):
            job = self.transfer.get((msg.room, msg.generation))
            if job is None:
                job = next((j for j in self.prealloc if j.key == (msg.room, msg.generation)), None)
            if job is not None:  # reported with the next step's events
                self.pending_events += self._fail(job, f"prefill failed: {msg.error}", msg.error_status)
            return True
        return peer is not None  # acks, heartbeat replies, token batches from a peer: liveness only

    # ---- the loop -----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.running or self.transfer or self.retracted or self.pending_events
                    or any(self.peers.get(j.prefill_addr).ready for j in self.prealloc))

    def step(self) -> list[TokenEvent]:
        events, self.pending_events = self.pending_events, []
        for peer in self.peers.tick():
            events += self._peer_died(peer.addr, peer.error)
        for peer in self.peers.restarted():
            self._release_fences(lambda j, a=peer.addr: j.prefill_addr == a, "prefill worker restarted")
        self._release_fences(lambda j: time.monotonic() - j.fenced_at > self.cfg.cluster.transfer_fence_s,
                             f"no answer within transfer_fence_s={self.cfg.cluster.transfer_fence_s:g}")
        events += self._poll_transfers()
        self._resume_retracted()
        events += self._admit()
        if self.running:
            events += self._decode_step()
        elif not self.transfer and not self.prealloc:
            self.ratio.idle()
        return events

    def _peer_died(self, addr: str, error: str) -> list[TokenEvent]:
        """Fail what waits on a dead (or restarted) prefill worker; transfers in flight are fenced."""
        events = []
        for job in [j for j in self.jobs.values() if j.prefill_addr == addr and j.phase in ("prealloc", "transfer")]:
            if job.phase == "prealloc":
                events += self._fail(job, error, 503)
            elif not job.aborted:
                events.append(self._fence(job, error, 503))
        return events

    def _release_fences(self, which, why: str) -> None:
        for job in [j for j in self.transfer.values() if j.aborted and which(j)]:
            log.warning("freeing the pages of %s room %d: %s", job.req.rid, job.room, why)
            del self.transfer[job.key]
            self._end(job, "abort", job.aborted, 499, emit=False)

    # ---- transfers ------------------------------------------------------------------------------
    def _poll_transfers(self) -> list[TokenEvent]:
        events = []
        for _peer, raw in self.transport.poll_notifs():
            m = parse_manifest(raw)
            job = self.transfer.get((m.room, m.generation)) if m else None
            if job is None:
                log.warning("notification for no pending transfer: %r", raw[:200])
                continue
            events += self._transfer_done(job, m)
        return events

    def _transfer_done(self, job: DecodeJob, m: TransferManifest) -> list[TokenEvent]:
        del self.transfer[job.key]
        log.debug("KV of %s room %d generation %d arrived", job.req.rid, job.room, job.generation)
        if job.aborted:
            return self._end(job, "abort", job.aborted, 499, emit=False)
        error = manifest_error(m, job, self.runner.page_size)
        if error:
            self.transfer_failures += 1
            return self._end(job, "abort", f"KV transfer rejected: {error}", 500)
        req = job.req
        req.kv_len = job.n_tokens
        req.status = ReqStatus.RUNNING
        job.enter("running")
        if job.generation > 0:  # recomputed KV: resume decoding from the last output token
            self.running.append(req)
            return []
        return self._first_token(job, m)

    def _first_token(self, job: DecodeJob, m: TransferManifest) -> list[TokenEvent]:
        req, tok = job.req, m.first_token
        req.sampler_state.append(tok)
        req.output_ids.append(tok)
        self.stats.generation_tokens += 1
        ev = TokenEvent(req.rid, [tok], [m.first_logprob], [m.first_top_logprobs],
                        prompt_tokens=len(req.prompt_ids), cached_tokens=job.decode_prefix_len)
        reason = check_stop(tok, req.params, self.eos, 1)
        if reason is None:
            self.running.append(req)
            return [ev]
        if reason == "stop":
            ev.token_ids, ev.logprobs, ev.top_logprobs = [], [], []
        ev.finish_reason = reason
        req.finish(reason)
        self._release(job, insert=True)
        return [ev]

    # ---- admission --------------------------------------------------------------------------
    def _admit(self) -> list[TokenEvent]:
        if self.retracted:
            return []  # resumes first: no new request takes pages while one waits to come back
        events, ratio = [], self.ratio.value
        in_flight = self.running + [j.req for j in self.transfer.values()]
        free = self.kv.available_pages() - running_reservation_pages(self.kv, in_flight, ratio)
        for job in list(self.prealloc):
            if len(self.running) + len(self.transfer) >= self.cfg.scheduler.max_running_requests:
                break
            peer = self.peers.get(job.prefill_addr)
            if peer.state in ("failed", "dead"):
                events += self._fail(job, peer.error or "prefill worker unavailable", 503)
                continue
            if not peer.ready:
                continue
            used = self._reserve(job, free, ratio)
            if used is None:
                break  # NO_TOKEN: FCFS, later requests must not overtake this one
            free -= used
            self.prealloc.remove(job)
            self._send_destination(job, peer)
        return events

    def _reserve(self, job: DecodeJob, free: int, ratio: float) -> int | None:
        """Match the decode radix prefix and take the prompt's pages; None if over budget."""
        req = job.req
        extra = self.kv.pages_for(req.seq_len + reserved_tokens(req, ratio)) - self.kv.pages_for(job.n_tokens)
        need = self.kv.reserve_prompt(req, job.n_tokens, max(0, extra), free)
        if need is not None:
            job.decode_prefix_len = req.kv_len
        return need

    def _send_destination(self, job: DecodeJob, peer) -> None:
        job.enter("transfer")
        self.transfer[job.key] = job
        req = job.req
        if job.generation > 0:
            self.peers.send(peer, PrefillRequest(rid=req.rid, room=job.room, generation=job.generation,
                                                 params=req.params, decode_worker=self.worker_id),
                            ids_frame(req.all_ids[:job.n_tokens]))
        log.debug("destination for %s room %d: %d pages", req.rid, job.room, len(req.pages))
        dest = KVDestination(rid=req.rid, room=job.room, generation=job.generation,
                             decode_prefix_len=job.decode_prefix_len, n_tokens=job.n_tokens)
        self.peers.send(peer, dest, np.asarray(req.pages, dtype="<i4").tobytes())

    # ---- decode and retract -----------------------------------------------------------------
    def _decode_step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        self.stats.decode_steps += 1
        interval = self.cfg.scheduler.retract_test_interval
        forced = bool(interval) and self.stats.decode_steps % interval == 0
        if forced or not check_decode_mem(self.kv, self.running, 1):
            events += self._retract(forced)
        if not self.running:
            return events
        for r in self.running:
            assert self.kv.ensure_pages(r, r.kv_len + 1), "check_decode_mem promised room for this step"
        for req, ev in self.executor.decode(self.running):
            self.stats.generation_tokens += 1
            if req.finished:
                self.running.remove(req)
                self._release(self.by_req[id(req)], insert=True)
            events.append(ev)
        self.ratio.step()
        return events

    def _retract(self, forced: bool) -> list[TokenEvent]:
        before_ratio, before_free = self.ratio.value, self.kv.available_pages()
        choices: dict[int, str] = {}

        def release(req: Request) -> None:
            job = self.by_req[id(req)]
            choices[id(req)] = self.retract.choose(job)
            if choices[id(req)] == "offload":
                self.retract.offload(job)
            else:
                self.kv.release(req, insert=False)

        res = retract_decode(self.kv, self.running, self.cfg.scheduler.retract_decode_steps, release, force_one=forced)
        self.running = res.kept
        for req in res.retracted:
            self._park(self.by_req[id(req)], choices[id(req)])
        events = [] if res.aborted is None else self._oom_abort(res.aborted)
        if res.retracted:
            ratio = self.ratio.reset_after_retract(sum(len(r.output_ids) for r in self.running), len(self.running),
                                                   sum(r.params.max_new_tokens for r in self.running))
            log.warning("retract %d requests (%s), %d pages freed, running %d, new_token_ratio %.4f -> %.4f",
                        len(res.retracted), ", ".join(f"{r.rid}:{choices[id(r)]}" for r in res.retracted),
                        self.kv.available_pages() - before_free, len(self.running), before_ratio, ratio)
        return events

    def _park(self, job: DecodeJob, how: str) -> None:
        req = job.req
        self.stats.retractions += 1
        self.stats.retracted_input_tokens += len(req.prompt_ids)
        self.stats.retracted_output_tokens += len(req.output_ids)
        req.retraction_count += 1
        req.retracted_stain = True
        if how == "offload":
            req.status = ReqStatus.RETRACTED
            job.enter("retracted")
            self.retracted.append(job)
            return
        self.retract.stats.recomputed += 1
        req.retraction_count -= 1  # reset_for_retract counts it
        req.reset_for_retract()
        job.generation += 1
        job.n_tokens = req.seq_len - 1
        job.enter("prealloc")
        self.prealloc.appendleft(job)

    def _resume_retracted(self) -> None:
        steps = self.cfg.scheduler.retract_decode_steps
        while self.retracted:
            job = self.retracted[0]
            reserve = decode_pages_needed(self.kv, self.running, steps)
            if not self.retract.can_resume(job, reserve, steps) or not self.retract.resume(job):
                return
            self.retracted.popleft()
            job.req.status = ReqStatus.RUNNING
            job.enter("running")
            self.running.append(job.req)

    def _oom_abort(self, req: Request) -> list[TokenEvent]:
        msg = OOM_ABORT_MESSAGE.format(seq_len=req.seq_len, capacity=self.runner.capacity_tokens)
        log.error("abort %s: %s", req.rid, msg)
        self.stats.oom_aborts += 1
        return self._end(self.by_req[id(req)], "abort", msg, 500)

    # ---- endings --------------------------------------------------------------------------
    def _fail(self, job: DecodeJob, error: str, status: int) -> list[TokenEvent]:
        if job.phase == "transfer":
            del self.transfer[job.key]
        if job.aborted:  # the client already got its answer
            return self._end(job, "abort", job.aborted, 499, emit=False)
        return self._end(job, "abort", error, status)

    def _end(self, job: DecodeJob, reason: str, error: str | None, status: int | None,
             emit: bool = True) -> list[TokenEvent]:
        req = job.req
        if job in self.prealloc:
            self.prealloc.remove(job)
        if job in self.retracted:
            self.retracted.remove(job)
        if req in self.running:
            self.running.remove(req)
        self.transfer.pop(job.key, None)
        self.retract.drop_host(job)
        req.finish(reason, error, status)
        self._release(job, insert=False)
        return [TokenEvent(req.rid, finish_reason=reason, error=error, error_status=status)] if emit else []

    def _release(self, job: DecodeJob, insert: bool) -> None:
        self.kv.release(job.req, insert=insert)
        job.enter("done")
        self.jobs.pop(job.req.rid, None)
        self.by_req.pop(id(job.req), None)
        if insert:
            self.stats.finished_requests += 1

    # ---- introspection --------------------------------------------------------------------
    def live_requests(self) -> list[Request]:
        return [j.req for j in self.jobs.values()]

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.retract.host is not None:
            self.retract.host.check_integrity([j.host_kv for j in self.jobs.values() if j.host_kv is not None])

    def histograms(self) -> dict:
        return {"retract_offload_seconds": self.retract.offload_seconds,
                "retract_resume_seconds": self.retract.resume_seconds}

    def snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        rs = self.retract.stats
        counters = self.base_counters()
        counters.update(transfer_failures=self.transfer_failures, retract_offload_bytes=rs.offload_bytes, retract_resumed=rs.resumed,
                        retract_recomputed=rs.recomputed, retract_offloaded=rs.offloaded)
        host = self.retract.host
        gauges = {**self.pool_gauges(), "queue_prealloc": len(self.prealloc), "queue_transfer": len(self.transfer),
                  "queue_running": len(self.running), "queue_retracted": len(self.retracted),
                  "new_token_ratio": self.ratio.value,
                  "host_kv_pool_bytes_used": host.used_pages() * host.page_bytes if host else 0,
                  "host_kv_pool_bytes_free": host.num_free() * host.page_bytes if host else 0}
        return counters, gauges
