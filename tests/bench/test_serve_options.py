"""``pdserve bench serve``'s options and reports: flags parsed and refused naming the flag, prompts
per client per closed-loop level, external targets beside the launched modes, the launch flags,
the ratios between modes and the plot."""

from __future__ import annotations

import math

import pytest

from bench.serve.options import ServeOptions, add_serve_flags
from bench.serve.report import RunRecord, plot, ratios
from bench.serve.servers import config_flags, launch_argv, parse_modes
from bench.serve.stats import RunStats, Summary


# ---- options and reports ----------------------------------------------------------------------------
def _opts(*argv: str) -> ServeOptions:
    import argparse

    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return ServeOptions.from_args(p.parse_args(list(argv)))


def test_options_parse_and_refuse_with_the_flag_named():
    o = _opts(
        "--concurrency",
        "1,8,32",
        "--input-len-range",
        "112,289",
        "--compare",
        "colocated,pd",
        "--server-args",
        "--max-running-requests 64",
    )
    assert o.concurrency == [1, 8, 32] and o.input_range == (112, 289) and o.modes == ["colocated", "pd"]
    assert o.server_args == ["--max-running-requests", "64"] and o.request_rates is None
    assert _opts().concurrency == [1] and _opts("--input-len", "50").input_range == (50, 50)
    assert _opts("--request-rate", "0.5,inf").request_rates == [0.5, math.inf]
    for argv, flag in (
        (("--concurrency", "2", "--request-rate", "1"), "not both"),
        (("--concurrency", "0"), "--concurrency"),
        (("--input-len-range", "9,3"), "--input-len-range"),
        (("--compare", "colocated,vllm"), "--compare"),
        (("--interference",), "--request-rate"),
    ):
        with pytest.raises(ValueError, match=flag):
            _opts(*argv)
    assert parse_modes("pd") == ["pd"]


def test_prompts_per_client_scales_each_closed_loop_level():
    """4 requests per client: 4 at c=1 and 32 at c=8 (not one burst of 8 that drains), whatever
    --num-prompts says; refused without a closed loop."""
    import argparse

    from bench.serve_bench import ServeBench

    p = argparse.ArgumentParser()
    add_serve_flags(p)
    a = p.parse_args(["--concurrency", "1,8", "--prompts-per-client", "4", "--num-prompts", "5"])
    bench = ServeBench(a, ServeOptions.from_args(a), counter=None)
    assert [bench._shape(c).num_prompts for c in (1, 8)] == [4, 32]
    a = p.parse_args(["--concurrency", "8", "--num-prompts", "5"])
    assert ServeBench(a, ServeOptions.from_args(a), counter=None)._shape(8).num_prompts == 5
    for argv in (
        ("--request-rate", "1", "--prompts-per-client", "2"),
        ("--concurrency", "2", "--prompts-per-client", "0"),
    ):
        with pytest.raises(ValueError, match="--prompts-per-client"):
            _opts(*argv)


def test_external_targets_join_the_launched_modes_in_run_order():
    o = _opts(
        "--compare",
        "colocated,pd",
        "--target",
        "vllm=http://127.0.0.1:8100/",
        "--target",
        "llama=http://127.0.0.1:8200",
    )
    assert o.targets == (("vllm", "http://127.0.0.1:8100"), ("llama", "http://127.0.0.1:8200"))
    assert o.target_names == ["colocated", "pd", "vllm", "llama"]
    assert _opts().target_names == [] and _opts("--target", "v=http://h:1").target_names == ["v"]
    for argv, msg in (
        (("--target", "vllm"), "NAME=http"),
        (("--target", "v=127.0.0.1:1"), "NAME=http"),
        (("--compare", "pd", "--target", "pd=http://h:1"), "used twice"),
        (("--target", "v=http://a:1", "--target", "v=http://b:1"), "used twice"),
    ):
        with pytest.raises(ValueError, match=msg):
            _opts(*argv)


def test_launch_flags():
    assert config_flags({"kv_pool_tokens": 8192, "model": "default", "max_model_len": None, "x": True, "y": False}) == [
        "--kv-pool-tokens",
        "8192",
        "--model",
        "default",
        "--x",
        "--no-y",
    ]
    argv = launch_argv("pd", ["--kv-pool-tokens", "64"])
    assert argv[:6] == ["--mode", "pd", "--speculative-method", "off", "--port", "0"]
    assert argv[-2:] == ["--kv-pool-tokens", "64"]


def _record(target, conc, ttft_ms, tpot_ms, tok_s):
    s = RunStats(
        4,
        4,
        0,
        1.0,
        40,
        int(tok_s),
        4.0,
        tok_s,
        0,
        Summary(4, ttft_ms, ttft_ms, 2 * ttft_ms),
        Summary(4, tpot_ms, tpot_ms, tpot_ms),
        Summary(4, 1, 1, 1),
        Summary(4, 9, 9, 9),
    )
    return RunRecord(target, f"c={conc}", conc, None, s, [])


def test_ratios_and_plot(tmp_path):
    recs = [
        _record("colocated", 1, 100, 50, 20),
        _record("colocated", 8, 400, 80, 60),
        _record("pd", 1, 150, 40, 15),
        _record("pd", 8, 200, 40, 90),
    ]
    rows = ratios(recs, "colocated", "pd")
    assert [r["load"] for r in rows] == ["c=1", "c=8"]
    assert rows[0]["TTFT mean"] == pytest.approx(1.5) and rows[0]["TTFT p99"] == pytest.approx(1.5)
    assert rows[1]["TPOT p99"] == pytest.approx(0.5) and rows[1]["tok/s"] == pytest.approx(1.5)
    out = tmp_path / "p.png"
    plot(recs, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    interference = []
    for target in ("colocated", "pd"):
        for kind in ("short", "long", "mixed"):
            r = _record(target, 1, 100, 50, 20)
            interference.append(RunRecord(target, "short 1/s", None, None, r.stats, [], kind=kind))
    assert [r["kind"] for r in ratios(interference, "colocated", "pd")] == ["short", "long", "mixed"]
    plot(interference, tmp_path / "i.png")
    assert (tmp_path / "i.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
