"""The bursty-trace goodput benchmark's pieces, in process: the phase plan, the seeded trace (phase
kinds, arrival windows, lengths, rates), the goodput accounting over hand-built results (both SLOs,
failures, the trace-length denominator), the planner / best-static ratio, the table, and the
launch flags of each configuration."""

from __future__ import annotations

import pytest

from bench.serve.client import RequestResult
from bench.serve.runner import Measured
from bench.serve.stats import SLO
from bench.serve.workload import WordCounter
from benchmarks import bursty_trace as bursty
from benchmarks import load_calibration as cal
from benchmarks.role_goodput import WARMUP, Calibrated, parse_args, server_flags, trace_runs

KINDS = bursty.default_kinds(prefill_rate=2.0, decode_rate=4.0)


def test_phase_plan_alternates_or_holds_one_kind():
    assert bursty.phase_plan(2) == [bursty.PREFILL, bursty.DECODE, bursty.PREFILL, bursty.DECODE]
    assert bursty.phase_plan(2, bursty.DECODE) == [bursty.DECODE] * 4
    with pytest.raises(ValueError):
        bursty.phase_plan(0)
    with pytest.raises(ValueError):
        bursty.phase_plan(1, "mixed")


def test_the_trace_follows_its_phases_and_is_seeded():
    plan = bursty.phase_plan(2)
    trace = bursty.make_trace(plan, KINDS, 10.0, WordCounter(), seed=3)
    assert trace == bursty.make_trace(plan, KINDS, 10.0, WordCounter(), seed=3)
    assert trace != bursty.make_trace(plan, KINDS, 10.0, WordCounter(), seed=4)
    assert [r.index for r in trace] == list(range(len(trace)))
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    for r in trace:
        phase = int(r.arrival_s // 10.0)
        assert r.kind == plan[phase]
        lo, hi = KINDS[r.kind].input_range
        assert lo <= r.prompt_len <= hi and r.output_len == KINDS[r.kind].output_len
    by_kind = {k: sum(r.kind == k for r in trace) for k in KINDS}
    # 2 phases of 10 s each kind: about 2*10*2 = 40 prefill-heavy and 2*10*4 = 80 decode-heavy
    assert 25 <= by_kind[bursty.PREFILL] <= 55 and 60 <= by_kind[bursty.DECODE] <= 100
    assert {r.prompt_len for r in trace if r.kind == bursty.DECODE} == {100}


def test_phase_arrivals_keep_to_the_phase():
    import random

    times = bursty.phase_arrivals(50.0, 2.0, random.Random(0))
    assert times == sorted(times) and 0 < times[0] and times[-1] < 2.0 and 70 <= len(times) <= 130


def _r(i: int, ttft: float, tpot: float, ok: bool = True, n: int = 11) -> RequestResult:
    r = RequestResult(i, "x", ok, 100, n, ttft_s=ttft, e2e_s=ttft + tpot * (n - 1), output_tokens=n)
    if not ok:
        r.error = "HTTP 500"
    return r


SLO_ = SLO(ttft_ms=1000, tpot_ms=100)


def test_goodput_counts_requests_meeting_both_slos_over_the_trace_length():
    results = [_r(0, 0.5, 0.05), _r(1, 0.9, 0.099), _r(2, 1.5, 0.05), _r(3, 0.5, 0.2), _r(4, 0.1, 0.01, ok=False)]
    o = bursty.outcome("1p2d", "bursty", results, trace_s=20.0, slo=SLO_, role_switches=0)
    assert (o.requests, o.met, o.failed) == (5, 2, 1)
    assert o.goodput == pytest.approx(2 / 20.0) and o.met_share == pytest.approx(0.4)
    assert o.ttft_p50_ms == pytest.approx(700.0)  # of the four that succeeded: 0.5, 0.5, 0.9, 1.5
    assert o.tpot_p99_ms == pytest.approx(197.0)  # 50, 50, 99, 200: 99 + 0.97 * 101
    with pytest.raises(ValueError):
        bursty.outcome("x", "t", results, 20.0, SLO(ttft_ms=1000))


def test_the_ratio_is_the_planner_over_the_best_static_split_of_the_same_trace():
    good = [_r(i, 0.5, 0.05) for i in range(6)]
    rows = [
        bursty.outcome("1p2d", "bursty", good[:2], 10.0, SLO_),
        bursty.outcome("2p1d", "bursty", good[:4], 10.0, SLO_),
        bursty.outcome("planner", "bursty", good[:5], 10.0, SLO_, role_switches=3, planner=True),
        bursty.outcome("1p2d", "steady", good[:4], 10.0, SLO_),
        bursty.outcome("planner", "steady", good[:2], 10.0, SLO_, planner=True),
    ]
    assert bursty.planner_ratio(rows, "bursty") == pytest.approx(1.25)
    assert bursty.planner_ratio(rows, "steady") == pytest.approx(0.5)
    assert bursty.planner_ratio(rows, "nothing") is None
    table = bursty.goodput_table(rows)
    assert [row[-1] for row in table] == [None, None, pytest.approx(1.25), None, pytest.approx(0.5)]
    assert table[2][bursty.COLUMNS.index("role switches")] == 3
    text = bursty.format_table(table).splitlines()
    assert text[0].split()[:2] == ["trace", "configuration"] and len(text) == 6
    assert text[1].split()[-1] == "-" and text[3].split()[-1] == "1.25"


def test_a_static_split_that_met_nothing_gives_no_ratio():
    rows = [
        bursty.outcome("1p2d", "bursty", [_r(0, 5.0, 0.05)], 10.0, SLO_),
        bursty.outcome("planner", "bursty", [_r(0, 0.5, 0.05)], 10.0, SLO_, planner=True),
    ]
    assert bursty.planner_ratio(rows, "bursty") is None


def test_only_the_planner_configuration_launches_the_planner():
    args = parse_args(["--slo-ttft-ms", "3000", "--slo-tpot-ms", "150", "--planner-start", "2p1d"])
    static, planned = server_flags("1p2d", args), server_flags("planner", args)
    assert "--planner" not in static and static[:4] == ["--prefill", "1", "--decode", "2"]
    assert planned[:4] == ["--prefill", "2", "--decode", "1"]
    i = planned.index("--planner")
    assert planned[i + 1] == "slo" and planned[planned.index("--slo-tpot-ms") + 1] == "150.0"
    with pytest.raises(SystemExit):
        parse_args(["--slo-ttft-ms", "1", "--slo-tpot-ms", "1", "--configs", "3p0d"])


def test_an_empty_configs_list_runs_the_steady_trace_alone():
    slo = ["--slo-ttft-ms", "3000", "--slo-tpot-ms", "150"]
    both = trace_runs(parse_args([*slo, "--steady", "decode-heavy"]))
    assert [(name, configs) for name, _, configs in both] == [
        ("bursty", ["1p2d", "2p1d", "planner"]),
        ("steady decode-heavy", ["1p2d", "2p1d", "planner"]),
    ]
    alone = trace_runs(parse_args([*slo, "--configs", "", "--steady", "decode-heavy", "--steady-configs", "planner"]))
    assert [(name, configs) for name, _, configs in alone] == [("steady decode-heavy", ["planner"])]
    assert alone[0][1] == ["decode-heavy"] * 4


def test_the_step_fit_goes_through_both_probes_and_clamps_a_flat_one():
    fit = cal.fit_step(1, 0.010, 9, 0.018)  # 1 ms per row, 9 rows fixed
    assert fit.per_row_s == pytest.approx(0.001) and fit.fixed_rows == pytest.approx(9.0)
    assert fit.step_s(1) == pytest.approx(0.010) and fit.step_s(9) == pytest.approx(0.018)
    flat = cal.fit_step(1, 0.020, 8, 0.019)  # noise: the batch was no slower
    assert flat.fixed_rows == cal.MAX_FIXED_ROWS and flat.step_s(8) == pytest.approx(0.019)
    with pytest.raises(ValueError):
        cal.fit_step(8, 0.01, 1, 0.02)


def test_one_decode_worker_sustains_the_rows_its_slo_and_kv_pool_allow():
    fit = cal.StepFit(per_row_s=0.002, fixed_rows=5.0)
    # TPOT SLO 100 ms: 100/2 - 5 = 45 rows; KV 36,000 / 356 = 101 rows: the SLO binds
    c = cal.decode_capacity(fit, 0.100, answer_len=256, request_tokens=356, kv_pool_tokens=36_000)
    assert c.slo_rows == pytest.approx(45.0) and c.rows == pytest.approx(45.0)
    assert c.rate == pytest.approx(45 / (256 * 0.100))  # Little: rows / (answer x step at those rows)
    small = cal.decode_capacity(fit, 0.100, 256, 356, kv_pool_tokens=16_384)  # 46.0 KV rows
    tiny = cal.decode_capacity(fit, 0.100, 256, 356, kv_pool_tokens=7_120)  # 20 KV rows: the pool binds
    assert small.rows == pytest.approx(45.0) and tiny.rows == pytest.approx(20.0)
    assert tiny.rate == pytest.approx(20 / (256 * 0.002 * 25))
    with pytest.raises(ValueError):
        cal.decode_capacity(fit, 0.010, 256, 356, 36_000)  # one row's step (12 ms) misses the SLO


def test_the_phase_rates_are_loads_of_one_workers_capacity():
    pre = cal.prefill_capacity([1500, 2000], [0.4, 0.6])
    assert pre.ttft_s == pytest.approx(0.5) and pre.rate == pytest.approx(2.0) and pre.tokens_per_s == 3500
    dec = cal.decode_capacity(cal.StepFit(0.002, 5.0), 0.1, 256, 356, 36_000)
    kinds = bursty.default_kinds(1.0, 1.0)
    both = cal.calibrated_kinds(kinds, cal.Calibration("1p2d", pre, dec), prefill_load=1.4, decode_load=2.0)
    assert both[bursty.PREFILL].rate == pytest.approx(2.8) and both[bursty.DECODE].rate == pytest.approx(
        2.0 * dec.rate, abs=1e-4
    )
    assert both[bursty.PREFILL].input_range == (1500, 2000) and both[bursty.DECODE].output_len == 256
    given = cal.calibrated_kinds(bursty.default_kinds(1.0, 0.3), cal.Calibration("1p2d", pre, None), 1.4, 1.4)
    assert given[bursty.DECODE].rate == 0.3 and given[bursty.PREFILL].rate == pytest.approx(2.8)
    text = cal.describe(cal.Calibration("1p2d", pre, None), given, 1.4, 1.4)
    assert "2.8 req/s = 1.4 x one prefill worker (3500 prompt tok/s" in text and "0.3 req/s (given)" in text
    with pytest.raises(ValueError):
        cal.prefill_capacity([1500], [])


def test_one_slow_prompt_does_not_set_the_prefill_capacity():
    # a host busy for a moment under one of three prompts: the mean read 4.0 s, the worker serves in 1.6
    pre = cal.prefill_capacity([1800, 1800, 1800], [1.5, 9.0, 1.6])
    assert pre.ttft_s == pytest.approx(1.6) and pre.rate == pytest.approx(1 / 1.6)
    assert pre.tokens_per_s == pytest.approx(1125.0) and pre.ttfts_s == (1.5, 9.0, 1.6)


def test_the_prefill_probe_times_prompts_only_after_warm_long_ones(monkeypatch):
    """A cluster's first long prompts pay first-use costs the trace's later ones do not: the probe
    drops its first ``PREFILL_WARM_PROMPTS`` prompts of the phase's own length range."""
    sent: list[list] = []

    async def closed_loop(cfg, specs, concurrency, progress=True):
        sent.append(list(specs))
        longs = sum(s.prompt_len >= 1500 for batch in sent[:-1] for s in batch)
        out = []
        for s in specs:
            ttft = 0.2
            if s.prompt_len >= 1500:  # the first long prompts pay 12 s, then 6 s; warm ones 1.5 s
                ttft, longs = (12.0, 6.0, 1.5)[min(longs, 2)], longs + 1
            out.append(RequestResult(s.index, s.kind, True, s.prompt_len, s.output_len, ttft_s=ttft, e2e_s=ttft))
        return Measured(out, 1.0)

    monkeypatch.setattr(cal, "closed_loop", closed_loop)
    warmup = list(WARMUP)
    pre, dec = cal.probe(
        None, KINDS, (1, 2), True, False, slo_tpot_s=0.15, kv_pool_tokens=16384,
        counter=WordCounter(), seed=1, warmup=warmup,
    )  # fmt: skip
    assert dec is None and [len(b) for b in sent] == [len(warmup), cal.PREFILL_WARM_PROMPTS + 4]
    assert all(1500 <= s.prompt_len <= 2000 and s.output_len == 2 for s in sent[1])
    assert pre.ttft_s == pytest.approx(1.5) and pre.ttfts_s == (1.5,) * 4


def test_rates_are_loads_unless_given():
    args = parse_args(["--slo-ttft-ms", "3000", "--slo-tpot-ms", "150"])
    assert (args.prefill_load, args.decode_load, args.prefill_rate, args.decode_rate) == (1.4, 1.4, None, None)
    args = parse_args(["--slo-ttft-ms", "3000", "--slo-tpot-ms", "150", "--decode-rate", "0.5"])
    assert args.decode_rate == 0.5 and args.prefill_rate is None


def test_explicit_rates_probe_nothing():
    args = parse_args(
        ["--slo-ttft-ms", "3000", "--slo-tpot-ms", "150", "--prefill-rate", "0.2", "--decode-rate", "0.5"]
    )
    source = Calibrated(args)
    kinds = source.kinds(None, (1, 2), "1p2d")  # no cluster: a probe would fail on it
    assert (kinds[bursty.PREFILL].rate, kinds[bursty.DECODE].rate) == (0.2, 0.5)
    assert source.calibration == cal.Calibration("1p2d", None, None) and "(given)" in source.describe()


def test_the_phase_table_splits_each_configuration_by_phase_kind():
    def rec(config, kind, ttft, tpot, error=None):
        return {"trace": "bursty", "config": config, "kind": kind, "ttft_s": ttft, "tpot_s": tpot, "error": error}

    raw = [
        rec("1p2d", bursty.PREFILL, 4.0, 0.05),
        rec("1p2d", bursty.PREFILL, 0.5, 0.05),
        rec("1p2d", bursty.DECODE, 0.2, 0.09),
        rec("1p2d", bursty.DECODE, 0.2, 0.3),
        rec("1p2d", bursty.DECODE, None, None, error="HTTP 500"),
        rec("2p1d", bursty.PREFILL, 0.3, None),  # one token: no TPOT, meets it
    ]
    rows = bursty.phase_table(raw, SLO_)
    assert rows == [
        ["bursty", "1p2d", bursty.PREFILL, 2, 1, 2250.0, 50.0, 0],
        ["bursty", "1p2d", bursty.DECODE, 3, 1, 200.0, 195.0, 1],
        ["bursty", "2p1d", bursty.PREFILL, 1, 1, 300.0, None, 0],
    ]
    text = bursty.format_rows(bursty.PHASE_COLUMNS, rows).splitlines()
    assert text[0].split()[:3] == ["trace", "configuration", "phase"] and text[3].split()[-2] == "-"


def test_the_phase_ceiling_takes_each_phase_kind_at_its_better_static_split():
    """1p2d meets 6 prefill-heavy and 296 decode-heavy requests, 2p1d 37 and 152: each phase at its
    better split meets 333, 1.103x 1p2d's 302; the planner's rows are not candidates."""
    phases = [
        ["bursty", "1p2d", bursty.PREFILL, 57, 6, None, None, 0],
        ["bursty", "1p2d", bursty.DECODE, 339, 296, None, None, 0],
        ["bursty", "2p1d", bursty.PREFILL, 57, 37, None, None, 0],
        ["bursty", "2p1d", bursty.DECODE, 339, 152, None, None, 0],
        ["bursty", "planner", bursty.PREFILL, 57, 57, None, None, 0],
        ["bursty", "planner", bursty.DECODE, 339, 339, None, None, 0],
    ]

    def outcome(config: str, met: int, planner: bool = False) -> bursty.Outcome:
        return bursty.Outcome(config, "bursty", 396, met, 0, 240.0, met / 240, met / 396, *[None] * 4, 0, planner)

    rows = [outcome("1p2d", 302), outcome("2p1d", 189), outcome("planner", 335, planner=True)]
    assert bursty.phase_ceiling(phases, rows) == {"bursty": (333, 1.103)}
