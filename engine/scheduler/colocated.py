"""Colocated (non-PD) scheduler: prefill and decode in one loop over one KV pool.

Each ``step()``: admit and run an extend batch if any waiting request fits (prefill first, as
SGLang does), otherwise run one decode step for the running batch. Under decode memory pressure
requests are retracted by dropping their KV (not cached) and requeued at the front of the waiting
queue for re-prefill of prompt + output so far; their output tokens and sampler state are kept.
"""
from __future__ import annotations

import logging
from collections import deque

from cache.kv_manager import KVManager
from configs.scheduler import SchedulerConfig
from engine.model_runner import ModelRunner
from engine.request import ReqStatus, Request
from engine.sampling import SamplerState, SamplingParams
from engine.scheduler.admission import Admission
from engine.scheduler.base import RequestRejected, WorkerScheduler, check_fits
from engine.scheduler.decode_memory import OOM_ABORT_MESSAGE, check_decode_mem, retract_decode
from engine.scheduler.events import TokenEvent
from engine.scheduler.executor import BatchExecutor
from engine.scheduler.ratio import NewTokenRatioTracker
from engine.scheduler.stats import SchedulerStats

log = logging.getLogger(__name__)


class ColocatedScheduler(WorkerScheduler):
    def __init__(self, runner: ModelRunner, cfg: SchedulerConfig, eos_token_ids: tuple[int, ...]) -> None:
        self.runner = runner
        self.cfg = cfg
        self.kv = KVManager(runner.allocator, runner.page_size, cfg.enable_radix_cache)
        self.admission = Admission(cfg, self.kv)
        self.executor = BatchExecutor(runner, eos_token_ids)
        self.ratio = NewTokenRatioTracker(cfg)
        self.stats = SchedulerStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    # ---- requests in and out -------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raise ``RequestRejected`` with the numbers if the request can never run here."""
        check_fits(prompt_len, max_new_tokens, self.capacity_tokens, self.max_model_len)

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request. Raises ``RequestRejected`` (nothing queued) if it can never fit."""
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        try:
            self.check_fits(len(prompt_ids), params.max_new_tokens)
        except RequestRejected:
            self.stats.rejected_requests += 1
            raise
        vocab = self.runner.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        req = Request(rid, list(prompt_ids), params, SamplerState.new(params, vocab, prompt_ids))
        self.requests[rid] = req
        self.stats.prompt_tokens += len(prompt_ids)
        self.waiting.append(req)
        return req

    def abort(self, rid: str, message: str = "request aborted") -> TokenEvent | None:
        """Abort wherever the request is; idempotent (unknown/finished ids return None)."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.admission.drop(req)
        self.kv.release(req, insert=False)
        req.finish("abort", message, 499)
        self.stats.aborted_requests += 1
        return TokenEvent(rid, finish_reason="abort", error=message, error_status=499)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.admission.chunked)

    def live_requests(self) -> list[Request]:
        return list(self.requests.values())

    # ---- one scheduling step --------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        items = self.admission.select(self.waiting, self.running, self.ratio.value)
        if items:
            self.stats.extend_steps += 1
            for it in items:
                self.stats.prefill_computed_tokens += it.length
            return self._collect(self.executor.extend(items))
        if self.running:
            return self._decode_step()
        self.ratio.idle()
        return []

    def _decode_step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        self.stats.decode_steps += 1
        forced = bool(self.cfg.retract_test_interval) and self.stats.decode_steps % self.cfg.retract_test_interval == 0
        if forced or not check_decode_mem(self.kv, self.running, 1):
            events.extend(self._retract(forced))
        if not self.running:
            return events
        for r in self.running:
            ok = self.kv.ensure_pages(r, r.kv_len + 1)
            assert ok, "check_decode_mem promised room for this step"
        events.extend(self._collect(self.executor.decode(self.running)))
        self.ratio.step()
        return events

    def _retract(self, forced: bool) -> list[TokenEvent]:
        before_ratio, before_free = self.ratio.value, self.kv.available_pages()
        res = retract_decode(self.kv, self.running, self.cfg.retract_decode_steps,
                             lambda r: self.kv.release(r, insert=False), force_one=forced)
        self.running = res.kept
        for r in reversed(res.retracted):
            self.stats.retractions += 1
            self.stats.retracted_input_tokens += len(r.prompt_ids)
            self.stats.retracted_output_tokens += len(r.output_ids)
            r.reset_for_retract()
            self.waiting.appendleft(r)
        events = []
        if res.aborted is not None:
            events.append(self._oom_abort(res.aborted))
        if res.retracted:
            ratio = self.ratio.reset_after_retract(
                sum(len(r.output_ids) for r in self.running), len(self.running),
                sum(r.params.max_new_tokens for r in self.running))
            log.warning("retract %d requests (%d pages freed), running %d, new_token_ratio %.4f -> %.4f",
                        len(res.retracted), self.kv.available_pages() - before_free, len(self.running),
                        before_ratio, ratio)
        return events

    def _oom_abort(self, req: Request) -> TokenEvent:
        msg = OOM_ABORT_MESSAGE.format(seq_len=req.seq_len, capacity=self.runner.capacity_tokens)
        log.error("abort %s: %s", req.rid, msg)
        self.kv.release(req, insert=False)
        req.finish("abort", msg, 500)
        self.requests.pop(req.rid, None)
        self.stats.oom_aborts += 1
        return TokenEvent(req.rid, finish_reason="abort", error=msg, error_status=500)

    def _collect(self, results) -> list[TokenEvent]:
        events = []
        for req, ev in results:
            self.stats.generation_tokens += 1
            if req.finished:
                self._finish(req)
            elif req.status is ReqStatus.RUNNING and req not in self.running:
                self.running.append(req)
            events.append(ev)
        return events

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv.release(req, insert=True)
        self.requests.pop(req.rid, None)
        self.stats.finished_requests += 1

    def snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        """(cumulative counters, current gauges) for metrics."""
        gauges = {**self.pool_gauges(), "queue_waiting": len(self.waiting), "queue_running": len(self.running),
                  "new_token_ratio": self.ratio.value}
        return self.base_counters(), gauges
