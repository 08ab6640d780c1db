"""The running (decode) batch of a worker: its requests, its ``new_token_ratio`` and one decode step.

``decode_step(release_victim)`` is the same in every mode: the forced-retract test interval,
``check_decode_mem``, ``retract_decode`` when short, page growth for the step, one forward pass,
the ratio's decay. Colocated and decode workers differ only in ``release_victim`` (drop the KV
and re-prefill later, or offload it to the host pool / recompute it): it frees the victim's
device pages at once and returns a word for the log line ("drop", "offload", "recompute").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from cache.kv_manager import KVManager
from configs.scheduler import SchedulerConfig
from engine.request import Phase, Release, Request
from engine.scheduler.base import Outcome
from engine.scheduler.decode_memory import OOM_ABORT_MESSAGE, check_decode_mem, retract_decode
from engine.scheduler.executor import BatchExecutor
from engine.scheduler.ratio import NewTokenRatioTracker
from engine.scheduler.stats import SchedulerStats
from transfer.wire.protocol import TokenDelta

log = logging.getLogger(__name__)

ReleaseVictim = Callable[[Request], Release]


@dataclass
class DecodeResult:
    """What one decode step did. ``finished`` requests left the batch but still hold their KV
    (the caller caches or frees it); ``retracted`` were released by ``release_victim`` (victim
    order); ``aborted`` is the last request that could not fit even alone: it left the batch
    with its KV still held, and the caller ends it with ``oom_outcome``."""

    tokens: list[tuple[Request, TokenDelta]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)
    aborted: Request | None = None


class RunningBatch:
    def __init__(self, kv: KVManager, executor: BatchExecutor, cfg: SchedulerConfig, stats: SchedulerStats) -> None:
        self.kv = kv
        self.executor = executor
        self.cfg = cfg
        self.stats = stats
        self.ratio = NewTokenRatioTracker(cfg)
        self.reqs: list[Request] = []

    def add(self, req: Request) -> None:
        req.status = Phase.RUNNING
        self.reqs.append(req)

    def discard(self, req: Request) -> None:
        if req in self.reqs:
            self.reqs.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.reqs)

    def __len__(self) -> int:
        return len(self.reqs)

    def decode_step(self, release_victim: ReleaseVictim, park_last: bool = False) -> DecodeResult:
        """Retract if the pool is short, then decode one token for every request left.

        ``park_last``: pages held elsewhere will come back on their own (transfers in flight), so a
        last request that cannot grow is retracted to wait for them instead of aborted."""
        res = self.prepare_decode(release_victim, park_last)
        if self.reqs:
            self.absorb(res, self.executor.decode(self.reqs))
        return res

    def prepare_decode(self, release_victim: ReleaseVictim, park_last: bool = False) -> DecodeResult:
        """The first half of a decode step (``decode_step``), for a caller that runs the forward
        itself (a mixed step): retract if short, then give every request left its page for this
        step. The requests to decode are ``self.reqs`` afterwards; pass their deltas to ``absorb``.
        With no request running it does nothing (no step is counted)."""
        res = DecodeResult()
        if not self.reqs:
            return res
        self.stats.decode_steps += 1
        interval = self.cfg.retract_test_interval
        forced = bool(interval) and self.stats.decode_steps % interval == 0
        if forced or not check_decode_mem(self.kv, self.reqs, 1):
            self._retract(forced, release_victim, res, park_last)
        for r in self.reqs:
            assert self.kv.ensure_pages(r.kv, r.kv_len + 1), "check_decode_mem promised room for this step"
        return res

    def absorb(self, res: DecodeResult, tokens: list[tuple[Request, TokenDelta]]) -> None:
        """The second half: take the step's decode ``tokens`` into ``res`` (finished requests leave
        the batch) and decay the ratio."""
        # a speculative row may bring several deltas: a finished request leaves on its last one (which
        # need not carry a finish reason: an abort during the step finishes it without one)
        last = {id(req): i for i, (req, _) in enumerate(tokens)}
        for i, (req, delta) in enumerate(tokens):
            self.stats.generation_tokens += 1
            res.tokens.append((req, delta))
            if req.finished and last[id(req)] == i:
                self.reqs.remove(req)
                res.finished.append(req)
        self.ratio.step()

    def _retract(self, forced: bool, release_victim: ReleaseVictim, res: DecodeResult, park_last: bool) -> None:
        before_ratio, before_free = self.ratio.value, self.kv.available_pages()
        how: dict[str, Release] = {}

        def release(req: Request) -> None:
            how[req.rid] = release_victim(req)

        r = retract_decode(
            self.kv,
            self.reqs,
            self.cfg.retract_decode_steps,
            release,
            force_one=forced,
            park_last=park_last,
            retract_order=self.cfg.retract_order,
        )
        self.reqs, res.retracted, res.aborted = r.kept, r.retracted, r.aborted
        for v in r.retracted:
            self.stats.retractions += 1
            self.stats.retracted_input_tokens += len(v.prompt_ids)
            self.stats.retracted_output_tokens += len(v.output_ids)
        if r.retracted:
            ratio = self.ratio.reset_after_retract(
                sum(len(q.output_ids) for q in self.reqs),
                len(self.reqs),
                sum(q.params.max_new_tokens for q in self.reqs),
            )
            log.warning(
                "retract %d requests (%s), %d pages freed, running %d, new_token_ratio %.4f -> %.4f",
                len(r.retracted),
                ", ".join(f"{v.rid}:{how[v.rid]}" for v in r.retracted),
                self.kv.available_pages() - before_free,
                len(self.reqs),
                before_ratio,
                ratio,
            )

    def oom_outcome(self, req: Request) -> Outcome:
        """The abort of the last request that cannot fit (counted and logged here)."""
        msg = OOM_ABORT_MESSAGE.format(seq_len=req.seq_len, capacity=self.executor.runner.capacity_tokens)
        log.error("abort %s: %s", req.rid, msg)
        self.stats.oom_aborts += 1
        return Outcome.abort(msg, 500)
