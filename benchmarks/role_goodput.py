"""Goodput of static prefill/decode splits against the SLO planner on a bursty trace, in one run.

Three PD workers. The trace alternates prefill-heavy phases (1,500-2,000-token prompts, 16-token
answers) and decode-heavy phases (100-token prompts, 256-token answers), ``--phase-s`` seconds
each, ``--cycles`` pairs, open-loop Poisson arrivals, seeded (``benchmarks.bursty_trace``). The
rates are relative to the host: on the first launched cluster a short probe measures what ONE
prefill worker and ONE decode worker sustain on these requests (``benchmarks.load_calibration``)
and each phase runs at ``--prefill-load`` / ``--decode-load`` x that (1.4: one worker of the kind
is overloaded, two are not); ``--prefill-rate`` / ``--decode-rate`` (req/s) override a phase's.
For each configuration of ``--configs`` (``1p2d``,
``2p1d``: static splits; ``planner``: ``--planner-start`` with ``--planner slo`` and the same SLOs)
it launches a fresh server, warms it up, replays the trace and counts the requests that met both
SLOs, then prints one table: goodput (req/s and share), TTFT/TPOT p50/p99, failed requests, role
switches (``pdserve_role_switches_total``) and the planner's goodput over the best static one; then
the same per phase kind, and per trace what each phase kind at its better static split would meet
(the most a planner switching between the splits can gain there).
``--steady KIND`` adds a trace of that phase kind only (same length) over ``--steady-configs``.
The planner's evaluations (router log, INFO) of each planner run go to ``--planner-log``.
``--node-cpus X`` makes each worker a node of X cores (``pdserve launch --node-cpus``: a CPU-quota
cgroup per worker, core lending off), the cluster the planner is for; without it the three workers
share the host's cores and the planner holds (a move adds no compute there).

    python -m benchmarks.role_goodput --phase-s 60 --cycles 2 --prefill-load 1.4 --decode-load 1.4 \
        --slo-ttft-ms 3000 --slo-tpot-ms 150 --steady decode-heavy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path

from bench.harness.subprocess_server import LaunchedServer, metric_sum, scrape_metrics, wait_idle
from bench.serve.client import ClientConfig, served_model
from bench.serve.runner import open_loop
from bench.serve.servers import launch_argv
from bench.serve.stats import SLO
from bench.serve.workload import RequestSpec, load_counter
from benchmarks import bursty_trace as bursty
from benchmarks import load_calibration as cal

SPLITS = {"1p2d": (1, 2), "2p1d": (2, 1)}
HEARTBEAT_S = 0.5
WARMUP = [RequestSpec(-1, "hello " * 40, 40, 4, "warmup"), RequestSpec(-2, "world " * 300, 300, 4, "warmup")]


def server_flags(config: str, args: argparse.Namespace) -> list[str]:
    """``pdserve launch`` flags of ``config`` (``1p2d``, ``2p1d`` or ``planner``): the split, the
    migration path a decode -> prefill switch needs (every configuration has it, so only the
    planner differs), each worker a node of ``--node-cpus`` cores when given, and for ``planner``
    the SLO planner with the benchmark's SLOs and knobs."""
    p, d = split_of(config, args)
    flags = ["--prefill", str(p), "--decode", str(d), "--migrate-after", "100000", "--host-kv-pool-gb", "0.25"]
    flags += ["--kv-pool-tokens", str(args.kv_pool_tokens), "--health-interval-s", str(HEARTBEAT_S)]
    if args.node_cpus:
        flags += ["--node-cpus", str(args.node_cpus)]
    if config == "planner":
        flags += ["--planner", "slo", "--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
        flags += ["--planner-interval-s", str(args.planner_interval_s), "--planner-hysteresis"]
        flags += [str(args.planner_hysteresis), "--planner-dwell-s", str(args.planner_dwell_s)]
        flags += ["--planner-headroom", str(args.planner_headroom), "--log-level", "INFO"]
    return flags + args.server_args.split()


def split_of(config: str, args: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) workers ``config`` launches with."""
    return SPLITS[args.planner_start if config == "planner" else config]


TraceSource = Callable[[ClientConfig, tuple[int, int]], list[RequestSpec]]


def run_config(config: str, trace_name: str, trace_of: TraceSource, trace_s: float, args, raw: list[dict]):
    """Launch ``config``, warm it up, get the trace from ``trace_of`` (which may probe the running
    cluster first), replay it open loop; (its ``Outcome``, the trace) (each request's kind,
    arrival, TTFT, TPOT and error appended to ``raw``)."""
    with LaunchedServer(launch_argv("pd", server_flags(config, args)), startup_timeout_s=300) as srv:
        cfg = ClientConfig(srv.url, served_model(srv.url))
        wait_idle(srv.url, HEARTBEAT_S)
        trace = trace_of(cfg, split_of(config, args))
        before = wait_idle(srv.url, HEARTBEAT_S, timeout_s=120)
        measured = asyncio.run(open_loop(cfg, trace, warmup=WARMUP, progress=False, label=config))
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
    return bursty.outcome(config, trace_name, measured.results, trace_s, slo, int(switches), config == "planner"), trace


def config_names(text: str) -> list[str]:
    """The configurations a comma-separated flag names (empty: none)."""
    return [c for c in text.split(",") if c]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--cycles", type=int, default=2, help="prefill-heavy + decode-heavy phase pairs")
    ap.add_argument(
        "--prefill-load", type=float, default=1.4, help="prefill-heavy rate in one prefill worker's capacity"
    )
    ap.add_argument("--decode-load", type=float, default=1.4, help="decode-heavy rate in one decode worker's capacity")
    ap.add_argument("--prefill-rate", type=float, help="req/s in prefill-heavy phases (no prefill probe)")
    ap.add_argument("--decode-rate", type=float, help="req/s in decode-heavy phases (no decode probe)")
    ap.add_argument("--probe-rows", type=int, default=8, help="rows per decode worker of the decode probe's batch")
    ap.add_argument("--slo-ttft-ms", type=float, required=True)
    ap.add_argument("--slo-tpot-ms", type=float, required=True)
    ap.add_argument(
        "--configs",
        default="1p2d,2p1d,planner",
        help="comma-separated: 1p2d, 2p1d, planner (empty: the steady trace only)",
    )
    ap.add_argument("--planner-start", choices=sorted(SPLITS), default="1p2d", help="the planner's initial split")
    ap.add_argument("--planner-interval-s", type=float, default=5.0)
    ap.add_argument("--planner-hysteresis", type=int, default=3)
    ap.add_argument("--planner-dwell-s", type=float, default=60.0)
    ap.add_argument("--planner-headroom", type=float, default=0.8)
    ap.add_argument("--steady", choices=[bursty.PREFILL, bursty.DECODE], help="add a trace of one phase kind")
    ap.add_argument("--steady-configs", default="1p2d,2p1d,planner", help="configurations run on the steady trace")
    ap.add_argument("--kv-pool-tokens", type=int, default=16384)
    ap.add_argument(
        "--node-cpus",
        type=float,
        help="each worker a node of this many cores (its own CPU-quota cgroup, no core lending; needs root)",
    )
    ap.add_argument("--tokenizer", default="default", help="counts prompt tokens ('words': one word = one token)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="extra pdserve launch flags for every configuration")
    ap.add_argument("--planner-log", help="append the planner's evaluations (router log lines) to this file")
    ap.add_argument("--json", help="write the outcomes and the table here")
    args = ap.parse_args(argv)
    for name in ("configs", "steady_configs"):
        bad = [c for c in config_names(getattr(args, name)) if c not in (*SPLITS, "planner")]
        if bad:
            ap.error(f"--{name.replace('_', '-')}: unknown configuration(s) {bad}; use 1p2d, 2p1d, planner")
    return args


class Calibrated:
    """The phase kinds, calibrated once on the first cluster that asks (``kinds``); the explicit
    ``--prefill-rate`` / ``--decode-rate`` skip their probe."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.counter = load_counter(args.tokenizer)
        self.calibration: cal.Calibration | None = None
        self.kinds_: dict[str, bursty.PhaseKind] | None = None

    def kinds(self, cfg: ClientConfig, split: tuple[int, int], config: str) -> dict[str, bursty.PhaseKind]:
        """The calibrated kinds (probing ``cfg``, a cluster of ``split`` named ``config``, the first time)."""
        if self.kinds_ is None:
            a = self.args
            base = bursty.default_kinds(a.prefill_rate or 1.0, a.decode_rate or 1.0)
            pre, dec = cal.probe(
                cfg,
                base,
                split,
                a.prefill_rate is None,
                a.decode_rate is None,
                slo_tpot_s=a.slo_tpot_ms / 1000,
                kv_pool_tokens=a.kv_pool_tokens,
                counter=self.counter,
                seed=a.seed + 1000,
                rows=a.probe_rows,
                warmup=WARMUP,
            )
            self.calibration = cal.Calibration(config, pre, dec)
            self.kinds_ = cal.calibrated_kinds(base, self.calibration, a.prefill_load, a.decode_load)
            print(self.describe(), file=sys.stderr)
        return self.kinds_

    def describe(self) -> str:
        a = self.args
        return cal.describe(self.calibration, self.kinds_, a.prefill_load, a.decode_load)


def trace_runs(args: argparse.Namespace) -> list[tuple[str, list[str], list[str]]]:
    """(trace name, phase plan, configurations) of each trace to run: the bursty one over
    ``--configs`` (none: only launched for the steady one), then with ``--steady`` the steady one
    over ``--steady-configs``."""
    runs = [("bursty", bursty.phase_plan(args.cycles), config_names(args.configs))]
    if args.steady:
        steady = config_names(args.steady_configs)
        runs.append((f"steady {args.steady}", bursty.phase_plan(args.cycles, args.steady), steady))
    return [r for r in runs if r[2]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = Calibrated(args)
    runs = trace_runs(args)
    rows: list[bursty.Outcome] = []
    raw: list[dict] = []
    for name, plan, configs in runs:
        trace_s = len(plan) * args.phase_s
        for config in configs:

            def trace_of(cfg: ClientConfig, split: tuple[int, int], plan=plan, config=config) -> list[RequestSpec]:
                kinds = source.kinds(cfg, split, config)
                return bursty.make_trace(plan, kinds, args.phase_s, source.counter, args.seed)

            row, trace = run_config(config, name, trace_of, trace_s, args, raw)
            rows.append(row)
            print(f"{name}: {len(trace)} requests over {trace_s:g} s ({' '.join(plan)})", file=sys.stderr)
            print(bursty.format_table(bursty.goodput_table(rows[-1:])), file=sys.stderr)
    table = bursty.goodput_table(rows)
    print(source.describe())
    print(bursty.format_table(table))
    phases = bursty.phase_table(raw, SLO(args.slo_ttft_ms, args.slo_tpot_ms))
    print(bursty.format_rows(bursty.PHASE_COLUMNS, phases))
    ceiling = bursty.phase_ceiling(phases, rows)
    for trace, (met, ratio) in ceiling.items():
        print(f"{trace}: each phase kind at its better static split would meet {met} ({ratio}x the best static split)")
    if args.json:
        out = {
            "args": vars(args),
            "calibration": source.calibration.to_dict(),
            "rates": {k: v.rate for k, v in source.kinds_.items()},
            "outcomes": [r.to_dict() for r in rows],
            "columns": bursty.COLUMNS,
            "rows": table,
            "phase_rows": phases,
            "phase_ceiling": ceiling,
            "requests": raw,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
