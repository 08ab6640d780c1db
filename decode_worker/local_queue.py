"""The decode worker's own prefills (selective disaggregation; the decision is
``decode_worker.local_prefill``).

A request the policy takes waits here, FCFS, until ``select`` admits it the way a colocated
worker admits a prompt (``engine.scheduler.admission.Admission``: its cached prefix, pages for the
prompt and its ``new_token_ratio`` reservation within the headroom left by the running batch and
the transfers in flight) and hands out its chunks: each step's chunk is at most
``chunked_prefill_size`` tokens, and with ``mixed_batches`` what ``max_num_batched_tokens`` leaves
after the decode rows (``prefill_budget``), and what the step's time budget allows
(``prefill_step_s``, ``engine.scheduler.chunk_pace``: the chunk is sized from the rate of the
steps timed so far), so the decode batch's stall per step is bounded, and so is the wait of a
control message (a role switch, a drain, an abort) read between two steps. The
decode worker runs the chunk in the same forward as its decode rows (mixed batches) or as an
extend forward of its own right before them; a request whose prompt completes has its first token
sampled there by the same executor and sampler as every other token, and joins the running batch.

Counters: ``decisions`` (per ``LocalPrefillReason``: ``pdserve_local_prefill_total{reason}``) and
``tokens`` (prompt tokens computed here: ``pdserve_local_prefill_tokens_total``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

from cache.kv_budget import PageBudget
from cache.kv_manager import KVManager
from configs.scheduler import SchedulerConfig
from decode_worker.local_prefill import (
    LocalPrefillDecision,
    LocalPrefillInputs,
    LocalPrefillPolicy,
    LocalPrefillReason,
)
from engine.prompt_logprobs import wants_prompt_logprobs
from engine.request import Request
from engine.scheduler.admission import Admission, ExtendItem
from engine.scheduler.chunk_pace import ChunkPace
from engine.scheduler.mixed_step import prefill_budget
from engine.scheduler.stats import SchedulerStats

log = logging.getLogger(__name__)


class LocalPrefillQueue:
    """Decides (``consider``), queues and admits (``select``) the decode worker's own prefills."""

    def __init__(self, policy: LocalPrefillPolicy, cfg: SchedulerConfig, kv: KVManager, stats: SchedulerStats) -> None:
        self.policy, self.cfg, self.kv, self.stats = policy, cfg, kv, stats
        self.budget = PageBudget(kv)
        self.admission = Admission(cfg, kv, stats)
        self.pace = ChunkPace(cfg.prefill_step_s)
        self.waiting: deque[Request] = deque()
        self._suffix: dict[str, int] = {}  # rid -> uncached prompt tokens when taken, while waiting
        self.decisions: dict[LocalPrefillReason, int] = dict.fromkeys(LocalPrefillReason, 0)
        self.tokens = 0
        self._retractions_seen = 0
        self._last_retract_step: int | None = None

    # ---- the decision ---------------------------------------------------------------------------
    def observe(self) -> None:
        """Once per scheduler step: note the decode step of the latest retract."""
        if self.stats.retractions != self._retractions_seen:
            self._retractions_seen, self._last_retract_step = self.stats.retractions, self.stats.decode_steps

    def consider(
        self,
        req: Request,
        admitted: Callable[[], Iterable[Request]],
        ratio: float,
        retracted: int,
        prealloc: int,
        remote_backlog: Callable[[], int] = lambda: 0,
        rows: int = 0,
    ) -> LocalPrefillDecision | None:
        """Decide for new request ``req`` (None when the policy is off; nothing is counted then)
        and count the outcome; a taken request is queued here. ``admitted()``: the requests whose
        pages are reserved (running, in flight, being prefilled here; asked only when the policy is
        on); ``retracted`` and ``prealloc``: the lengths of the retracted and prealloc queues;
        ``remote_backlog()``: prompt tokens prefill workers still compute for this worker
        (``TransferTracker.backlog_tokens``; asked only when the policy has a backlog ratio);
        ``rows``: the running decode batch's size."""
        if not self.policy.enabled:
            return None
        n = len(req.prompt_ids)
        cached = (
            0
            if wants_prompt_logprobs(req) or self.kv.tree is None
            else self.kv.tree.match_prefix(req.prompt_ids[: n - 1]).num_tokens
        )  # what admission's match will give
        need = self.kv.pages_for(n) - self.kv.pages_for(cached) + self.budget.prompt_reservation(req, ratio).full
        since = None if self._last_retract_step is None else self.stats.decode_steps - self._last_retract_step
        x = LocalPrefillInputs(
            prompt_tokens=n,
            cached_tokens=cached,
            backlog_tokens=self.backlog_tokens,
            retracted_queue=retracted,
            steps_since_retract=since,
            prealloc_queue=prealloc,
            need_pages=need,
            headroom_pages=self.budget.headroom(admitted(), ratio).full,
            remote_backlog_tokens=remote_backlog() if self.policy.backlog_ratio > 0 else 0,
            decode_rows=rows,
        )
        d = self.policy.decide(x)
        self.decisions[d.reason] += 1
        log.debug("local prefill of %s: %s, %s", req.rid, d.reason, x)
        if d.local:
            req.mark("local_prefill")
            self.waiting.append(req)
            self._suffix[req.rid] = d.suffix_tokens
        return d

    def take_continuation(
        self, req: Request, admitted: Callable[[], Iterable[Request]], ratio: float, retracted: int, remote_backlog: int
    ) -> bool:
        """Whether continuation ``req`` (its output so far in ``req.output_ids``) has its recompute
        of prompt + output prefilled here rather than by a prefill worker; a taken one is queued.

        Taken when the policy is on, no retracted request waits, its uncached tokens plus the local
        backlog are at most ``remote_backlog`` (the prefill workers' backlog for this worker, which
        holds the continuations sent there before it) and its pages plus its decode reservation fit
        the headroom. When a decode worker dies, its streams arrive here as a burst of continuations:
        on one prefill worker each would wait for all of them (one batch, compute linear in its
        tokens); this splits the burst about evenly between the prefill worker and this one."""
        if not self.policy.enabled or retracted:
            return False
        ids, n = req.all_ids, req.seq_len
        cached = (
            0
            if wants_prompt_logprobs(req) or self.kv.tree is None
            else self.kv.tree.match_prefix(ids[: n - 1]).num_tokens
        )
        suffix = n - cached
        if self.backlog_tokens + suffix > remote_backlog:
            return False
        need = self.kv.pages_for(n) - self.kv.pages_for(cached) + self.budget.prompt_reservation(req, ratio).full
        if need > self.budget.headroom(admitted(), ratio).full:
            return False
        req.mark("local_prefill")
        self.waiting.append(req)
        self._suffix[req.rid] = suffix
        return True

    @property
    def backlog_tokens(self) -> int:
        """Prompt tokens not computed yet of the requests waiting here (their uncached suffix
        when taken) or being chunked."""
        chunked = self.admission.chunked
        return sum(self._suffix.values()) + (chunked.seq_len - chunked.kv_len if chunked else 0)

    # ---- the path -------------------------------------------------------------------------------
    def select(self, rows: int, admitted: Iterable[Request], ratio: float, admit_new: bool) -> list[ExtendItem]:
        """This step's prefill items beside ``rows`` decode rows, within the step's token and time
        budgets: the chunked request's next chunk, then (``admit_new``) waiting requests admitted
        against the headroom ``admitted`` (every request holding pages) leaves. Counts the tokens
        (here and as prefill compute); the caller times the step's forward (``timing``)."""
        waiting = self.waiting if admit_new else deque()
        cap = prefill_budget(self.cfg, rows) if self.cfg.mixed_batches else self.cfg.chunked_prefill_size
        budget = self.pace.tokens(cap, rows)
        items = self.admission.select(waiting, admitted, ratio, budget)
        for i in items:
            self._suffix.pop(i.req.rid, None)
        if items:
            n = sum(i.length for i in items)
            self.tokens += n
            self.stats.extend_steps += 1
            self.stats.prefill_computed_tokens += n
            self.stats.mixed_steps += bool(rows) and self.cfg.mixed_batches
        return items

    def timing(self, items: list[ExtendItem], rows: int) -> AbstractContextManager[None]:
        """Times the forward run inside it (``items`` beside ``rows`` decode rows, by the pace's
        ``clock``): the pace of the next chunks."""
        return self.pace.timing(sum(i.length for i in items), rows)

    def discard(self, req: Request) -> None:
        """``req`` ended (abort): it leaves the queue or stops being chunked."""
        if req in self.waiting:
            self.waiting.remove(req)
        self._suffix.pop(req.rid, None)
        self.admission.drop(req)

    @property
    def chunked(self) -> Request | None:
        """The request admitted and partly prefilled, if any (it holds pages)."""
        return self.admission.chunked

    def __bool__(self) -> bool:
        return bool(self.waiting or self.admission.chunked)

    def counters(self) -> dict[str, float]:
        """The worker counters: ``local_prefill_<reason>`` and ``local_prefill_tokens``."""
        out = {f"local_prefill_{r.value}": float(v) for r, v in self.decisions.items()}
        out["local_prefill_tokens"] = float(self.tokens)
        return out
