"""``pdserve bench serve``: load an OpenAI-compatible server (or launch colocated and PD servers
with ``--compare`` and load each the same way) and report TTFT / TPOT / ITL / E2E, throughput and
goodput per load level, the ratios between modes, JSON and a PNG; with ``--goodput``, search each
target's highest request rate within both SLOs instead (``bench/serve/goodput.py``). See ``bench/serve/``.

Prompts differ between load levels (a radix cache must not serve level 2 from level 1) but are the
same for every target, so targets see exactly the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

from bench.results import Results, command_line, new_results, write_if_asked
from bench.serve import goodput_report, report
from bench.serve.client import ClientConfig, served_model, split_urls
from bench.serve.cpu import CpuMeter
from bench.serve.goodput import GoodputPoint, GoodputResult, measure_point, search_goodput
from bench.serve.interference import InterferenceSpec, interference_records, interference_requests
from bench.serve.multiturn import multi_turn_records, run_multi_turn
from bench.serve.options import ServeOptions, add_serve_flags
from bench.serve.report import RunRecord
from bench.serve.runner import closed_loop, open_loop
from bench.serve.servers import config_flags, launched
from bench.serve.stats import compute_stats
from bench.serve.tables import serve_tables
from bench.serve.workload import LengthCounter, PromptShape, RequestSpec, load_counter, make_requests, poisson_arrivals

__all__ = ["add_serve_flags", "run_serve_bench"]


class ServeBench:
    """One ``bench serve`` invocation: the workloads, then each target, then the reports."""

    def __init__(self, args: argparse.Namespace, opts: ServeOptions, counter: LengthCounter) -> None:
        self.a, self.o, self.counter = args, opts, counter
        self.cache_effects: dict[str, dict] = {}  # --multi-turn: target -> CacheEffect.to_dict()
        self.goodputs: list[GoodputResult] = []  # --goodput: one per target, in run order
        lo, hi = opts.input_range
        out_lo, out_hi = opts.output_range
        self.shape = PromptShape(
            args.num_prompts,
            lo,
            hi,
            out_lo,
            args.shared_prefix_len,
            output_max=out_hi if out_hi != out_lo else None,
            instruction=opts.instruction,
        )
        self.warm_shape = PromptShape(
            args.warmup, lo, hi, min(out_lo, 8), args.shared_prefix_len, instruction=opts.instruction
        )

    def _client(self, url: str) -> ClientConfig:
        """Where ``url`` (one server, or several comma-separated routers, round-robin) is loaded."""
        urls = split_urls(url, "--base-url")
        model = self.a.served_model_name or served_model(urls[0], self.a.api_key)
        return ClientConfig(
            urls[0],
            model,
            self.a.endpoint,
            self.a.api_key,
            self.a.ignore_eos,
            self.a.request_timeout_s,
            urls if len(urls) > 1 else (),
        )

    def _warmup(self, level: int):
        return make_requests(self.warm_shape, self.counter, self.a.workload_seed + 7919 + level)

    def _levels(self) -> list[tuple[str, int | None, float | None]]:
        if self.o.concurrency is not None:
            return [(f"c={c}", c, None) for c in self.o.concurrency]
        return [(f"rate={r:g}", None, r) for r in self.o.request_rates]

    def run_target(self, target: str, url: str, launcher_pid: int | None = None) -> list[RunRecord]:
        """Every load level (or the interference study) against the server at ``url``; with the pid of
        its launcher, each record also gets the CPU seconds of the router and every worker."""
        cfg = self._client(url)
        show = not self.a.no_progress
        if self.o.goodput is not None:
            return self._goodput_target(target, cfg, launcher_pid)
        if self.o.multi_turn is not None:
            meter = _meter(launcher_pid)
            measured, effect = run_multi_turn(cfg, self.o.multi_turn, self.counter, self.a.workload_seed, show, meter)
            self.cache_effects[target] = effect.to_dict()
            records = multi_turn_records(target, measured, self.o.slo, self.o.multi_turn.turns)
            return [_with_cpu(records[0], meter), *records[1:]]  # CPU belongs to the whole run
        if self.a.interference:
            meter = _meter(launcher_pid)
            measured = asyncio.run(
                open_loop(cfg, self.interference_specs(), self._warmup(0), show, "interference", meter)
            )
            records = interference_records(target, measured, self.o.slo, f"short {self.o.request_rates[0]:g}/s")
            return [*records[:-1], _with_cpu(records[-1], meter)]  # CPU belongs to the mixed run as a whole
        records = []
        for level, (load, conc, rate) in enumerate(self._levels()):
            specs = make_requests(self._shape(conc), self.counter, self.a.workload_seed + 1000 * level)
            meter = _meter(launcher_pid)
            if conc is not None:
                m = asyncio.run(closed_loop(cfg, specs, conc, self._warmup(level), show, meter))
            else:
                specs = poisson_arrivals(specs, rate, self.a.workload_seed + 1000 * level + 1)
                m = asyncio.run(open_loop(cfg, specs, self._warmup(level), show, load, meter))
            records.append(
                _with_cpu(
                    RunRecord(target, load, conc, rate, compute_stats(m.results, m.duration_s, self.o.slo), m.results),
                    meter,
                )
            )
            print(report.runs_table(records[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        return records

    def probe_requests(self, rate: float) -> list[RequestSpec]:
        """The requests of a ``--goodput`` probe at ``rate``: ``--num-requests`` prompts with Poisson
        arrivals. They depend only on the rate and ``--workload-seed``: every target that probes a rate
        gets the same requests there, and two probes of one target (two rates) share no prompt."""
        seed = self.a.workload_seed + round(rate * 10_000) * 2
        return poisson_arrivals(make_requests(self.shape, self.counter, seed), rate, seed + 1)

    def _goodput_target(self, target: str, cfg: ClientConfig, launcher_pid: int | None) -> list[RunRecord]:
        """Search ``target``'s goodput (``probe_requests`` at each rate); every probe is also a record
        (load ``rate=R``)."""
        spec, records = self.o.goodput, []

        def probe(rate: float) -> GoodputPoint:
            specs = self.probe_requests(rate)
            meter = _meter(launcher_pid)
            m = asyncio.run(
                open_loop(cfg, specs, self._warmup(len(records)), not self.a.no_progress, f"rate={rate:.4g}", meter)
            )
            records.append(
                _with_cpu(
                    RunRecord(
                        target,
                        f"rate={rate:.4g}",
                        None,
                        rate,
                        compute_stats(m.results, m.duration_s, spec.slo),
                        m.results,
                    ),
                    meter,
                )
            )
            point = measure_point(rate, m.results, m.duration_s, spec.slo, spec.attainment)
            print(
                goodput_report.markdown_table(
                    goodput_report.POINT_HEAD, [goodput_report.point_row(target, point)]
                ).splitlines()[-1],
                file=sys.stderr,
                flush=True,
            )
            return point

        self.goodputs.append(search_goodput(target, spec, probe))
        return records

    def _shape(self, concurrency: int | None) -> PromptShape:
        """The measured prompts of a level: ``--prompts-per-client`` x clients in a closed loop if given."""
        if concurrency is None or self.a.prompts_per_client is None:
            return self.shape
        return dataclasses.replace(self.shape, num_prompts=self.a.prompts_per_client * concurrency)

    def interference_specs(self):
        lo, hi = self.o.long_range
        spec = InterferenceSpec(
            PromptShape(
                self.a.num_prompts, *self.o.input_range, self.o.output_range[0], self.a.shared_prefix_len, kind="short"
            ),
            self.o.request_rates[0],
            PromptShape(self.a.long_prompts, lo, hi, self.a.long_output_len, kind="long"),
            self.a.long_request_rate,
        )
        return interference_requests(spec, self.counter, self.a.workload_seed)

    def run(self, engine_values: dict) -> list[RunRecord]:
        """Run every target (launching each ``--compare`` mode in turn) and return the records."""
        records: list[RunRecord] = []
        flags = config_flags(engine_values) + self.o.server_args
        for mode in self.o.modes or []:
            print(f"bench serve: launching {mode} ({' '.join(flags) or 'default flags'})", file=sys.stderr)
            with launched(mode, flags) as srv:
                records += self.run_target(mode, srv.url, srv.pid)
        for name, url in self.o.targets:
            print(f"bench serve: loading {name} at {url}", file=sys.stderr)
            records += self.run_target(name, url)
        if not self.o.target_names:
            records += self.run_target("server", self.a.base_url)
        return records

    def _print_cpu(self, records: list[RunRecord]) -> None:
        """Each launched target's CPU table; one line naming the targets whose processes are unknown."""
        for target in dict.fromkeys(r.target for r in records):
            table = report.cpu_table([r for r in records if r.target == target])
            if table:
                print(f"\nCPU of {target}'s processes over the measured requests (not warm-up):")
                print(table)
        unknown = [t for t in dict.fromkeys(r.target for r in records) if t not in (self.o.modes or [])]
        if unknown:
            print(
                f"\nCPU per process: not measured for {', '.join(unknown)} (not launched by the bench, pids "
                f"unknown; cpu_s fields are null)"
            )

    def finish(self, records: list[RunRecord]) -> dict:
        """Print the tables (runs, ratios, failures) and return the JSON payload."""
        print(report.runs_table(records))
        ratio_rows: dict = {}
        modes = self.o.target_names
        for other in modes[1:]:
            rows = report.ratios(records, modes[0], other)
            ratio_rows[f"{other}/{modes[0]}"] = rows
            print(f"\nratios {other} / {modes[0]} (same workload, one run):")
            print(report.ratios_table(rows, modes[0], other))
        self._print_cpu(records)
        if self.cache_effects:
            print("\nmulti-turn cache effect (from each server's /metrics over the run):")
            print(report.cache_table(self.cache_effects))
        if self.goodputs:
            print("\ngoodput search, every point (latencies in ms over the successful requests):")
            print(goodput_report.points_table(self.goodputs))
            print("\ngoodput per target:")
            print(goodput_report.goodput_table(self.goodputs, self.o.goodput))
        failed = sum(r.stats.failed for r in records if r.kind in ("all", "mixed"))
        if failed:
            print(
                f"\n{failed} request(s) failed; first errors: "
                f"{sorted({e for r in records for e in r.stats.errors})[:3]}"
            )
        return {
            "benchmark": "pdserve bench serve",
            "argv": sys.argv[1:],
            "tokenizer": self.counter.name,
            "settings": {k: v for k, v in vars(self.a).items() if k != "func"},
            "lengths": {"input": list(self.o.input_range), "output": list(self.o.output_range)},
            "runs": [r.to_dict() for r in records],
            "ratios": ratio_rows,
            "cache_effect": self.cache_effects,
            "goodput": self._goodput_payload(),
        }

    def _goodput_payload(self) -> dict | None:
        """The SLOs and each target's search (``--goodput``), or None."""
        g = self.o.goodput
        if g is None:
            return None
        return {
            "slo_ttft_ms": g.slo.ttft_ms,
            "slo_tpot_ms": g.slo.tpot_ms,
            "attainment": g.attainment,
            "targets": [r.to_dict() for r in self.goodputs],
        }


def _meter(launcher_pid: int | None) -> CpuMeter | None:
    return None if launcher_pid is None else CpuMeter(launcher_pid)


def _with_cpu(record: RunRecord, meter: CpuMeter | None) -> RunRecord:
    """``record`` with the meter's CPU seconds (unchanged without a meter)."""
    return record if meter is None else dataclasses.replace(record, cpu_s=meter.cpu_s, cpu_wall_s=meter.wall_s)


def serve_results(args: argparse.Namespace, bench: ServeBench, records: list[RunRecord], ratios: dict) -> Results:
    """The run as a results file (``--results-dir``): the runs, ratios and goodput tables."""
    (lo, hi), (out_lo, out_hi) = bench.o.input_range, bench.o.output_range
    targets = bench.o.target_names or ["server"]
    argv = getattr(args, "argv", None) or sys.argv[1:]
    return new_results(
        "serve-compare" if bench.o.modes else "serve",
        "pdserve bench serve",
        f"Serving: {', '.join(targets)}",
        command_line(argv),
        serve_tables(records, ratios, bench.goodputs),
        notes=[
            f"prompts of {lo}-{hi} tokens, {out_lo}-{out_hi} output tokens, tokenizer {bench.counter.name}",
            f"endpoint /v1/{args.endpoint}, ignore_eos {args.ignore_eos}",
        ],
    )


def run_serve_bench(args: argparse.Namespace, engine_values: dict) -> int:
    """Entry point of ``pdserve bench serve``; 2 on invalid flags, 1 if a server fails to start or any
    request failed (after writing the results), else 0.
    ``engine_values``: the engine flags given on the command line (passed to launched servers)."""
    try:
        opts = ServeOptions.from_args(args)
        counter = load_counter(args.tokenizer or engine_values.get("model", "default"))
        bench = ServeBench(args, opts, counter)
    except ValueError as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 2
    try:
        records = bench.run(engine_values)
    except RuntimeError as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 1
    payload = bench.finish(records)
    if args.out:
        report.write_json(args.out, payload)
        print(f"results: {args.out}")
    write_if_asked(args.results_dir, serve_results(args, bench, records, payload["ratios"]))
    if args.plot:
        try:
            if bench.goodputs:
                goodput_report.plot_goodput(bench.goodputs, opts.goodput, args.plot)
            else:
                report.plot(records, args.plot)
        except RuntimeError as e:
            print(f"pdserve bench serve: {e}", file=sys.stderr)
            return 1
        print(f"plot: {args.plot}")
    return 1 if any(r.stats.failed for r in records) else 0
