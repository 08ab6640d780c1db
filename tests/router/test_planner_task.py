"""The router's periodic planner (server.router.planner_task) over worker client doubles that report
real ``WorkerStats`` and answer ``SwitchRole``: the view built from their heartbeats (prefill speed,
decode step time), a persistent TTFT violation switching a decode worker through the admin path
(``switch_role``) and counting it with reason ``planner``, the dwell after it, the periodic loop,
prefill to decode held for want of TTFT headroom then made, and the config that turns it on."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError

from configs.schema import PdserveConfig
from configs.server import ServerConfig
from server.router.inflight import InflightTable
from server.router.metrics import RouterMetrics
from server.router.planner import Knobs
from server.router.planner_task import Planner, knobs_of, queue_wait_of, views_of
from server.router.planner_view import ViewBuilder
from server.router.registry import READY, Registry, WorkerSpec
from tests.support.router_doubles import SwitchingClient
from transfer.wire.enums import Role
from transfer.wire.protocol import HistogramData

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def cluster() -> tuple[Registry, RouterMetrics, Clock]:
    clock = Clock()
    specs = [WorkerSpec(w, r, f"tcp://{w}:1") for w, r in (("prefill-0", Role.PREFILL), *DECODERS)]
    reg = Registry(specs, SwitchingClient, InflightTable(), clock=clock)
    return reg, RouterMetrics(lambda: reg.handles.values(), lambda: 0), clock


DECODERS = (("decode-0", Role.DECODE), ("decode-1", Role.DECODE))


def heartbeat(reg: Registry, clock: Clock, t: float, backlog: float) -> None:
    """Every worker reports at ``t``: prefill-0 computed 1000 tokens per second of compute over 2
    prompts a second and holds ``backlog`` tokens; decode-0 runs 2 requests, decode-1 one, each
    making 50 steps a second (0.02 s per step)."""
    clock.t = t
    p = reg.handles["prefill-0"].client
    p.counters = {"prefill_computed_tokens": 1000.0 * (t + 1)}
    p.histograms = {"phase_prefill_compute": HistogramData(buckets=[1.0], counts=[int(2 * (t + 1)), 0], sum=t + 1)}
    p.gauges = {"prefill_backlog_tokens": backlog}
    for wid, rows in (("decode-0", 2.0), ("decode-1", 1.0)):
        c = reg.handles[wid].client
        c.counters, c.gauges = {"decode_steps": 50.0 * t}, {"queue_running": rows}
    for h in reg.handles.values():
        h.client.request_stats(0)


def switches(metrics: RouterMetrics, old: str, new: str, reason: str) -> float:
    labels = {"from": old, "to": new, "reason": reason}
    return metrics.registry.get_sample_value("pdserve_role_switches_total", labels) or 0.0


KNOBS = Knobs(slo_ttft_s=1.0, slo_tpot_s=0.1, hysteresis=2, dwell_s=30.0)


def test_a_persistent_ttft_violation_switches_a_decode_worker_through_the_admin_path():
    reg, metrics, clock = cluster()
    planner = Planner(reg, metrics, KNOBS, switch_timeout_s=5, clock=clock)
    heartbeat(reg, clock, 0.0, backlog=4000)
    first = asyncio.run(planner.evaluate())  # one heartbeat: no decode step measured yet, TPOT unknown
    assert first.move is None and first.tpot_s is None and "1/2 evaluations" in first.why
    heartbeat(reg, clock, 1.0, backlog=4000)
    second = asyncio.run(planner.evaluate())
    # 4000 backlog / 1000 tok/s + a 500-token prompt / 1000 tok/s; 1 s / 50 steps
    assert second.ttft_s == pytest.approx(4.5) and second.tpot_s == pytest.approx(0.02)
    assert second.move == ("decode-1", Role.DECODE, Role.PREFILL)  # 1 row: the cheaper one to move
    assert second.after_s == pytest.approx(0.02 * (4 + 3) / (4 + 2))  # decode-0: 2 rows + 1, a fixed part
    assert reg.handles["decode-1"].client.switches == [Role.PREFILL]
    assert reg.handles["decode-1"].spec.role == Role.PREFILL and reg.handles["decode-1"].state == READY
    assert switches(metrics, "decode", "prefill", "planner") == 1.0
    assert switches(metrics, "decode", "prefill", "admin") == 0.0
    heartbeat(reg, clock, 2.0, backlog=4000)  # still violated: the dwell holds
    third = asyncio.run(planner.evaluate())
    assert third.move is None and third.why.startswith("dwell")
    assert switches(metrics, "decode", "prefill", "planner") == 1.0


def test_a_switch_the_admin_path_refuses_is_logged_and_not_counted(caplog):
    reg, metrics, clock = cluster()
    planner = Planner(reg, metrics, KNOBS, switch_timeout_s=5, clock=clock)
    heartbeat(reg, clock, 0.0, backlog=4000)
    asyncio.run(planner.evaluate())
    heartbeat(reg, clock, 1.0, backlog=4000)
    build = planner.views.build

    def build_then_drain(*args):  # decode-0 leaves rotation between the decision and the switch
        view = build(*args)
        reg.handles["decode-0"].state = "draining"
        return view

    planner.views.build = build_then_drain
    with caplog.at_level("WARNING"):
        d = asyncio.run(planner.evaluate())
    assert d.move == ("decode-1", Role.DECODE, Role.PREFILL)
    assert "switch of decode-1 decode -> prefill not made" in caplog.text
    assert "would leave no ready decode worker" in caplog.text
    assert reg.handles["decode-1"].spec.role == Role.DECODE and reg.handles["decode-1"].client.switches == []
    assert switches(metrics, "decode", "prefill", "planner") == 0.0
    assert planner.state.last_move_at == 1.0  # the dwell starts anyway: no retry at every evaluation


def test_the_planner_sees_only_ready_workers():
    reg, metrics, clock = cluster()
    planner = Planner(reg, metrics, KNOBS, switch_timeout_s=5, clock=clock)
    reg.handles["decode-0"].state = "draining"
    for t in (0.0, 1.0, 2.0):
        heartbeat(reg, clock, t, backlog=4000)
        reg.handles["decode-0"].state = "draining"  # its heartbeats do not bring it back here
        d = asyncio.run(planner.evaluate())
    assert d.move is None and "leave no decode worker" in d.why
    assert reg.handles["decode-1"].client.switches == []


def test_the_periodic_task_evaluates_every_interval_and_survives_an_error():
    reg, metrics, _ = cluster()
    planner = Planner(reg, metrics, KNOBS, switch_timeout_s=5)
    calls = []

    async def evaluate():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")

    planner.evaluate = evaluate

    async def main():
        task = asyncio.create_task(planner.run(0.01))
        await asyncio.sleep(0.2)
        task.cancel()

    asyncio.run(main())
    assert len(calls) >= 3


def test_the_planner_config():
    assert ServerConfig().planner == "off"
    with pytest.raises(ValidationError, match="needs both SLOs"):
        ServerConfig(planner="slo", slo_ttft_ms=1000)
    with pytest.raises(ValidationError, match="it needs --mode pd"):
        PdserveConfig(server={"planner": "slo", "slo_ttft_ms": 1000, "slo_tpot_ms": 50}, cluster={"mode": "colocated"})
    cfg = PdserveConfig(
        server={"planner": "slo", "slo_ttft_ms": 1500, "slo_tpot_ms": 50, "planner_hysteresis": 4},
        cluster={"mode": "pd"},
    )
    # the decode-page wait is projected over the planner's reaction time: 4 evaluations 5 s apart
    want = Knobs(slo_ttft_s=1.5, slo_tpot_s=0.05, hysteresis=4, dwell_s=60.0, headroom=0.8, horizon_s=20.0)
    assert knobs_of(cfg.server) == want


def test_the_view_takes_rates_between_heartbeats_and_the_queue_wait_since_the_last_build():
    reg, metrics, clock = cluster()
    planner = Planner(reg, metrics, KNOBS, switch_timeout_s=5, clock=clock)
    p = reg.handles["prefill-0"].client
    for t, tokens, compute_s, prompts in ((0.0, 1000.0, 1.0, 1), (1.0, 5000.0, 2.0, 3)):
        clock.t = t
        p.counters = {"prefill_computed_tokens": tokens}
        p.histograms = {"phase_prefill_compute": HistogramData(buckets=[1.0], counts=[prompts, 0], sum=compute_s)}
        p.request_stats(0)
        if t == 0.0:
            first = planner.views.build(reg.handles.values(), (0.0, 0.0), t)
    metrics.queue_wait.observe(0.25)
    metrics.queue_wait.observe(0.75)
    second = planner.views.build(reg.handles.values(), queue_wait_of(metrics), 1.0)
    third = planner.views.build(reg.handles.values(), queue_wait_of(metrics), 2.0)
    (w1,), (w2,) = (v.of(Role.PREFILL) for v in (first, second))
    assert (w1.prefill_tps, first.prompt_tokens) == (1000.0, 1000.0)  # cumulative: one sample
    assert w2.prefill_tps == 4000.0  # 4000 tokens in 1 s
    # 4000 tokens over 2 prompts in that second, the first heartbeat's 1000 over 1 at half weight per 4 prompts
    w = 0.5 ** (2 / 4)
    assert second.prompt_tokens == pytest.approx((1000 * w + 4000) / (w + 2))
    assert second.queue_wait_s == pytest.approx(0.5) and third.queue_wait_s == 0.0
    assert third.of(Role.PREFILL)[0].prefill_tps == 4000.0  # no heartbeat since: the last answer


def test_a_persistent_tpot_violation_switches_a_prefill_worker_to_decode():
    clock = Clock()
    roles = (("prefill-0", Role.PREFILL), ("prefill-1", Role.PREFILL), ("decode-0", Role.DECODE))
    reg = Registry([WorkerSpec(w, r, f"tcp://{w}:1") for w, r in roles], SwitchingClient, InflightTable(), clock=clock)
    metrics = RouterMetrics(lambda: reg.handles.values(), lambda: 0)
    tight = Knobs(slo_ttft_s=1.4, slo_tpot_s=0.1, hysteresis=2, headroom=0.7)
    planner = Planner(reg, metrics, tight, 5, clock=clock)
    decisions = []
    for t in (0.0, 1.0, 2.0, 3.0):
        clock.t = t
        for wid, tps in (("prefill-0", 200), ("prefill-1", 100)):  # 100-token prompts, 100 tokens backlog
            c = reg.handles[wid].client
            c.counters = {"prefill_computed_tokens": tps * (t + 1)}
            n = int(tps / 100 * (t + 1))
            c.histograms = {"phase_prefill_compute": HistogramData(buckets=[1.0], counts=[n, 0], sum=t + 1)}
            c.gauges = {"prefill_backlog_tokens": 100.0}
        d = reg.handles["decode-0"].client
        d.counters, d.gauges = {"decode_steps": 2.0 * t}, {"queue_running": 8.0}  # 0.5 s per step
        for h in reg.handles.values():
            h.client.request_stats(0)
        if t == 3.0:  # a looser TTFT SLO leaves room for the move
            planner.knobs = Knobs(slo_ttft_s=5.0, slo_tpot_s=0.1, hysteresis=2)
        decisions.append(asyncio.run(planner.evaluate()))
    # TTFT 200 / 300 + 100 / 150 = 1.33 s; without prefill-1 (the slower), its backlog handed to
    # prefill-0: 200 / 200 + 100 / 200 = 1.5 s (without prefill-0: 3 s), over 0.7 x 1.4 s; with a 5 s
    # SLO it fits
    assert decisions[1].ttft_s == pytest.approx(4 / 3) and decisions[1].tpot_s == pytest.approx(0.5)
    assert "TPOT over its SLO, but TTFT after a move (1.500 s) > 0.980 s" in decisions[2].why
    assert [d.move for d in decisions] == [None, None, None, ("prefill-1", Role.PREFILL, Role.DECODE)]
    assert reg.handles["prefill-1"].spec.role == Role.DECODE and reg.handles["prefill-1"].state == READY
    assert switches(metrics, "prefill", "decode", "planner") == 1.0


def _prefill_heartbeat(
    reg: Registry, clock: Clock, t: float, tokens: float, busy_s: float, prompts: int, hist_s: float
):
    clock.t = t
    p = reg.handles["prefill-0"].client
    p.counters = {"prefill_computed_tokens": tokens, "prefill_compute_seconds": busy_s}
    p.histograms = {"phase_prefill_compute": HistogramData(buckets=[1.0], counts=[prompts, 0], sum=hist_s)}
    p.request_stats(0)


def test_the_prefill_speed_counts_a_shared_batch_once():
    """Four 100-token prompts prefilled in one 0.2 s batch, twice: 2000 tokens/s, not the 500 the
    per-prompt compute times (0.2 s each, 0.8 s per batch) would give."""
    reg, metrics, clock = cluster()
    planner = Planner(reg, metrics, KNOBS, switch_timeout_s=5, clock=clock)
    for t, n in ((0.0, 1), (1.0, 2)):
        _prefill_heartbeat(reg, clock, t, tokens=400.0 * n, busy_s=0.2 * n, prompts=4 * n, hist_s=0.8 * n)
        view = planner.views.build(reg.handles.values(), (0.0, 0.0), t)
        assert view.of(Role.PREFILL)[0].prefill_tps == pytest.approx(2000.0)
        assert view.prompt_tokens == pytest.approx(100.0)


def test_the_typical_prompt_and_speed_span_a_window_of_heartbeats():
    """1500-token prompts computed 500 tokens per 0.5 s heartbeat (1000 tokens/s over 0.4 s of
    forwards), one completing every 1.5 s: between two heartbeats a completion meets one chunk's
    500 tokens, over the window it meets its whole prompt."""
    reg, metrics, clock = cluster()
    planner = Planner(reg, metrics, KNOBS, switch_timeout_s=5, clock=clock)
    prompts = []
    for i in range(1, 25):
        t = 0.5 * i
        done = i // 3
        _prefill_heartbeat(reg, clock, t, tokens=500.0 * i, busy_s=0.4 * i, prompts=done, hist_s=1.5 * done)
        view = planner.views.build(reg.handles.values(), (0.0, 0.0), t)
        if i >= 6:
            assert view.of(Role.PREFILL)[0].prefill_tps == pytest.approx(1250.0)
            prompts.append(view.prompt_tokens)
    # the decayed sums (half weight per 4 prompts) are off by at most one chunk at either end
    assert all(1200 <= p <= 1800 for p in prompts[-6:]), prompts


def _decode_heartbeat(reg: Registry, clock: Clock, t: float, steps: float, rows: float = 4.0) -> None:
    clock.t = t
    c = reg.handles["decode-0"].client
    c.counters, c.gauges = {"decode_steps": steps}, {"queue_running": rows}
    c.request_stats(0)


def test_a_decode_workers_requests_awaiting_kv_are_in_its_view():
    reg, metrics, clock = cluster()
    c = reg.handles["decode-0"].client
    gauges = {"queue_running": 1.0, "queue_prealloc": 1.0, "queue_transfer": 2.0, "queue_local_prefill": 1.0}
    c.counters, c.gauges = {"decode_steps": 0.0}, gauges
    c.request_stats(0)
    (w,) = ViewBuilder().build([reg.handles["decode-0"]], (0.0, 0.0), 0.0).of(Role.DECODE)
    assert (w.batch, w.awaiting, w.page_waiting) == (1.0, 4.0, 1.0)


def test_a_step_time_across_an_over_long_gap_is_discarded():
    """decode-0 runs 4 rows at 0.02 s a step, then is not seen for 35 s (a role switch, a stall)
    and makes one step in that gap: 35 s a step is no step time; the next regular gap measures again."""
    reg, metrics, clock = cluster()
    views = views_of(ServerConfig(planner_interval_s=2.0, health_interval_s=0.5))
    assert views.max_step_gap_s == 5.0
    steps = []
    for t, n in ((0.0, 0.0), (2.0, 100.0), (37.0, 101.0), (39.0, 201.0)):
        _decode_heartbeat(reg, clock, t, n)
        steps.append(views.build([reg.handles["decode-0"]], (0.0, 0.0), t).of(Role.DECODE)[0].step_s)
    assert steps == [None, pytest.approx(0.02), None, pytest.approx(0.02)]
    assert ViewBuilder(max_step_gap_s=40.0).max_step_gap_s == 40.0  # the gap is the builder's, not a constant


def test_the_typical_prompt_follows_a_phase_change_within_seconds():
    """100-token prompts (8 a second, none held) for 20 s, then 1,800-token prompts arrive faster
    than they are computed (1000 tokens/s, the queue grows); then back to short ones (the queue
    drains, 8 a second complete). Heartbeats every 0.5 s. Completions over a 10 s window read
    under 500 tokens for the first seconds of the long phase; the queue's own prompts read the
    long ones from the first heartbeat that holds one, and the decayed completions fall under 400
    within 6 s of the short ones."""
    reg, metrics, clock = cluster()
    views = ViewBuilder()
    p = reg.handles["prefill-0"].client
    tokens = prompts = 0.0
    read = {}
    for i in range(1, 101):
        t = 0.5 * i
        long_phase = 20.0 < t <= 30.0
        if long_phase:
            tokens += 500.0
            prompts += 1.0 if i % 4 == 0 else 0.0  # 1,800-token prompts: about one per 1.8 s
            held = 2.0 * (t - 20.0)  # 4 a second arrive, about 0.55 leave
        else:
            tokens, prompts, held = tokens + 400.0, prompts + 4.0, 0.0
        clock.t = t
        p.counters = {"prefill_computed_tokens": tokens, "prefill_compute_seconds": t}
        p.histograms = {"phase_prefill_compute": HistogramData(buckets=[1.0], counts=[int(prompts), 0], sum=t)}
        chunking = 1.0 if long_phase else 0.0
        p.gauges = {
            "queue_waiting": held,
            "queue_prefilling": chunking,
            "prefill_backlog_tokens": 1800.0 * held + 900 * chunking,
        }
        p.request_stats(0)
        read[t] = views.build([reg.handles["prefill-0"]], (0.0, 0.0), t).prompt_tokens
    assert read[19.5] == pytest.approx(100.0)
    # the queue's own prompts, the one part-way through its chunks at its rest: (1800 + 900) / 2 at
    # first, then (1800 x held + 900) / (held + 1)
    assert read[20.5] == pytest.approx(1350.0) and all(read[22.0 + 0.5 * k] >= 1600 for k in range(17))
    assert read[36.0] < 400.0 and read[45.0] == pytest.approx(100.0, rel=0.05)


def test_a_prompt_slower_than_many_heartbeats_does_not_inflate_the_typical_prompt():
    """1,800-token prompts computed 100 tokens per 0.5 s heartbeat (9 s each, a loaded host): the
    tokens of the prompt part-way through count once it completes. Folding every heartbeat's tokens
    in with weights halving every 3 s read 17,349 tokens in a run on the loaded development host."""
    reg, metrics, clock = cluster()
    views = ViewBuilder()
    read = []
    for i in range(1, 73):
        t = 0.5 * i
        _prefill_heartbeat(reg, clock, t, tokens=100.0 * i, busy_s=0.1 * i, prompts=i // 18, hist_s=1.8 * (i // 18))
        read.append(views.build([reg.handles["prefill-0"]], (0.0, 0.0), t).prompt_tokens)
    assert all(p == pytest.approx(1800.0) for p in read[17:]), read


def test_a_decode_workers_own_prefill_is_in_its_view_as_a_rate_over_the_window():
    """decode-0 prefills 600 prompt tokens itself in 2 s (300 tok/s) and holds 900 more; 20 s later,
    with no heartbeat between and none computed since, the window's rate is 0."""
    reg, metrics, clock = cluster()
    c, views, rates = reg.handles["decode-0"].client, ViewBuilder(window_s=10.0), []
    for t, done, held in ((0.0, 100.0, 0.0), (2.0, 700.0, 900.0), (22.0, 700.0, 0.0)):
        clock.t = t
        c.counters = {"decode_steps": 0.0, "local_prefill_tokens": done}
        c.gauges = {"local_prefill_backlog_tokens": held, "local_prefill_backlog_ratio": 1.0}
        c.request_stats(0)
        (w,) = views.build([reg.handles["decode-0"]], (0.0, 0.0), t).of(Role.DECODE)
        rates.append((w.local_tps, w.local_backlog, w.local_ratio))
    assert rates == [(None, 0.0, 1.0), (pytest.approx(300.0), 900.0, 1.0), (0.0, 0.0, 1.0)]


def test_a_decode_workers_finish_rate_and_page_queue_growth_are_rates_over_the_window():
    """decode-0 ends 12 requests (10 finished, 2 aborted) in 4 s while the requests waiting for its
    pages go from 1 to 5: 3 requests/s end, the page queue grows by 1 per second."""
    reg, metrics, clock = cluster()
    c, views, seen = reg.handles["decode-0"].client, ViewBuilder(window_s=10.0), []
    for t, finished, aborted, waiting in ((0.0, 5.0, 0.0, 1.0), (4.0, 15.0, 2.0, 5.0)):
        clock.t = t
        c.counters = {"decode_steps": 0.0, "finished_requests": finished, "aborted_requests": aborted}
        c.gauges = {"queue_running": 8.0, "queue_prealloc": waiting}
        c.request_stats(0)
        (w,) = views.build([reg.handles["decode-0"]], (0.0, 0.0), t).of(Role.DECODE)
        seen.append((w.finish_rate, w.page_growth))
    assert seen == [(None, 0.0), (pytest.approx(3.0), pytest.approx(1.0))]


def test_a_request_waiting_longer_for_its_first_token_than_predicted_sets_the_ttft():
    """prefill-0 holds nothing (TTFT predicted 0.5 s, within the 1 s SLO), but a request the router
    forwarded 4 s ago has no first token yet (another, as old, streams already): TTFT is 4 s."""
    reg, metrics, clock = cluster()
    planner = Planner(reg, metrics, KNOBS, switch_timeout_s=5, clock=clock)
    heartbeat(reg, clock, 0.0, backlog=0)
    for rid in ("waits", "streams"):
        reg.table.open(rid, ("prefill-0", "decode-0"), "decode-0", 100).created -= 4.0
    reg.table.entry("streams").streamed = True
    decision = asyncio.run(planner.evaluate())
    assert decision.ttft_s == pytest.approx(4.0, abs=0.5) and "TTFT over its SLO" in decision.why
    reg.table.close("waits")
    assert reg.table.oldest_first_token_wait(time.monotonic()) == 0.0
