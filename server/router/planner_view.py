"""The planner's ``ClusterView`` built from the workers' ``WorkerStats`` heartbeats (rates over time).

``ViewBuilder.build(handles, queue_wait, now)`` keeps each worker's recent heartbeats (of the same
process instance) and derives:

- prefill speed = computed prompt tokens (``prefill_computed_tokens``) / seconds of the forwards
  that computed them (``prefill_compute_seconds``), over the last ``window_s`` of heartbeats. Both
  counters move together at every prefill step, so any window is exact, and a batch of several
  prompts counts its time once. A worker that reports no forward seconds falls back to the per
  request compute time (the ``phase_prefill_compute`` histogram's sum: observed when a prompt
  completes, and once per prompt of a shared batch, so it under-estimates the speed). With nothing
  computed in the window: the cumulative ratio.
- the typical prompt: the mean of the prompts the worker holds whole (``queue_waiting`` +
  ``queue_bootstrap``; the one part-way through its chunks, ``queue_prefilling``, counts at its
  rest: ``prefill_backlog_tokens`` over them all) when it holds one: they are the latest arrivals,
  so the figure follows a change of the load at once. Otherwise computed tokens / prompts
  completed (the histogram's count), summed over the heartbeats at which prompts completed, the
  earlier sums at half weight per ``prompt_half_life`` prompts completed since: recent prompts weigh
  more (a 10 s window trailed a phase change by 10 s, and by count: many short prompts outweighed
  the first long ones), and tokens are folded in only at a completion, so a prompt part-way through
  its chunks (between two heartbeats a completion meets only its last chunk's tokens) is off by at
  most a prompt's part, averaged over a few. (Weights halving every 3 s instead read 17,349-token
  prompts of 1,800 on a loaded host, where a prompt took longer than the half-life.) The first
  heartbeat of a worker instance: the cumulative ratio.
- decode step time = seconds between the two latest heartbeats / decode steps made between them,
  only when the worker ran requests at both (``queue_running`` > 0) and they are at most
  ``max_step_gap_s`` apart: an idle stretch in between, or a stretch the router did not see the
  worker through (not ready, switching roles, starved of CPU), would count as step time (one step
  across a starved worker's 35 s gap once predicted a 35 s TPOT). Otherwise the last measured
  value while it keeps running requests (none after an over-long gap), else None.
- a decode worker's own prefill (selective disaggregation): ``local_prefill_tokens`` computed per
  second of the window (wall time: what it gave, not what it could give), its
  ``local_prefill_backlog_tokens`` gauge and its ``local_prefill_backlog_ratio`` (the policy's R).
- backlog = the prefill worker's ``prefill_backlog_tokens`` gauge; batch = ``queue_running``; awaiting =
  a decode worker's ``queue_prealloc`` + ``queue_transfer`` + ``queue_local_prefill`` (requests not
  running yet: a switch to prefill waits for them); page_waiting = its ``queue_prealloc`` (waiting for
  pages: a full pool); finish_rate = a decode worker's requests ended (``finished_requests`` +
  ``aborted_requests``) per second of the window, page_growth = the change of its page_waiting per
  second of the window.

``queue_wait``: the router's admission queue wait histogram as (sum, count); the view carries its
mean over the forwarded requests since the previous build (0 when none).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from server.router.planner import ClusterView, WorkerView
from server.router.workers import READY, WorkerHandle
from transfer.wire.enums import Role


@dataclass(frozen=True)
class _Sample:
    """One worker's heartbeat values the rates are taken between."""

    instance: str
    at: float
    tokens: float
    busy_s: float
    compute_s: float
    prompts: float
    steps: float
    batch: float
    step_s: float | None
    held: float = 0.0  # whole prompts held: waiting + bootstrapping
    held_tokens: float = 0.0  # prompt tokens held, not computed yet (the chunked one's rest included)
    chunking: float = 0.0  # prompts part-way through their chunks
    awaiting: float = 0.0  # a decode worker's requests not running yet (pages, KV, its own prefill)
    page_waiting: float = 0.0  # those of them waiting for pages
    local_tokens: float = 0.0  # prompt tokens a decode worker prefilled itself (cumulative)
    local_backlog: float = 0.0  # prompt tokens it holds for its own prefill, not computed yet
    local_ratio: float = 0.0  # its --local-prefill-backlog-ratio (> 0: it prefills behind a backlog)
    finished: float = 0.0  # requests that ended here (cumulative: finished and aborted)


@dataclass(frozen=True)
class _Decayed:
    """Computed tokens and completed prompts summed over the heartbeats at which prompts completed,
    the earlier sums at half weight per ``half_life`` prompts completed since; ``at_tokens`` and
    ``at_prompts``: the counters at the last such heartbeat."""

    tokens: float
    prompts: float
    at_tokens: float
    at_prompts: float

    def after(self, cur: _Sample, half_life: float) -> _Decayed:
        """These sums with ``cur``'s heartbeat folded in when prompts completed since the last
        fold (tokens computed meanwhile wait for a completion: a prompt part-way through counts
        once it completes, so a slow host's long prompts do not inflate the figure)."""
        done = cur.prompts - self.at_prompts
        if done <= 0:
            return self
        w = 0.5 ** (done / half_life) if self.prompts > 0 else 1.0  # tokens before any completion: the first prompt's
        tokens = self.tokens * w + cur.tokens - self.at_tokens
        return _Decayed(tokens, self.prompts * w + done, cur.tokens, cur.prompts)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 and num > 0 else None


RATE_WINDOW_S = 10.0  # long enough for several long prompts, short against a phase of the load
PROMPT_HALF_LIFE = 4.0  # prompts: few enough that a phase change fades within a few, enough to average chunks
MAX_STEP_GAP_S = 10.0  # a few evaluations of the default 5 s period; the router passes its own


class ViewBuilder:
    """Builds ``ClusterView``s; keeps every worker's heartbeats of the last ``window_s`` (at least
    the previous one), its decayed prompt sums and the previous queue wait."""

    def __init__(
        self,
        window_s: float = RATE_WINDOW_S,
        prompt_half_life: float = PROMPT_HALF_LIFE,
        max_step_gap_s: float = MAX_STEP_GAP_S,
    ) -> None:
        self.window_s, self.prompt_half_life, self.max_step_gap_s = window_s, prompt_half_life, max_step_gap_s
        self._prev: dict[str, tuple[_Sample, tuple[WorkerView, float | None]]] = {}
        self._history: dict[str, deque[_Sample]] = {}
        self._prompts: dict[str, _Decayed] = {}
        self._wait = (0.0, 0.0)

    def build(
        self,
        handles: Iterable[WorkerHandle],
        queue_wait: tuple[float, float],
        now: float,
        first_token_wait_s: float = 0.0,
    ) -> ClusterView:
        """The view of the ready prefill and decode workers of ``handles`` at ``now`` (module docstring);
        ``first_token_wait_s``: the router's longest wait of a request in flight for its first token."""
        workers, prompt_rates = [], []
        for h in handles:
            if h.state != READY or h.stats is None or h.spec.role not in (Role.PREFILL, Role.DECODE):
                continue
            view, prompt = self._worker(h)
            workers.append(view)
            if prompt is not None:
                prompt_rates.append(prompt)
        dsum, dcount = queue_wait[0] - self._wait[0], queue_wait[1] - self._wait[1]
        self._wait = queue_wait
        wait = dsum / dcount if dcount > 0 else 0.0
        prompt = sum(prompt_rates) / len(prompt_rates) if prompt_rates else 0.0
        return ClusterView(
            now=now,
            workers=tuple(workers),
            queue_wait_s=wait,
            prompt_tokens=prompt,
            first_token_wait_s=first_token_wait_s,
        )

    def _worker(self, h: WorkerHandle) -> tuple[WorkerView, float | None]:
        """(``h``'s view, its typical prompt tokens or None) from its stats and previous sample;
        without a heartbeat since the previous build, the previous answer."""
        cur = _sample(h)
        prev, seen = self._prev.get(h.worker_id, (None, None))
        if prev is not None and prev.instance == cur.instance and cur.at <= prev.at:
            return seen
        base = prev if prev is not None and prev.instance == cur.instance else None
        history = self._history.setdefault(h.worker_id, deque())
        if base is None:
            history.clear()
        decayed = _Decayed(cur.tokens, cur.prompts, cur.tokens, cur.prompts)
        if base is not None and h.worker_id in self._prompts:
            decayed = self._prompts[h.worker_id].after(cur, self.prompt_half_life)
        self._prompts[h.worker_id] = decayed
        if h.spec.role == Role.DECODE:
            cur = replace(cur, step_s=_step_s(base, cur, self.max_step_gap_s))
            answer = _decode(h, _window_base(history, cur.at - self.window_s), cur), None
        else:
            view = _prefill(h, _window_base(history, cur.at - self.window_s), cur)
            answer = view, _typical_prompt(cur, decayed)
        history.append(cur)
        self._prev[h.worker_id] = (cur, answer)
        return answer


def _window_base(history: deque[_Sample], since: float) -> _Sample | None:
    """The oldest sample at or after ``since`` (older ones are dropped), else the latest one; None
    when there is none."""
    while len(history) > 1 and history[0].at < since:
        history.popleft()
    return history[0] if history else None


def _sample(h: WorkerHandle) -> _Sample:
    """``h``'s latest heartbeat values."""
    s = h.stats
    hist = s.histograms.get("phase_prefill_compute")
    compute_s, prompts = (hist.sum, float(sum(hist.counts))) if hist is not None else (0.0, 0.0)
    return _Sample(
        instance=h.instance,
        at=h.stats_at or 0.0,
        tokens=s.counters.get("prefill_computed_tokens", 0.0),
        busy_s=s.counters.get("prefill_compute_seconds", 0.0),
        compute_s=compute_s,
        prompts=prompts,
        steps=s.counters.get("decode_steps", 0.0),
        batch=s.gauges.get("queue_running", 0.0),
        step_s=None,
        held=s.gauges.get("queue_waiting", 0.0) + s.gauges.get("queue_bootstrap", 0.0),
        held_tokens=s.gauges.get("prefill_backlog_tokens", 0.0),
        chunking=s.gauges.get("queue_prefilling", 0.0),
        awaiting=sum(s.gauges.get(q, 0.0) for q in ("queue_prealloc", "queue_transfer", "queue_local_prefill")),
        page_waiting=s.gauges.get("queue_prealloc", 0.0),
        local_tokens=s.counters.get("local_prefill_tokens", 0.0),
        local_backlog=s.gauges.get("local_prefill_backlog_tokens", 0.0),
        local_ratio=s.gauges.get("local_prefill_backlog_ratio", 0.0),
        finished=s.counters.get("finished_requests", 0.0) + s.counters.get("aborted_requests", 0.0),
    )


def _typical_prompt(cur: _Sample, decayed: _Decayed) -> float | None:
    """The mean prompt held when the worker holds a whole one, else the decayed completions'
    tokens per prompt (module docstring)."""
    if cur.held >= 1:
        return cur.held_tokens / (cur.held + cur.chunking)
    return _ratio(decayed.tokens, decayed.prompts)


def _prefill(h: WorkerHandle, base: _Sample | None, cur: _Sample) -> WorkerView:
    """A prefill worker's view: its speed since ``base`` (the window's oldest heartbeat) when it
    computed since, else cumulative (module docstring)."""
    zero = _Sample(cur.instance, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, None)
    if cur.busy_s > 0:  # forward seconds reported: exact over any window
        b = base if base is not None and cur.busy_s > base.busy_s else zero
        tps = _ratio(cur.tokens - b.tokens, cur.busy_s - b.busy_s)
    else:  # per prompt compute time: only over a window in which a prompt completed
        b = base if base is not None and cur.compute_s > base.compute_s else zero
        tps = _ratio(cur.tokens - b.tokens, cur.compute_s - b.compute_s)
    return WorkerView(h.worker_id, Role.PREFILL, backlog_tokens=cur.held_tokens, prefill_tps=tps)


def _decode(h: WorkerHandle, base: _Sample | None, cur: _Sample) -> WorkerView:
    """A decode worker's view: its batch, step time, awaiting requests, and its own prefill: the
    prompt tokens it computed per second since ``base`` (the window's oldest heartbeat; None with
    no earlier heartbeat) and the ones it holds; the requests that ended per second and the growth
    of its page-waiting queue per second since ``base``."""
    local = finish = None
    growth = 0.0
    if base is not None and cur.at > base.at:
        span = cur.at - base.at
        local = (cur.local_tokens - base.local_tokens) / span
        finish = (cur.finished - base.finished) / span
        growth = (cur.page_waiting - base.page_waiting) / span
    return WorkerView(
        h.worker_id,
        Role.DECODE,
        batch=cur.batch,
        step_s=cur.step_s,
        awaiting=cur.awaiting,
        page_waiting=cur.page_waiting,
        local_tps=local,
        local_backlog=cur.local_backlog,
        local_ratio=cur.local_ratio,
        finish_rate=finish,
        page_growth=growth,
    )


def _step_s(prev: _Sample | None, cur: _Sample, max_gap_s: float) -> float | None:
    """Seconds per decode step between ``prev`` and ``cur`` when both ran requests and they are at
    most ``max_gap_s`` apart; the previous measure while it runs requests without a step since;
    None when idle, unmeasured or after an over-long gap."""
    if cur.batch <= 0 or prev is None or cur.at - prev.at > max_gap_s:
        return None
    if prev.batch > 0 and cur.steps > prev.steps:
        return (cur.at - prev.at) / (cur.steps - prev.steps)
    return prev.step_s
