"""Goodput of static prefill/decode splits against the SLO planner on a bursty trace, in one run.

Three PD workers. The trace alternates prefill-heavy phases (1,500-2,000-token prompts, 16-token
answers) and decode-heavy phases (100-token prompts, 256-token answers), ``--phase-s`` seconds
each, ``--cycles`` pairs, open-loop Poisson arrivals at ``--prefill-rate`` / ``--decode-rate``
req/s, seeded (``benchmarks.bursty_trace``). For each configuration of ``--configs`` (``1p2d``,
``2p1d``: static splits; ``planner``: ``--planner-start`` with ``--planner slo`` and the same SLOs)
it launches a fresh server, warms it up, replays the trace and counts the requests that met both
SLOs, then prints one table: goodput (req/s and share), TTFT/TPOT p50/p99, failed requests, role
switches (``pdserve_role_switches_total``) and the planner's goodput over the best static one.
``--steady KIND`` adds a trace of that phase kind only (same length) over ``--steady-configs``.
The planner's evaluations (router log, INFO) of each planner run go to ``--planner-log``.

    python -m benchmarks.role_goodput --phase-s 60 --cycles 2 --prefill-rate 0.5 --decode-rate 0.5 \
        --slo-ttft-ms 3000 --slo-tpot-ms 150 --steady decode-heavy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from bench.harness.subprocess_server import LaunchedServer, metric_sum, scrape_metrics, wait_idle
from bench.serve.client import ClientConfig, served_model
from bench.serve.runner import open_loop
from bench.serve.servers import launch_argv
from bench.serve.stats import SLO
from bench.serve.workload import RequestSpec, load_counter
from benchmarks import bursty_trace as bursty

SPLITS = {"1p2d": (1, 2), "2p1d": (2, 1)}
HEARTBEAT_S = 0.5


def server_flags(config: str, args: argparse.Namespace) -> list[str]:
    """``pdserve launch`` flags of ``config`` (``1p2d``, ``2p1d`` or ``planner``): the split, the
    migration path a decode -> prefill switch needs (every configuration has it, so only the
    planner differs), and for ``planner`` the SLO planner with the benchmark's SLOs and knobs."""
    p, d = SPLITS[args.planner_start if config == "planner" else config]
    flags = ["--prefill", str(p), "--decode", str(d), "--migrate-after", "100000", "--host-kv-pool-gb", "0.25"]
    flags += ["--kv-pool-tokens", str(args.kv_pool_tokens), "--health-interval-s", str(HEARTBEAT_S)]
    if config == "planner":
        flags += ["--planner", "slo", "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
        flags += ["--planner-interval-s", str(args.planner_interval_s), "--planner-hysteresis"]
        flags += [str(args.planner_hysteresis), "--planner-dwell-s", str(args.planner_dwell_s)]
        flags += ["--planner-headroom", str(args.planner_headroom), "--log-level", "INFO"]
    return flags + args.server_args.split()


def run_config(
    config: str, trace_name: str, trace: list[RequestSpec], trace_s: float, args, raw: list[dict]
) -> bursty.Outcome:
    """Launch ``config``, warm it up, replay ``trace`` open loop; its ``Outcome`` (each request's
    kind, arrival, TTFT, TPOT and error appended to ``raw``)."""
    warm = [RequestSpec(-1, "hello " * 40, 40, 4, "warmup"), RequestSpec(-2, "world " * 300, 300, 4, "warmup")]
    with LaunchedServer(launch_argv("pd", server_flags(config, args)), startup_timeout_s=300) as srv:
        cfg = ClientConfig(srv.url, served_model(srv.url))
        before = wait_idle(srv.url, HEARTBEAT_S)
        measured = asyncio.run(open_loop(cfg, trace, warmup=warm, progress=False, label=config))
        switches = metric_sum(scrape_metrics(srv.url), "pdserve_role_switches_total")
        switches -= metric_sum(before, "pdserve_role_switches_total")
        if config == "planner" and args.planner_log:
            lines = [ln for ln in srv.log().splitlines() if "planner:" in ln]
            with open(args.planner_log, "a") as f:
                f.write(f"# {trace_name}\n" + "\n".join(lines) + "\n")
    for spec, r in zip(trace, sorted(measured.results, key=lambda r: r.index)):
        raw.append(
            {"trace": trace_name, "config": config, "kind": spec.kind, "arrival_s": round(spec.arrival_s, 3)}
            | {"ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "error": r.error}
        )
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    return bursty.outcome(config, trace_name, measured.results, trace_s, slo, int(switches), config == "planner")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--cycles", type=int, default=2, help="prefill-heavy + decode-heavy phase pairs")
    ap.add_argument("--prefill-rate", type=float, default=0.5, help="req/s in prefill-heavy phases")
    ap.add_argument("--decode-rate", type=float, default=0.5, help="req/s in decode-heavy phases")
    ap.add_argument("--slo-ttft-ms", type=float, required=True)
    ap.add_argument("--slo-tpot-ms", type=float, required=True)
    ap.add_argument("--configs", default="1p2d,2p1d,planner", help="comma-separated: 1p2d, 2p1d, planner")
    ap.add_argument("--planner-start", choices=sorted(SPLITS), default="1p2d", help="the planner's initial split")
    ap.add_argument("--planner-interval-s", type=float, default=5.0)
    ap.add_argument("--planner-hysteresis", type=int, default=3)
    ap.add_argument("--planner-dwell-s", type=float, default=60.0)
    ap.add_argument("--planner-headroom", type=float, default=0.8)
    ap.add_argument("--steady", choices=[bursty.PREFILL, bursty.DECODE], help="add a trace of one phase kind")
    ap.add_argument("--steady-configs", default="1p2d,2p1d,planner", help="configurations run on the steady trace")
    ap.add_argument("--kv-pool-tokens", type=int, default=16384)
    ap.add_argument("--tokenizer", default="default", help="counts prompt tokens ('words': one word = one token)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="extra pdserve launch flags for every configuration")
    ap.add_argument("--planner-log", help="append the planner's evaluations (router log lines) to this file")
    ap.add_argument("--json", help="write the outcomes and the table here")
    args = ap.parse_args(argv)
    for name in ("configs", "steady_configs"):
        bad = [c for c in getattr(args, name).split(",") if c not in (*SPLITS, "planner")]
        if bad:
            ap.error(f"--{name.replace('_', '-')}: unknown configuration(s) {bad}; use 1p2d, 2p1d, planner")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = bursty.default_kinds(args.prefill_rate, args.decode_rate)
    counter = load_counter(args.tokenizer)
    runs = [("bursty", bursty.phase_plan(args.cycles), args.configs.split(","))]
    if args.steady:
        runs.append(
            (f"steady {args.steady}", bursty.phase_plan(args.cycles, args.steady), args.steady_configs.split(","))
        )
    rows: list[bursty.Outcome] = []
    raw: list[dict] = []
    for name, plan, configs in runs:
        trace = bursty.make_trace(plan, kinds, args.phase_s, counter, args.seed)
        trace_s = len(plan) * args.phase_s
        print(f"{name}: {len(trace)} requests over {trace_s:g} s ({' '.join(plan)})", file=sys.stderr)
        for config in configs:
            rows.append(run_config(config, name, trace, trace_s, args, raw))
            print(bursty.format_table(bursty.goodput_table(rows[-1:])), file=sys.stderr)
    table = bursty.goodput_table(rows)
    print(bursty.format_table(table))
    if args.json:
        out = {
            "args": vars(args),
            "outcomes": [r.to_dict() for r in rows],
            "columns": bursty.COLUMNS,
            "rows": table,
            "requests": raw,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
