"""Colocated (non-PD) scheduler: prefill and decode in one loop over one KV pool.

Each ``step()`` with ``mixed_batches``: one forward of every running request's
next token plus a chunk of prefill in the tokens left (``engine.scheduler.mixed_step``). Without:
an extend batch if any waiting request fits (prefill first, as SGLang does), otherwise one
``RunningBatch.decode_step``. Retract victims drop their own KV (not cached) and go back to the front
of the waiting queue for re-prefill of prompt + output so far; their output tokens and sampler
state are kept.

Insert on prefill: when a request's prefill completes, the full pages of what it computed go to the
radix cache at once (``cache.prefix_share``), locked by the request, instead of only when it
finishes. The choices of an ``n`` > 1 request (the router sends the others once the first has its
first token) and any request with the same prefix then match those pages and compute only the rest
(at most the last page), each with its own pages from there on (copy on write at the last partial
page). A retracted or aborted request keeps nothing locked; the prefix stays cached (evictable).
"""

from __future__ import annotations

from collections import deque

from cache.handle import KVHandle
from cache.prefix_share import share_prefix
from configs.scheduler import SchedulerConfig
from engine.model_runner import ModelRunner
from engine.request import Phase, Release, Request
from engine.scheduler.admission import Admission
from engine.scheduler.base import Outcome, RequestRejected, Snapshot, WorkerScheduler, check_resume, sampler_state
from engine.scheduler.executor import BatchExecutor
from engine.scheduler.mixed_step import MixedStep
from engine.scheduler.running_batch import DecodeResult, RunningBatch
from engine.scheduler.step_report import StepReport
from engine.scheduler.timeline import Timeline
from engine.spec.verify import speculator_for
from transfer.wire.enums import Role
from transfer.wire.outbox import Outbox
from transfer.wire.protocol import GenerateRequest, Message, TokenDelta


class ColocatedScheduler(WorkerScheduler):
    role = Role.COLOCATED

    def __init__(self, runner: ModelRunner, cfg: SchedulerConfig, eos_token_ids: tuple[int, ...]) -> None:
        super().__init__(runner, runner.make_kv_manager(cfg.enable_radix_cache))
        self.cfg = cfg = cfg.for_device(runner.device.type)
        self.admission = Admission(cfg, self.kv, self.stats)
        self.spec = speculator_for(cfg, self.kv, runner.max_model_len)
        self.executor = BatchExecutor(runner, eos_token_ids, self.kv, self.spec)
        self.running = RunningBatch(self.kv, self.executor, cfg, self.stats)
        self.mixed = MixedStep(self.running, self.admission, cfg)
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.timeline = Timeline(self.role)

    # ---- requests in and out -------------------------------------------------------------
    def add(self, owner: bytes, msg: GenerateRequest, prompt: list[int]) -> Outbox:
        if msg.rid in self.requests:
            raise RequestRejected(f"duplicate request id {msg.rid!r}")
        self.reject_if_unfit(
            len(prompt),
            msg.params.max_new_tokens,
            swa_tokens=self.budget.prefill_swa_tokens(len(prompt), self.cfg.chunked_prefill_size),
        )
        vocab = self.runner.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")
        check_resume(msg)
        resumed = list(msg.resume_output_ids)
        state = sampler_state(self.runner, msg.params, prompt, resumed)
        # a continuation waits as a retracted request does: its prefill covers prompt + output so far
        req = Request(
            msg.rid, list(prompt), msg.params, state, owner=owner, output_ids=resumed, continuation=bool(resumed)
        )
        self.requests[req.rid] = req
        self.stats.prompt_tokens += len(prompt)
        self.waiting.append(req)
        return Outbox()

    def abort(self, rid: str, reason: str = "request aborted") -> Outbox:
        req = self.requests.get(rid)
        if req is None:
            return Outbox()
        self.stats.aborted_requests += 1
        return self.finish(req, Outcome.abort(reason, 499))

    def finish(self, req: Request, outcome: Outcome) -> Outbox:
        """The one way a request ends: leave every queue, cache or free the KV, say so."""
        self.requests.pop(req.rid, None)
        if req in self.waiting:
            self.waiting.remove(req)
        self.running.discard(req)
        self.admission.drop(req)
        if outcome.completed:
            self.kv.free_into_cache(req.kv, req.all_ids[: req.kv_len])
            self.stats.finished_requests += 1
        else:
            self.kv.free(req.kv)
        req.finish(outcome.reason)
        self.timeline.done(req)
        out = Outbox()
        if not outcome.completed:
            out.token(req.owner, outcome.delta(req.rid))
        return out

    def handle(self, source, msg: Message, frames: list[bytes]) -> Outbox | None:
        return None  # a colocated worker takes no worker-to-worker messages

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.admission.chunked)

    def idle_wait_s(self) -> float | None:
        return None

    def live_handles(self) -> list[KVHandle]:
        return [r.kv for r in self.requests.values()]

    def held_rids(self) -> set[str]:
        return set(self.requests)

    # ---- one scheduling step --------------------------------------------------------------
    def step(self) -> StepReport:
        if self.cfg.mixed_batches:
            return self._mixed_step()
        items = self.admission.select(self.waiting, self.running, self.running.ratio.value)
        if items:
            self.stats.extend_steps += 1
            self.stats.prefill_computed_tokens += sum(it.length for it in items)
            return StepReport(self._collect(self.executor.extend(items)))
        if not self.running:
            self.running.ratio.idle()
            return StepReport()
        res = self.running.decode_step(self._drop_victim)
        out = self._released(res)
        out.extend(self._decoded(res))
        return StepReport(out)

    def _mixed_step(self) -> StepReport:
        """Decode rows first (retract if short), then prefill in the step's tokens left, one forward."""
        idle = not self.running
        prepared = self.running.prepare_decode(self._drop_victim)
        out = self._released(prepared)
        res = self.mixed.run(prepared, self.waiting)
        if not res.ran:
            if idle:  # as a step apart: a retract that emptied the batch keeps the ratio it set
                self.running.ratio.idle()
            return StepReport(out)
        out.extend(self._decoded(res.decode))
        out.extend(self._collect(res.extended))
        return StepReport(out)

    def _released(self, res: DecodeResult) -> Outbox:
        """Retract victims back to the front of the waiting queue; the OOM-aborted request ended."""
        for r in reversed(res.retracted):
            r.reset_for_retract()
            self.waiting.appendleft(r)
        out = Outbox()
        if res.aborted is not None:
            out.extend(self.finish(res.aborted, self.running.oom_outcome(res.aborted)))
        return out

    def _decoded(self, res: DecodeResult) -> Outbox:
        """The decode rows' deltas out; the requests they finished ended."""
        out = Outbox()
        for req, delta in res.tokens:
            out.token(req.owner, delta)
        for req in res.finished:
            self.finish(req, Outcome(req.finish_reason))
        return out

    def _drop_victim(self, req: Request) -> Release:
        self.kv.free(req.kv)
        return Release.DROP

    def _collect(self, results: list[tuple[Request, TokenDelta]]) -> Outbox:
        out = Outbox()
        for req, delta in results:
            self.stats.generation_tokens += 1
            out.token(req.owner, delta)
            if req.finished:
                self.finish(req, Outcome(req.finish_reason))
            elif req.status is Phase.RUNNING:
                share_prefix(self.kv, req.kv, req.all_ids[: req.kv_len])
                self.running.add(req)
        return out

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        snap.gauges.update(
            queue_waiting=len(self.waiting), queue_running=len(self.running), new_token_ratio=self.running.ratio.value
        )
        snap.histograms.update(self.timeline.histograms)
        if self.spec is not None:
            counters, histograms = self.spec.series()
            snap.counters.update(counters)
            snap.histograms.update(histograms)
        return snap
