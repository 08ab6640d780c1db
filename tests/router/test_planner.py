"""The SLO planner's decision function (server.router.planner.decide) over hand-built cluster views:
TTFT violated -> a decode worker prefills, TPOT violated -> a prefill worker decodes, both met or
both violated -> nothing (unless first tokens wait for decode pages), hysteresis, dwell, never a role
left empty, no move without headroom, and the predictions themselves (queueing counted in TTFT, rows spread in TPOT)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from server.router.planner import ClusterView, Knobs, PlannerState, WorkerView, decide, predict_ttft, tpot_without
from transfer.wire.enums import Role

pytestmark = pytest.mark.unit

KNOBS = Knobs(slo_ttft_s=1.0, slo_tpot_s=0.1, hysteresis=2, dwell_s=30.0, headroom=0.8)


def prefill(wid: str, backlog: float, tps: float | None = 1000.0) -> WorkerView:
    return WorkerView(wid, Role.PREFILL, backlog_tokens=backlog, prefill_tps=tps)


def decode(wid: str, batch: float, step_s: float | None) -> WorkerView:
    return WorkerView(wid, Role.DECODE, batch=batch, step_s=step_s)


def view(*workers: WorkerView, now: float = 100.0, wait: float = 0.0, prompt: float = 500.0) -> ClusterView:
    return ClusterView(now=now, workers=workers, queue_wait_s=wait, prompt_tokens=prompt)


# TTFT: 0 + 4000/1000 + 500/1000 = 4.5 s > 1 s; TPOT 0.02 s, 0.03 s after a move (< 0.08 s)
PREFILL_BOUND = (prefill("prefill-0", 4000), decode("decode-0", 2, 0.02), decode("decode-1", 1, 0.02))
# TPOT 0.5 s > 0.1 s; TTFT 0.1 s, 0.1 s without either prefill worker (< 0.8 s)
DECODE_BOUND = (prefill("prefill-0", 0), prefill("prefill-1", 0), decode("decode-0", 10, 0.5))


def run(v: ClusterView, times: int, knobs: Knobs = KNOBS):
    decisions, state = [], PlannerState()
    for _ in range(times):
        d = decide(v, state, knobs)
        state = d.state
        decisions.append(d)
    return decisions


def test_a_ttft_violation_turns_the_least_loaded_decode_worker_into_a_prefill_worker():
    first, second = run(view(*PREFILL_BOUND), 2)
    assert first.move is None and "TTFT over its SLO (1/2 evaluations)" in first.why
    assert second.move == ("decode-1", Role.DECODE, Role.PREFILL)  # fewer rows: less TPOT cost
    assert second.ttft_s == pytest.approx(4.5) and second.tpot_s == pytest.approx(0.02)
    # decode-0's 2 rows + decode-1's 1: its 0.02 s step at 2 rows, a fixed part of 4 rows' worth
    assert second.after_s == pytest.approx(0.02 * (4 + 3) / (4 + 2))
    assert second.state == PlannerState(last_move_at=100.0)


def test_the_decode_worker_whose_requests_await_no_kv_is_moved_first():
    """Two idle decode workers, one holding three requests whose KV the prefill backlog has yet to
    compute: its switch would wait for that backlog, so the other one goes."""
    busy = WorkerView("decode-0", Role.DECODE, awaiting=3.0)
    free = WorkerView("decode-1", Role.DECODE, awaiting=0.0)
    _, second = run(view(prefill("prefill-0", 4000), busy, free), 2)
    assert second.move == ("decode-1", Role.DECODE, Role.PREFILL)
    # among the moves within the headroom only: decode-1's 40 rows on decode-0 would step at
    # 0.02 x (4 + 41) / 5 = 0.18 s > 0.08 s, so decode-0 goes, awaiting requests and all
    waits = WorkerView("decode-0", Role.DECODE, batch=1, step_s=0.02, awaiting=2.0)
    full = WorkerView("decode-1", Role.DECODE, batch=40, step_s=0.07)
    assert run(view(prefill("prefill-0", 4000), waits, full), 2)[1].move == ("decode-0", Role.DECODE, Role.PREFILL)


def test_a_tpot_violation_turns_a_prefill_worker_into_a_decode_worker():
    first, second = run(view(*DECODE_BOUND, prompt=100), 2)
    assert first.move is None
    assert second.move == ("prefill-0", Role.PREFILL, Role.DECODE)
    assert second.after_s == pytest.approx(0.1)  # one prefill worker left: 100 tokens / 1000 tok/s


def test_nothing_moves_when_both_slos_are_met():
    v = view(prefill("prefill-0", 100), decode("decode-0", 2, 0.02), decode("decode-1", 1, 0.02))
    decisions = run(v, 5)
    assert all(d.move is None and d.why == "within both SLOs" for d in decisions)
    assert decisions[-1].state == PlannerState()


def test_nothing_moves_when_both_slos_are_violated():
    v = view(prefill("prefill-0", 4000), prefill("prefill-1", 4000), decode("decode-0", 9, 0.5), decode("d-1", 9, 0.5))
    decisions = run(v, 5)
    assert all(d.move is None and "both over their SLOs" in d.why for d in decisions)


def test_hysteresis_a_violation_that_does_not_persist_moves_nothing():
    ok = view(prefill("prefill-0", 0), decode("decode-0", 2, 0.02), decode("decode-1", 1, 0.02))
    state = PlannerState()
    for v in (view(*PREFILL_BOUND), ok, view(*PREFILL_BOUND), ok, view(*PREFILL_BOUND)):
        d = decide(v, state, KNOBS)
        assert d.move is None
        state = d.state
    assert state.ttft_streak == 1
    three = run(view(*PREFILL_BOUND), 3, knobs=Knobs(1.0, 0.1, hysteresis=3))
    assert [d.move is not None for d in three] == [False, False, True]


def test_dwell_no_move_within_dwell_s_of_the_last_one():
    moved_at_90 = PlannerState(ttft_streak=5, last_move_at=90.0)
    d = decide(view(*PREFILL_BOUND, now=100.0), moved_at_90, KNOBS)
    assert d.move is None and d.why.startswith("dwell: last move 10.0 s ago")
    assert d.state.ttft_streak == 6  # the violation keeps counting through the dwell
    d = decide(view(*PREFILL_BOUND, now=120.0), moved_at_90, KNOBS)
    assert d.move == ("decode-1", Role.DECODE, Role.PREFILL)


def test_a_move_never_leaves_a_role_empty():
    lone_decode = (prefill("prefill-0", 4000), decode("decode-0", 1, 0.02))
    assert all(d.move is None and "leave no decode worker" in d.why for d in run(view(*lone_decode), 4)[1:])
    lone_prefill = (prefill("prefill-0", 0), decode("decode-0", 10, 0.5), decode("decode-1", 10, 0.5))
    assert all(d.move is None and "leave no prefill worker" in d.why for d in run(view(*lone_prefill), 4)[1:])


def test_no_move_without_headroom_in_the_other_slo():
    # TPOT 0.065 s is within 0.1 s, but the best move (decode-1 away) puts 8 rows on decode-0:
    # 0.06 * (4 + 8) / (4 + 4) = 0.09 s
    tight = (prefill("prefill-0", 4000), decode("decode-0", 4, 0.06), decode("decode-1", 4, 0.065))
    last = run(view(*tight), 3)[-1]
    assert last.move is None and "TPOT after a move (0.090 s) > 0.080 s" in last.why


def test_a_step_has_a_fixed_part_so_doubling_its_rows_does_not_double_it():
    # decode-1 away: decode-0 at 8 rows, 0.045 * 12 / 8 = 0.0675 s, within 0.08 s (scaled linearly
    # with rows it would be 0.09 s and the move refused)
    fits = (prefill("prefill-0", 4000), decode("decode-0", 4, 0.045), decode("decode-1", 4, 0.05))
    last = run(view(*fits), 2)[-1]
    assert last.move == ("decode-1", Role.DECODE, Role.PREFILL) and last.after_s == pytest.approx(0.0675)


def test_unknown_predictions_move_nothing():
    unmeasured = (prefill("prefill-0", 4000, tps=None), decode("decode-0", 10, None), decode("decode-1", 0, None))
    assert all(d.move is None and d.ttft_s is None and d.tpot_s is None for d in run(view(*unmeasured), 4))


def test_ttft_counts_the_queue_ahead():
    workers = [prefill("prefill-0", 3000, 1000.0), prefill("prefill-1", 1000, 3000.0)]
    # 0.2 s router queue + 4000 backlog / 4000 tok/s + 1000 prompt / 2000 tok/s mean
    assert predict_ttft(workers, 0.2, 1000.0) == pytest.approx(0.2 + 1.0 + 0.5)
    assert predict_ttft(workers[:1], 0.0, 1000.0) == pytest.approx(3.0 + 1.0)


def test_a_prefill_worker_not_measured_yet_counts_at_the_mean_speed():
    # decode-0 just became a prefill worker: 1880 tokens queued there, no prompt computed yet. Its
    # backlog is prefilled by it, at about the others' pace: 6000 / (2 x 50) + 1000 / 50 = 80 s
    # (leaving its speed out of the sum predicted 6000 / 50 + 20 = 140 s)
    workers = [prefill("prefill-0", 4120, 50.0), prefill("decode-0", 1880, None)]
    assert predict_ttft(workers, 0.0, 1000.0) == pytest.approx(60.0 + 20.0)
    assert predict_ttft([prefill("decode-0", 1880, None)], 0.0, 1000.0) is None


def test_tpot_without_spreads_the_rows_of_the_worker_leaving():
    d = [decode("decode-0", 2, 0.02), decode("decode-1", 4, 0.02), decode("decode-2", 0, None)]
    # decode-1's 4 rows over decode-0 (0.02 s at 2 rows -> 4 rows: 0.02 * 8 / 6) and decode-2 (no
    # measure: the worst cost per row's worth, decode-0's 0.02 / 6, at 0 + 2 rows)
    assert tpot_without(d, d[1]) == pytest.approx(0.02 * 8 / 6)
    assert tpot_without(d, d[1], fixed_rows=0.0) == pytest.approx(0.01 * (2 + 2))  # linear in rows
    idle = [decode("decode-0", 0, None), decode("decode-1", 0, None)]
    assert tpot_without(idle, idle[0]) == 0.0


def _phase_view(now: float, roles: dict[str, Role], prefill_phase: bool) -> ClusterView:
    """A cluster under a load phase: long prompts need two prefill workers (one alone: 4.5 s TTFT),
    long answers two decode workers (one alone: 0.2 s steps); the other role idles."""
    n_prefill = sum(r == Role.PREFILL for r in roles.values())
    workers = []
    for wid, role in sorted(roles.items()):
        if role == Role.PREFILL:
            workers.append(prefill(wid, 4000 / n_prefill if prefill_phase and n_prefill == 1 else 0))
        elif prefill_phase:
            workers.append(decode(wid, 1, 0.02))
        else:
            workers.append(decode(wid, 8, 0.2 if n_prefill == 2 else 0.05))
    return view(*workers, now=now, prompt=500 if prefill_phase else 50)


def test_default_knobs_move_a_worker_in_every_minute_long_phase():
    """Phases of 60 s alternate, evaluated every 5 s (the default interval) with the default
    hysteresis and dwell: the first move comes 10 s into the first phase (the third evaluation in
    violation), each later one 10 s into its phase (the dwell of 60 s has then passed)."""
    knobs = Knobs(slo_ttft_s=1.0, slo_tpot_s=0.1)
    roles = {"prefill-0": Role.PREFILL, "decode-0": Role.DECODE, "decode-1": Role.DECODE}
    state, moves = PlannerState(), []
    for step in range(4 * 12):
        now = 5.0 * step
        d = decide(_phase_view(now, roles, prefill_phase=(now // 60) % 2 == 0), state, knobs)
        state = d.state
        if d.move:
            roles[d.move[0]] = d.move[2]
            moves.append((now, d.move[1], d.move[2]))
    assert [(t % 60, old, new) for t, old, new in moves] == [
        (10.0, Role.DECODE, Role.PREFILL),
        (10.0, Role.PREFILL, Role.DECODE),
        (10.0, Role.DECODE, Role.PREFILL),
        (10.0, Role.PREFILL, Role.DECODE),
    ]


def test_a_ttft_violation_the_full_decode_pools_cause_turns_a_prefill_worker_into_a_decode_worker():
    """TTFT over its SLO while the one decode worker's pool is full of running requests and 20 more
    wait for pages: the prompts wait for decode room, not for prefill compute, so a prefill worker
    decodes (a decode worker to prefill, the TTFT-only rule, is impossible and would not help)."""
    full = WorkerView("decode-0", Role.DECODE, batch=40, step_s=0.05, awaiting=21.0, page_waiting=20.0)
    cluster = view(prefill("prefill-0", 1400), prefill("prefill-1", 1400), full, wait=9.0, prompt=100)
    first, second = run(cluster, 2)
    assert first.move is None and "decode-bound" in first.why
    assert second.move == ("prefill-1", Role.PREFILL, Role.DECODE) or second.move == (
        "prefill-0",
        Role.PREFILL,
        Role.DECODE,
    )


def test_a_decode_bound_ttft_with_tpot_over_too_turns_a_prefill_worker_into_a_decode_worker():
    """The one decode worker's steps (0.5 s > 0.1 s) and its full pool (20 requests waiting for pages)
    both hold the requests back: both violations are the decode side's, so a prefill worker decodes
    (counted by TPOT's streak); the same TTFT with the pool full of requests awaiting their KV is a
    violation of both SLOs with no move that helps both."""
    full = WorkerView("decode-0", Role.DECODE, batch=10, step_s=0.5, awaiting=21.0, page_waiting=20.0)
    cluster = view(prefill("prefill-0", 1400), prefill("prefill-1", 1400), full, wait=9.0, prompt=100)
    first, second = run(cluster, 2)
    assert first.move is None and "TTFT and TPOT (decode-bound" in first.why and first.state.tpot_streak == 1
    assert second.move is not None and second.move[1:] == (Role.PREFILL, Role.DECODE)
    holding = replace(full, page_waiting=3.0)
    assert all(
        d.move is None and "both over their SLOs" in d.why
        for d in run(replace(cluster, workers=(*cluster.workers[:2], holding)), 3)
    )


def test_a_growing_wait_for_decode_pages_moves_a_prefill_worker_before_any_request_waited_long():
    """decode-0's pool is full: 4 requests wait for its pages and their queue grows by 1 a second,
    while 2 requests a second end there. Nothing has waited long yet (the prefill side predicts
    0.2 s), but over the planner's 4 s reaction time the queue reaches 8, a 4 s wait > 3 s: a
    prefill worker becomes a decode worker. A queue that does not grow waits 2 s: no move."""
    full = WorkerView(
        "decode-0", Role.DECODE, batch=40, step_s=0.05, awaiting=4, page_waiting=4, finish_rate=2.0, page_growth=1.0
    )
    workers = (prefill("prefill-0", 0), prefill("prefill-1", 0), full)
    knobs = replace(KNOBS, slo_ttft_s=3.0, slo_tpot_s=0.1, horizon_s=4.0)
    first, second = run(view(*workers, prompt=100.0), 2, knobs)
    assert first.ttft_s == pytest.approx((4 + 1.0 * 4.0) / 2.0) and "decode-bound" in first.why
    assert second.move is not None and second.move[1:] == (Role.PREFILL, Role.DECODE)
    steady = replace(full, page_growth=-0.5)
    held = run(view(prefill("prefill-0", 0), prefill("prefill-1", 0), steady, prompt=100.0), 2, knobs)
    assert held[0].ttft_s == pytest.approx(2.0) and all(d.move is None for d in held)


def test_a_pool_full_of_requests_awaiting_their_kv_is_the_prefill_sides():
    """The same TTFT violation while the decode workers' pages are held by requests awaiting their KV
    (8 of them, 3 more waiting for pages): prefill is the bottleneck, a decode worker prefills."""
    holding = WorkerView("decode-0", Role.DECODE, batch=1, step_s=0.02, awaiting=11.0, page_waiting=3.0)
    idle = WorkerView("decode-1", Role.DECODE)
    _, second = run(view(prefill("prefill-0", 4000), holding, idle), 2)
    assert second.move == ("decode-1", Role.DECODE, Role.PREFILL)


def helper(wid: str, local_tps: float, local_backlog: float = 0.0) -> WorkerView:
    """An idle decode worker that prefills prompts itself (selective disaggregation)."""
    return WorkerView(wid, Role.DECODE, local_tps=local_tps, local_backlog=local_backlog)


def test_decode_workers_that_prefill_add_their_speed_and_backlog_to_the_ttft():
    p = [prefill("prefill-0", 3000)]
    assert predict_ttft(p, 0.0, 500.0) == pytest.approx(3.5)
    # (3000 + 1000 held by decode-1) / (1000 + 600 + 1000) + 500 / 1000 (one prompt at a prefill
    # worker's pace); decode-1 computes its own 1000 tokens now: at 1000 tok/s, not its measured 400
    helpers = [helper("decode-0", 600), helper("decode-1", 400, 1000)]
    assert predict_ttft(p, 0.0, 500.0, helpers=helpers) == pytest.approx(4000 / 2600 + 0.5)


def test_no_decode_worker_moves_when_they_already_prefill_at_a_prefill_workers_pace():
    """TTFT 5 s > 1 s, but both decode workers prefill at 1000 tok/s: as a prefill worker either one
    would add nothing to the 3000 tok/s, so the violation moves nothing (and says why)."""
    v = view(prefill("prefill-0", 13500), helper("decode-0", 1000), helper("decode-1", 1000))
    first, second = run(v, 2)
    assert second.ttft_s == pytest.approx(13500 / 3000 + 0.5)
    assert second.move is None and "no move adds 10% prefill speed" in second.why and "decode-0 0%" in second.why
    # decode-1 prefills only 100 tok/s: as a prefill worker it adds 900 tok/s, 43 % of 2100
    v = view(prefill("prefill-0", 13500), helper("decode-0", 1000), helper("decode-1", 100))
    assert run(v, 2)[1].move == ("decode-1", Role.DECODE, Role.PREFILL)


def test_a_decode_worker_that_would_take_prompts_off_the_backlog_counts_at_a_prefill_workers_speed():
    """decode-0 and decode-1 measured no own prefill yet, but with ``--local-prefill-backlog-ratio 1``
    and no rows each would take a 500-token prompt off its 2000-token share of the backlog (its own
    rule: 2000 >= 1 x 500 x (1 + 0 rows)): they count at 1000 tok/s, and moving one adds nothing.
    With 4 rows each (500 x 5 = 2500 > 2000) they would not: their measured 0 counts, a move adds
    1000 tok/s and is made."""
    idle = [WorkerView(f"decode-{i}", Role.DECODE, local_ratio=1.0) for i in range(2)]
    v = view(prefill("prefill-0", 4000), *idle)
    assert predict_ttft([prefill("prefill-0", 4000)], 0.0, 500.0, helpers=idle) == pytest.approx(4000 / 3000 + 0.5)
    assert run(v, 2)[1].move is None
    busy = [WorkerView(f"decode-{i}", Role.DECODE, batch=4, step_s=0.01, local_ratio=1.0) for i in range(2)]
    assert run(view(prefill("prefill-0", 4000), *busy), 2)[1].move == ("decode-0", Role.DECODE, Role.PREFILL)


def test_a_first_token_wait_the_model_misses_moves_a_prefill_worker_when_decode_pools_are_full():
    """Two idle prefill workers predict 0.6 s, but a request has waited 4 s for its first token
    while decode-0's pool is full (5 requests waiting for pages, none for KV): decode-bound, so a
    prefill worker becomes a decode worker. Without the wait nothing is over its SLO."""
    full = WorkerView("decode-0", Role.DECODE, batch=46, step_s=0.05, awaiting=5, page_waiting=5)
    workers = (prefill("prefill-0", 0), prefill("prefill-1", 0), full)
    assert run(view(*workers, prompt=600.0), 2)[1].move is None
    waited = ClusterView(now=100.0, workers=workers, prompt_tokens=600.0, first_token_wait_s=4.0)
    second = run(waited, 2)[1]
    assert second.ttft_s == pytest.approx(4.0) and second.move == ("prefill-0", Role.PREFILL, Role.DECODE)


def test_a_decode_worker_computing_a_prompt_of_its_own_counts_at_a_prefill_workers_speed():
    """The first move of a measured run: decode-1 held 624 tokens of its own prefill (it measured
    only 128 tok/s over the window, having just taken the prompt) and its rule would take no more
    (3169 / 2 < 624 + 1584); decode-0 holds none and would take one. Neither adds speed as a prefill
    worker: no move. Without its own prompt, decode-1 would move (its 128 tok/s is all it gives)."""
    busy = WorkerView("decode-1", Role.DECODE, local_tps=128.0, local_backlog=624.0, local_ratio=1.0)
    idle = WorkerView("decode-0", Role.DECODE, local_ratio=1.0)
    workers = (prefill("prefill-0", 3169, 868.0), idle, busy)
    assert run(view(*workers, prompt=1584.0), 2)[1].move is None
    done = WorkerView("decode-1", Role.DECODE, local_tps=128.0, local_ratio=1.0, batch=1, step_s=0.01)
    moved = run(view(prefill("prefill-0", 3169, 868.0), idle, done, prompt=1584.0), 2)[1]
    assert moved.move == ("decode-1", Role.DECODE, Role.PREFILL)
