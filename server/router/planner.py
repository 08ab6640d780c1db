"""The SLO planner's decision: which worker, if any, should change role now (a pure function).

``decide(view, state, knobs)`` reads a ``ClusterView`` (the ready prefill and decode workers with
their measured load) and returns a ``Decision``: a move (worker, old role, new role) or none, why,
the predictions it was made on, and the planner's next ``PlannerState``. It changes nothing.

The model (``docs/design/planner.md``):

- **TTFT** = the router's admission queue wait + the prefill backlog (prompt tokens the prefill
  workers hold, not computed yet, and those decode workers hold for their own prefill) / the
  summed prefill speed (tokens/s) + a typical prompt / one prefill worker's speed (its own
  prefill). Queueing is in: a backlog twice as long predicts twice the wait. The summed speed
  counts decode workers that prefill prompts themselves (selective disaggregation,
  ``helper_speed``): at a prefill worker's speed when their policy would take a typical prompt
  behind the current backlog, else at the rate they did over the view's window. Spare decode
  capacity is prefill capacity already in use, and a decode worker that becomes a prefill worker
  adds only what it was not giving yet. A request in flight that has waited longer for its first
  token than predicted sets the TTFT instead: waits the model does not see (a decode worker's pool
  full of running requests, where first tokens wait for pages) count as they happen.
- **TPOT** = the longest decode step among the decode workers (each step yields one token per
  running request). Moving a decode worker away spreads its running requests over the others,
  whose step times grow affinely with rows (``step_at``: a fixed part worth ``STEP_FIXED_ROWS``
  rows plus a per-row part).

Rules: TTFT over its SLO while TPOT is within it -> a decode worker becomes a prefill worker, if the
TPOT predicted without it stays within ``headroom`` x its SLO and, as a prefill worker, it would add
at least ``MIN_SPEED_GAIN`` of the summed prefill speed (a decode worker already prefilling at a
prefill worker's pace adds nothing by switching); the reverse for TPOT. A TTFT
violation while a decode worker holds more requests waiting for KV pages (its pool full of running
requests) than requests awaiting their KV is decode-bound: the first tokens wait for decode room,
not for prefill compute, so a prefill worker becomes a decode worker (no TTFT headroom check: TTFT
is what the move is to cut); with TPOT over its SLO too, both violations are the decode side's and
the same move is made. A violation must be seen ``hysteresis`` evaluations in a row, no move
is made within ``dwell_s`` of the last one, both SLOs violated otherwise (or both met, or a prediction
unknown) moves nothing, and no move leaves a role without a ready worker. Where the workers share
one host's cores (``Knobs.shared_cores``) a move adds no compute: a TTFT or TPOT violation moves
nothing (the decode-bound rule still moves a worker: it adds decode pages, not compute). Among the candidates
within the headroom, the worker with the fewest requests awaiting their KV wins (it can leave
soonest), then the one whose leaving predicts the other metric best (ties: fewer running rows or
backlog, then the worker id).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transfer.wire.enums import Role


@dataclass(frozen=True)
class WorkerView:
    """One ready PD worker as the planner sees it. Prefill: ``backlog_tokens`` (prompt tokens held,
    not computed yet) and ``prefill_tps`` (measured tokens/s; None: not measured yet). Decode:
    ``batch`` (running requests), ``step_s`` (measured seconds per decode step; None: not
    measured, e.g. idle), ``awaiting`` (requests it holds that do not run yet: waiting for
    pages, for their KV from a prefill worker or for its own prefill; a switch away from decode
    waits until each has landed and left), ``page_waiting`` (those of them waiting for pages:
    its pool is full), ``local_tps`` (prompt tokens it prefilled itself per second of the view's
    window; None or 0: none), ``local_backlog`` (prompt tokens it holds for its own prefill, not
    computed yet) and ``local_ratio`` (its ``--local-prefill-backlog-ratio``: > 0, it takes prompts
    off a prefill backlog, ``decode_worker.local_prefill``); ``finish_rate`` (requests that ended
    per second of the view's window: the rate pages come free; None: not measured) and
    ``page_growth`` (the change of ``page_waiting`` per second of the window)."""

    worker_id: str
    role: Role
    backlog_tokens: float = 0.0
    prefill_tps: float | None = None
    batch: float = 0.0
    step_s: float | None = None
    awaiting: float = 0.0
    page_waiting: float = 0.0
    local_tps: float | None = None
    local_backlog: float = 0.0
    local_ratio: float = 0.0
    finish_rate: float | None = None
    page_growth: float = 0.0


@dataclass(frozen=True)
class ClusterView:
    """The cluster at time ``now`` (monotonic s): its ready prefill and decode ``workers``, the
    router's recent mean admission queue wait (s), the recent mean prompt tokens computed per
    request (uncached part) and the longest a request in flight has waited for its first token
    since it was forwarded (s)."""

    now: float
    workers: tuple[WorkerView, ...]
    queue_wait_s: float = 0.0
    prompt_tokens: float = 0.0
    first_token_wait_s: float = 0.0

    def of(self, role: Role) -> list[WorkerView]:
        """The workers of ``role``."""
        return [w for w in self.workers if w.role == role]


@dataclass(frozen=True)
class Knobs:
    """The SLOs (seconds) and the planner's damping: ``hysteresis`` evaluations a violation must
    last, ``dwell_s`` after any move, ``headroom`` (0-1] of the other SLO a move may use;
    ``shared_cores``: the workers share one host's cores (lending them to whichever is busy), so a
    move adds no compute to the role it joins; ``horizon_s``: how far ahead a growing wait for decode
    pages is projected (``decode_wait``; the planner's own reaction time: hysteresis x interval)."""

    slo_ttft_s: float
    slo_tpot_s: float
    hysteresis: int = 3
    dwell_s: float = 60.0
    headroom: float = 0.8
    shared_cores: bool = False
    horizon_s: float = 0.0


@dataclass(frozen=True)
class PlannerState:
    """What the planner carries between evaluations: consecutive evaluations with TTFT alone
    violated, with TPOT alone violated, and when it last moved a worker (None: never)."""

    ttft_streak: int = 0
    tpot_streak: int = 0
    last_move_at: float | None = None


@dataclass(frozen=True)
class Decision:
    """One evaluation's outcome: ``move`` (worker id, old role, new role) or None, ``why`` in
    words, the predictions (s; None: unknown) and the state for the next evaluation."""

    move: tuple[str, Role, Role] | None
    why: str
    ttft_s: float | None
    tpot_s: float | None
    state: PlannerState
    after_s: float | None = None  # the other metric predicted after the move (or the best candidate's)


def predict_ttft(
    prefill: list[WorkerView],
    queue_wait_s: float,
    prompt_tokens: float,
    handed_tokens: float = 0.0,
    helpers: list[WorkerView] = (),
) -> float | None:
    """Queue wait + backlog / summed speed + one prompt / mean speed; None without a measured speed.
    A worker not measured yet (one that just became a prefill worker) counts at the mean measured
    speed: its backlog is in the sum, so leaving its speed out would predict its prompts at the
    others' pace on top of their own. ``handed_tokens``: the backlog of a prefill worker that leaves
    (it gives back its prompts, ``prefill_worker.switch_away``), added to theirs. ``helpers``:
    decode workers, whose own prefill (``helper_speed``, ``local_backlog``) adds to the speed and
    the backlog."""
    mean = mean_prefill_speed(prefill)
    if mean is None:
        return None
    queued = handed_tokens + sum(w.backlog_tokens for w in prefill)
    speed = sum(w.prefill_tps or mean for w in prefill)
    speed += sum(helper_speeds(helpers, mean, queued, prompt_tokens).values())
    backlog = queued + sum(h.local_backlog for h in helpers)
    return queue_wait_s + backlog / speed + prompt_tokens / mean


def mean_prefill_speed(prefill: list[WorkerView]) -> float | None:
    """The prefill workers' mean measured speed (tokens/s); None when none is measured."""
    measured = [w.prefill_tps for w in prefill if w.prefill_tps]
    return sum(measured) / len(measured) if measured else None


def helper_speeds(decode: list[WorkerView], mean: float, queued: float, prompt_tokens: float) -> dict[str, float]:
    """``helper_speed`` of each decode worker by id, each behind an even share of ``queued`` (the
    prefill workers' backlog)."""
    return {d.worker_id: helper_speed(d, mean, queued / len(decode), prompt_tokens) for d in decode}


def helper_speed(d: WorkerView, mean: float, remote_backlog: float, prompt_tokens: float) -> float:
    """The prefill speed decode worker ``d`` gives by prefilling prompts itself: ``mean`` (a prefill
    worker's) while it holds prompts of its own to prefill (``local_backlog``: it computes them now)
    or when its policy would take a typical prompt of ``prompt_tokens`` behind ``remote_backlog``
    (its share of the prefill workers' backlog), the worker's own rule ``remote >= R * (own backlog
    + prompt * (1 + rows))`` (``decode_worker.local_prefill``); else what it prefilled over the
    window (``local_tps``). Its measured rate alone reads the policy's rationing (it takes a prompt
    only once a backlog is there) as a lack of speed."""
    measured = d.local_tps or 0.0
    takes = d.local_ratio > 0 and prompt_tokens > 0
    if d.local_backlog > 0 or (
        takes and remote_backlog >= d.local_ratio * (d.local_backlog + prompt_tokens * (1 + d.batch))
    ):
        return max(measured, mean)
    return measured


def decode_wait(w: WorkerView, horizon_s: float = 0.0) -> float:
    """The wait for decode pages a new request on decode worker ``w`` would see: the requests waiting
    for pages, as their queue will be ``horizon_s`` ahead at its measured growth (never shrinking),
    over the rate requests end there and free pages (``finish_rate``); 0 with none waiting or no
    rate measured. A pool that stays full while requests arrive faster than they end shows here
    before any of them has waited past the TTFT SLO."""
    if w.page_waiting < 1 or not w.finish_rate:
        return 0.0
    return (w.page_waiting + max(w.page_growth, 0.0) * horizon_s) / w.finish_rate


def predict_tpot(decode: list[WorkerView]) -> float | None:
    """The longest measured decode step; 0 when no decode worker runs a request; None when some run
    requests but no step time is measured."""
    if not any(w.batch > 0 for w in decode):
        return 0.0
    steps = [w.step_s for w in decode if w.step_s is not None]
    return max(steps) if steps else None


# A decode step's fixed part (weights read once per step, the step's own overhead) in rows' worth of
# per-row cost: step(b) = c * (STEP_FIXED_ROWS + b). The embedded model's engine, in process on the
# 2-core development host: 1 row about 40-54 ms, 8 rows about 92-137 ms (a fixed part of about 4 rows);
# its projections alone on an idle host: 1 row 9.4 ms, 32 rows 34.6 ms (about 10 rows). The lower
# figure keeps the prediction an upper bound; 0 would scale a step linearly with its rows.
STEP_FIXED_ROWS = 4.0

# A decode -> prefill move must add this share of the summed prefill speed: a decode worker that
# already prefills (selective disaggregation) adds little as a prefill worker and costs its decode rows.
MIN_SPEED_GAIN = 0.1


def step_at(step_s: float, batch: float, rows: float, fixed_rows: float = STEP_FIXED_ROWS) -> float:
    """A step measured at ``step_s`` with ``batch`` rows, predicted at ``rows`` rows (affine in rows)."""
    return step_s * (fixed_rows + rows) / (fixed_rows + max(batch, 1.0))


def tpot_without(decode: list[WorkerView], leaving: WorkerView, fixed_rows: float = STEP_FIXED_ROWS) -> float | None:
    """TPOT predicted once ``leaving`` is gone and its running requests are spread evenly over the
    rest, each worker's step scaled by ``step_at`` (a worker without a measured step: the worst
    measured cost per row's worth)."""
    rest = [w for w in decode if w is not leaving]
    if not rest:
        return None
    if sum(w.batch for w in decode) == 0:
        return 0.0
    unit = [w.step_s / (fixed_rows + max(w.batch, 1.0)) for w in decode if w.step_s is not None]
    if not unit:
        return None
    share = leaving.batch / len(rest)
    return max(
        step_at(w.step_s, w.batch, w.batch + share, fixed_rows)
        if w.step_s is not None
        else max(unit) * (fixed_rows + w.batch + share)
        for w in rest
    )


def decide(view: ClusterView, state: PlannerState, knobs: Knobs) -> Decision:
    """The planner's decision for ``view`` (module docstring); pure."""
    prefill, decode = view.of(Role.PREFILL), view.of(Role.DECODE)
    ttft = predict_ttft(prefill, view.queue_wait_s, view.prompt_tokens, helpers=decode)
    if ttft is not None:  # a request already waiting longer, or one bound to wait for decode pages
        ttft = max(ttft, view.first_token_wait_s, *(decode_wait(w, knobs.horizon_s) for w in decode))
    tpot = predict_tpot(decode)
    ttft_bad = ttft is not None and ttft > knobs.slo_ttft_s
    tpot_bad = tpot is not None and tpot > knobs.slo_tpot_s
    decode_side = ttft_bad and decode_bound(decode)  # first tokens wait for decode pages: both are decode's
    nxt = replace(
        state,
        ttft_streak=state.ttft_streak + 1 if ttft_bad and not tpot_bad else 0,
        tpot_streak=state.tpot_streak + 1 if tpot_bad and (not ttft_bad or decode_side) else 0,
    )

    def hold(why: str, after: float | None = None) -> Decision:
        return Decision(None, why, ttft, tpot, nxt, after)

    if ttft_bad and tpot_bad and not decode_side:
        return hold("TTFT and TPOT both over their SLOs: a move would only shift the violation")
    if not ttft_bad and not tpot_bad:
        return hold("within both SLOs" if ttft is not None and tpot is not None else "within SLOs (some unmeasured)")
    if state.last_move_at is not None and view.now - state.last_move_at < knobs.dwell_s:
        return hold(f"dwell: last move {view.now - state.last_move_at:.1f} s ago (< {knobs.dwell_s:g} s)")
    if decode_side:
        return _move(view, nxt, knobs, prefill, Role.PREFILL, Role.DECODE, ttft, tpot, decode_bound_ttft=True)
    if knobs.shared_cores:
        # Cores shared by every worker (a busy one borrows the idle ones'): a worker that changes
        # role brings no compute with it, so the prediction of adding a worker's speed does not hold.
        metric = "TTFT" if ttft_bad else "TPOT"
        return hold(f"{metric} over its SLO, but the workers share the host's cores: a move adds no compute")
    if ttft_bad:
        return _move(view, nxt, knobs, decode, Role.DECODE, Role.PREFILL, ttft, tpot)
    return _move(view, nxt, knobs, prefill, Role.PREFILL, Role.DECODE, ttft, tpot)


def decode_bound(decode: list[WorkerView]) -> bool:
    """Whether the decode side holds back first tokens: some decode worker has more requests waiting
    for KV pages (a full pool) than requests holding pages while they await their KV (or its own
    prefill). Its pages are then held by running requests, so new prompts wait for decode room
    whatever the prefill speed; a pool full of requests awaiting their KV is the prefill side's."""
    return any(w.page_waiting >= 1 and w.page_waiting > w.awaiting - w.page_waiting for w in decode)


def _move(
    view: ClusterView,
    nxt: PlannerState,
    knobs: Knobs,
    pool: list[WorkerView],
    old: Role,
    new: Role,
    ttft: float | None,
    tpot: float | None,
    decode_bound_ttft: bool = False,
) -> Decision:
    """Move a worker of ``pool`` (role ``old``) to ``new`` if the violation lasted long enough, the
    pool keeps a worker and the other metric keeps its headroom (``decode_bound_ttft``: a TTFT
    violation the decode side causes moves a prefill worker to decode, headroom unchecked)."""
    metric, streak = ("TTFT", nxt.ttft_streak) if new == Role.PREFILL else ("TPOT", nxt.tpot_streak)
    if decode_bound_ttft:  # TTFT alone (its streak) or with TPOT (TPOT's streak: both are the decode side's)
        both = " and TPOT" if nxt.tpot_streak else ""
        metric = f"TTFT{both} (decode-bound: requests wait for decode pages)"
        streak = max(nxt.ttft_streak, nxt.tpot_streak)
    if streak < knobs.hysteresis:
        return Decision(None, f"{metric} over its SLO ({streak}/{knobs.hysteresis} evaluations)", ttft, tpot, nxt)
    if len(pool) < 2:
        return Decision(None, f"{metric} over its SLO, but a move would leave no {old} worker", ttft, tpot, nxt)
    after = {w.worker_id: _after(view, pool, w, new) for w in pool}
    known = [w for w in pool if after[w.worker_id] is not None]
    if not known:
        return Decision(None, f"{metric} over its SLO; the other metric after a move is unknown", ttft, tpot, nxt)
    limit = knobs.headroom * (knobs.slo_tpot_s if new == Role.PREFILL else knobs.slo_ttft_s)
    fits = known if decode_bound_ttft else [w for w in known if after[w.worker_id] <= limit]
    if new == Role.PREFILL and fits:
        gain = speed_gains(view)
        gains = [w for w in fits if gain[w.worker_id] >= MIN_SPEED_GAIN]
        if not gains:
            adds = ", ".join(f"{w.worker_id} {gain[w.worker_id]:.0%}" for w in fits)
            why = f"{metric} over its SLO, but no move adds {MIN_SPEED_GAIN:.0%} prefill speed"
            why += f": decode workers prefill already (a move adds: {adds})"
            return Decision(None, why, ttft, tpot, nxt)
        fits = gains
    if not fits:
        least = min(after[w.worker_id] for w in known)
        other = "TPOT" if new == Role.PREFILL else "TTFT"
        return Decision(
            None,
            f"{metric} over its SLO, but {other} after a move ({least:.3f} s) > {limit:.3f} s",
            ttft,
            tpot,
            nxt,
            least,
        )
    # Among the moves the headroom allows, the worker that can leave soonest: a decode worker's
    # requests awaiting their KV hold its switch until the very prefill backlog that calls for the
    # move has computed them (a 26 s switch where an idle peer was free to go).
    best = min(fits, key=lambda w: (w.awaiting, after[w.worker_id], w.batch + w.backlog_tokens, w.worker_id))
    moved = PlannerState(last_move_at=view.now)
    why = f"{metric} over its SLO for {streak} evaluations: {best.worker_id} {old} -> {new}"
    return Decision((best.worker_id, old, new), why, ttft, tpot, moved, after[best.worker_id])


def speed_gains(view: ClusterView) -> dict[str, float]:
    """By decode worker id, the share of the summed prefill speed it adds as a prefill worker: the
    prefill workers' mean measured speed less what it gives as a decode worker (``helper_speed``;
    0 with no speed measured)."""
    prefill, decode = view.of(Role.PREFILL), view.of(Role.DECODE)
    mean = mean_prefill_speed(prefill)
    if mean is None:
        return {d.worker_id: 0.0 for d in decode}
    gives = helper_speeds(decode, mean, sum(p.backlog_tokens for p in prefill), view.prompt_tokens)
    total = sum(p.prefill_tps or mean for p in prefill) + sum(gives.values())
    return {wid: (mean - g) / total for wid, g in gives.items()}


def _after(view: ClusterView, pool: list[WorkerView], w: WorkerView, new: Role) -> float | None:
    """The metric the move of ``w`` to ``new`` costs: TPOT without ``w`` (to prefill), TTFT
    without ``w`` (to decode)."""
    if new == Role.PREFILL:
        return tpot_without(pool, w)
    rest = [p for p in pool if p is not w]
    return predict_ttft(rest, view.queue_wait_s, view.prompt_tokens, w.backlog_tokens, helpers=view.of(Role.DECODE))
