"""``pdserve bench serve --goodput``: the probes' Poisson schedule, SLO attainment, the rate search
against fake targets whose latency is a known function of the rate (so the goodput it finds is
checked exactly), the workloads, ``colocated-x2``, the flags and their errors, the reports; and one
short search against the shared PD launch. Nothing here asserts on speed."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.serve.client import RequestResult
from bench.serve.goodput import GoodputSpec, measure_point, search_goodput
from bench.serve.goodput_report import goodput_table, plot_goodput, points_table
from bench.serve.options import ServeOptions, add_serve_flags
from bench.serve.servers import launch_argv, parse_modes
from bench.serve.stats import SLO
from bench.serve.workload import PromptShape, WordCounter, make_requests


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return p.parse_args(list(argv))


def _opts(*argv: str) -> ServeOptions:
    return ServeOptions.from_args(_args(*argv))


def _bench(*argv: str):
    from bench.serve_bench import ServeBench

    a = _args(*argv)
    return ServeBench(a, ServeOptions.from_args(a), WordCounter())


def _result(ttft_s: float, tpot_s: float, n: int = 5, ok: bool = True) -> RequestResult:
    return RequestResult(
        0,
        "main",
        ok,
        10,
        n,
        ttft_s=ttft_s if ok else None,
        e2e_s=ttft_s + tpot_s * (n - 1),
        output_tokens=n if ok else 0,
        usage_reported=ok,
        error=None if ok else "HTTP 503: busy",
    )


# ---- the probes' Poisson schedule ---------------------------------------------------------------------
def test_probe_requests_are_seeded_poisson_at_the_asked_rate():
    bench = _bench(
        "--goodput",
        "--slo-ttft-ms",
        "1000",
        "--slo-tpot-ms",
        "100",
        "--num-requests",
        "3000",
        "--input-len-range",
        "4,8",
        "--output-len",
        "2",
    )
    a, b = bench.probe_requests(2.0), bench.probe_requests(2.0)
    assert a == b  # same rate, same seed: the same requests for every target
    times = [r.arrival_s for r in a]
    assert times[0] == 0 and all(y >= x for x, y in zip(times, times[1:]))
    assert (len(times) - 1) / times[-1] == pytest.approx(2.0, rel=0.06)
    other = bench.probe_requests(3.0)
    assert (len(other) - 1) / other[-1].arrival_s == pytest.approx(3.0, rel=0.06)
    assert not {r.prompt for r in a[:50]} & {r.prompt for r in other[:50]}  # another rate: other prompts
    reseeded = _bench(
        "--goodput",
        "--slo-ttft-ms",
        "1000",
        "--slo-tpot-ms",
        "100",
        "--num-requests",
        "3000",
        "--input-len-range",
        "4,8",
        "--output-len",
        "2",
        "--workload-seed",
        "1",
    ).probe_requests(2.0)
    assert reseeded != a


# ---- attainment -------------------------------------------------------------------------------------
def test_attainment_needs_both_slos_and_counts_failures_as_misses():
    slo = SLO(ttft_ms=500, tpot_ms=50)
    results = [
        _result(0.1, 0.04),
        _result(0.2, 0.04),
        _result(0.6, 0.04),  # TTFT 600 ms misses
        _result(0.1, 0.06),
        _result(0.1, 0.01, ok=False),
    ]  # TPOT 60 ms misses; a 503
    p = measure_point(2.0, results, duration_s=2.0, slo=slo, attainment=0.4)
    assert (p.requests, p.met, p.failed) == (5, 2, 1) and p.attainment == pytest.approx(0.4) and p.passed
    assert not measure_point(2.0, results, 2.0, slo, 0.41).passed
    assert p.ttft_p50_ms == pytest.approx(150) and p.ttft_p90_ms == pytest.approx(480)  # [100 100 200 600]
    assert p.tpot_p50_ms == pytest.approx(40) and p.tpot_p90_ms == pytest.approx(54)  # [40 40 40 60]
    assert p.output_tok_s == pytest.approx(4 * 5 / 2.0)
    empty = measure_point(1.0, [], 1.0, slo, 0.9)
    assert not empty.passed and empty.ttft_p50_ms is None


# ---- the search against fake targets ------------------------------------------------------------------
def _fake_target(ttft_ms_per_rate: float, tpot_ms_per_rate: float, n: int = 10):
    """A target whose request i (of n) has TTFT = rate x (i+1) x ``ttft_ms_per_rate`` and every TPOT
    = rate x ``tpot_ms_per_rate``; it records the rates it was probed at."""
    seen: list[float] = []

    def probe(rate: float, spec: GoodputSpec):
        seen.append(rate)
        rs = [_result(rate * (i + 1) * ttft_ms_per_rate / 1000, rate * tpot_ms_per_rate / 1000) for i in range(n)]
        return measure_point(rate, rs, 1.0, spec.slo, spec.attainment)

    return probe, seen


def _search(spec: GoodputSpec, ttft_ms_per_rate: float, tpot_ms_per_rate: float):
    probe, seen = _fake_target(ttft_ms_per_rate, tpot_ms_per_rate)
    return search_goodput("fake", spec, lambda rate: probe(rate, spec)), seen


def test_doubles_then_bisects_to_the_ttft_bound():
    # TTFT SLO 100 ms, TTFT_i = rate x (i+1) x 10 ms: 9 of 10 requests meet it iff rate <= 10/9
    spec = GoodputSpec(SLO(100, 1000), 0.9, start_rate=0.25, max_rate=64, iters=5, min_step=0.0)
    res, seen = _search(spec, 10, 1)
    assert seen == [0.25, 0.5, 1, 2, 1.5, 1.25, 1.125, 1.0625, 1.09375]
    assert (res.goodput, res.first_failing, res.capped) == (1.09375, 1.125, False)
    assert [p.passed for p in res.points] == [True, True, True, False, False, False, False, True, True]
    assert res.points[2].attainment == 1.0 and res.points[3].attainment == 0.5  # rate 2: floor(10/2) of 10


def test_the_tpot_slo_binds_as_well():
    # TTFT always fine; TPOT = rate x 45 ms against 50 ms: every request passes iff rate <= 1.11
    spec = GoodputSpec(SLO(10_000, 50), 0.9, start_rate=1, max_rate=64, iters=3, min_step=0.0)
    res, seen = _search(spec, 0.001, 45)
    assert seen == [1, 2, 1.5, 1.25, 1.125]
    assert (res.goodput, res.first_failing) == (1, 1.125)
    assert res.points[1].attainment == 0.0


def test_min_step_stops_the_bisection_and_iters_bounds_it():
    spec = GoodputSpec(SLO(100, 1000), 0.9, start_rate=0.25, iters=10, min_step=0.3)
    res, seen = _search(spec, 10, 1)
    assert seen == [0.25, 0.5, 1, 2, 1.5, 1.25]  # stops once 1 .. 1.25 is no wider than 0.3
    assert (res.goodput, res.first_failing) == (1, 1.25)
    res, seen = _search(GoodputSpec(SLO(100, 1000), 0.9, start_rate=0.25, iters=0), 10, 1)
    assert seen == [0.25, 0.5, 1, 2] and (res.goodput, res.first_failing) == (1, 2)


def test_a_failing_start_rate_bisects_down_from_zero_and_may_find_nothing():
    spec = GoodputSpec(SLO(100, 1000), 0.9, start_rate=4, iters=3, min_step=0.0)
    res, seen = _search(spec, 10, 1)
    assert seen == [4, 2, 1, 1.5] and (res.goodput, res.first_failing) == (1, 1.5)
    res, seen = _search(GoodputSpec(SLO(100, 1000), 0.9, start_rate=4, iters=2), 1000, 1)  # fails everywhere
    assert seen == [4, 2, 1] and (res.goodput, res.first_failing, res.capped) == (0.0, 1, False)


def test_doubling_stops_at_the_max_rate_and_says_capped():
    spec = GoodputSpec(SLO(100, 1000), 0.9, start_rate=0.01, max_rate=0.05)
    res, seen = _search(spec, 10, 1)
    assert seen == [0.01, 0.02, 0.04] and res.goodput == 0.04 and res.capped and res.first_failing is None
    assert "| fake | >= 0.04 | - | 3 | 1.00x |" in goodput_table([res], spec)


# ---- reports ----------------------------------------------------------------------------------------
def test_tables_json_and_plot(tmp_path):
    spec = GoodputSpec(SLO(100, 1000), 0.9, start_rate=0.25, iters=2, min_step=0.0)
    a, _ = _search(spec, 10, 1)  # goodput 1
    b, _ = _search(spec, 5, 1)  # twice as fast: 2 passes, 4 fails, then 3 fails and 2.5 fails
    b.target = "pd"
    assert (a.goodput, b.goodput) == (1, 2)
    table = goodput_table([a, b], spec)
    assert "TTFT 100 ms and TPOT 1000 ms" in table and ">= 90%" in table
    assert "| fake | 1 | 1.25 | 6 | 1.00x |" in table and "| pd | 2 | 2.5 | 7 | 2.00x |" in table
    points = points_table([a, b])
    assert "| fake | 2 | 50.0% | 5/10 | 0 | 110 | 182 | 2 | 2 | 50.0 | no |" in points
    assert json.loads(json.dumps(b.to_dict()))["points"][1]["rate"] == 0.5
    plot_goodput([a, b], spec, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- workloads, modes and flags ---------------------------------------------------------------------
def test_workloads_set_prompt_and_output_lengths():
    chat, summ = (
        _opts("--workload", "chat"),
        _opts("--workload", "summarize", "--goodput", "--slo-ttft-ms", "9", "--slo-tpot-ms", "9"),
    )
    assert (chat.input_range, chat.output_range) == ((64, 256), (128, 128))
    assert (summ.input_range, summ.output_range) == ((1500, 2000), (32, 64))
    assert _opts().output_range == (64, 64) and _opts("--output-len-range", "3,9").output_range == (3, 9)
    reqs = make_requests(PromptShape(200, 5, 9, 32, output_max=64), WordCounter(), seed=0)
    assert {r.output_len for r in reqs} <= set(range(32, 65)) and len({r.output_len for r in reqs}) > 10
    assert {r.output_len for r in make_requests(PromptShape(20, 5, 9, 32), WordCounter(), seed=0)} == {32}
    assert _bench("--workload", "summarize").shape.output_max == 64


def test_grounded_workload_asks_to_repeat_a_passage_of_its_lengths():
    """``--workload grounded``: a passage of 192-320 tokens, then the task that makes the answer
    quote it (speculation's case); the other workloads have no task."""
    bench = _bench("--workload", "grounded")
    assert (bench.o.input_range, bench.o.output_range) == ((192, 320), (128, 128))
    reqs = make_requests(bench.shape, WordCounter(), seed=3)
    task = "\n\nRepeat the text above word for word."
    assert all(r.prompt.endswith(task) for r in reqs)
    assert all(192 <= len(r.prompt[: -len(task)].split()) <= 320 for r in reqs)
    assert all(r.prompt.endswith(task) for r in make_requests(bench.warm_shape, WordCounter(), seed=1))
    assert _bench("--workload", "chat").shape.instruction == "" and _opts().instruction == ""


def test_colocated_x2_is_two_pinned_replicas():
    assert parse_modes("colocated-x2,pd") == ["colocated-x2", "pd"]
    argv = launch_argv("colocated-x2", ["--kv-pool-tokens", "16384"])
    assert argv[:6] == ["--mode", "colocated", "--replicas", "2", "--worker-cpus", "auto"]
    assert argv[-2:] == ["--kv-pool-tokens", "16384"]
    assert launch_argv("colocated-x3+cache-aware", [])[:8] == [
        "--mode",
        "colocated",
        "--replicas",
        "3",
        "--worker-cpus",
        "auto",
        "--routing",
        "cache-aware",
    ]
    for bad in ("colocated-x0", "colocated-x", "pd-x2", "colocated-x2,colocated-x2"):
        with pytest.raises(ValueError, match="--compare"):
            parse_modes(bad)


def test_ngram_option_launches_the_same_mode_with_speculation():
    """``+ngram`` adds ``--speculative-method ngram`` (with or without a routing), a mode without it
    ``--speculative-method off``, so one run compares a server with and without drafts; an option
    named twice or two routings are refused."""
    assert parse_modes("colocated,colocated+ngram") == ["colocated", "colocated+ngram"]
    assert launch_argv("colocated+ngram", [])[:4] == ["--mode", "colocated", "--speculative-method", "ngram"]
    assert launch_argv("pd+cache-aware+ngram", [])[:6] == [
        "--mode",
        "pd",
        "--routing",
        "cache-aware",
        "--speculative-method",
        "ngram",
    ]
    plain = launch_argv("colocated", [])  # speculation is on by default: a mode without +ngram turns it off
    assert plain[plain.index("--speculative-method") + 1] == "off"
    assert launch_argv("colocated+ngram", []).count("--speculative-method") == 1
    for bad in ("colocated+ngram+ngram", "pd+cache-aware+least-loaded", "pd+eagle"):
        with pytest.raises(ValueError, match="--compare"):
            parse_modes(bad)


def test_goodput_flags_parse():
    o = _opts(
        "--goodput",
        "--slo-ttft-ms",
        "1000",
        "--slo-tpot-ms",
        "100",
        "--slo-attainment",
        "0.95",
        "--goodput-start-rate",
        "0.5",
        "--goodput-max-rate",
        "8",
        "--goodput-iters",
        "6",
        "--goodput-min-step",
        "0.1",
        "--num-requests",
        "48",
        "--json-out",
        "x.json",
    )
    assert o.goodput == GoodputSpec(SLO(1000, 100), 0.95, 0.5, 8, 6, 0.1)
    assert o.concurrency is None and o.request_rates is None
    assert _args("--num-requests", "48").num_prompts == 48 and _args("--json-out", "x.json").out == "x.json"
    assert _opts("--goodput", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1").goodput == GoodputSpec(SLO(1, 1))
    assert _opts("--concurrency", "2").goodput is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--goodput",), "needs both --slo-ttft-ms and --slo-tpot-ms"),
        (("--goodput", "--slo-ttft-ms", "100"), "needs both"),
        (("--goodput", "--slo-ttft-ms", "0", "--slo-tpot-ms", "5"), "must be > 0"),
        (("--goodput", "--slo-ttft-ms", "9", "--slo-tpot-ms", "9", "--request-rate", "1,2"), "drop --request-rate"),
        (("--goodput", "--slo-ttft-ms", "9", "--slo-tpot-ms", "9", "--concurrency", "4"), "drop --concurrency"),
        (("--goodput", "--slo-ttft-ms", "9", "--slo-tpot-ms", "9", "--slo-attainment", "1.5"), "in \\(0, 1\\]"),
        (
            (
                "--goodput",
                "--slo-ttft-ms",
                "9",
                "--slo-tpot-ms",
                "9",
                "--goodput-start-rate",
                "9",
                "--goodput-max-rate",
                "4",
            ),
            "--goodput-start-rate must be > 0 and <= --goodput-max-rate",
        ),
        (("--goodput", "--slo-ttft-ms", "9", "--slo-tpot-ms", "9", "--goodput-iters", "-1"), "--goodput-iters"),
        (
            ("--slo-attainment", "0.9", "--goodput-iters", "3"),
            "--slo-attainment, --goodput-iters only apply with --goodput",
        ),
        (("--workload", "chat", "--input-len", "64", "--output-len", "9"), "drop --input-len, --output-len"),
        (("--workload", "chat", "--multi-turn"), "drop --workload"),
        (("--output-len-range", "9,3"), "--output-len-range takes LO,HI"),
        (("--compare", "colocated-x0"), "--compare"),
    ],
)
def test_bad_flag_combinations_are_refused_with_what_to_change(argv, message):
    with pytest.raises(ValueError, match=message):
        _opts(*argv)


def test_cli_exits_2_and_names_the_flag(capsys):
    from bench.cli import main

    assert main(["serve", "--goodput", "--slo-ttft-ms", "100", "--tokenizer", "words"]) == 2
    assert "--goodput needs both --slo-ttft-ms and --slo-tpot-ms" in capsys.readouterr().err


# ---- a real search --------------------------------------------------------------------------------
@pytest.mark.process
def test_goodput_search_against_the_shared_pd_launch(pd_server, tmp_path, capsys):
    """Two searches of two probes each (4 tiny requests per probe): a generous SLO passes at 4 and 8
    req/s and stops at --goodput-max-rate (capped); an impossible TPOT SLO fails at 4 and at 2."""
    from bench.cli import main

    common = [
        "serve",
        "--base-url",
        pd_server.url,
        "--goodput",
        "--num-requests",
        "4",
        "--input-len-range",
        "16,32",
        "--output-len",
        "4",
        "--warmup",
        "0",
        "--goodput-start-rate",
        "4",
        "--no-progress",
    ]
    out = tmp_path / "ok.json"
    assert (
        main(
            [
                *common,
                "--slo-ttft-ms",
                "120000",
                "--slo-tpot-ms",
                "60000",
                "--goodput-max-rate",
                "8",
                "--json-out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    (search,) = data["goodput"]["targets"]
    assert (search["target"], search["goodput"], search["capped"]) == ("server", 8, True)
    assert [(p["rate"], p["requests"], p["met"], p["failed"]) for p in search["points"]] == [(4, 4, 4, 0), (8, 4, 4, 0)]
    assert all(0 < p["ttft_p50_ms"] <= p["ttft_p90_ms"] and p["output_tok_s"] > 0 for p in search["points"])
    assert [r["load"] for r in data["runs"]] == ["rate=4", "rate=8"]
    assert all(q["ok"] and q["output_tokens"] == 4 for r in data["runs"] for q in r["requests"])
    assert "| server | >= 8 | - | 2 |" in capsys.readouterr().out
    out = tmp_path / "miss.json"
    assert (
        main(
            [
                *common,
                "--slo-ttft-ms",
                "120000",
                "--slo-tpot-ms",
                "0.001",
                "--goodput-iters",
                "1",
                "--json-out",
                str(out),
            ]
        )
        == 0
    )  # SLO misses are measurements, not failed requests
    (search,) = json.loads(out.read_text())["goodput"]["targets"]
    assert (search["goodput"], search["first_failing"]) == (0, 2)
    assert [(p["rate"], p["met"], p["failed"], p["passed"]) for p in search["points"]] == [
        (4, 0, 0, False),
        (2, 0, 0, False),
    ]
