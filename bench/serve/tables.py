"""The figures of a ``bench serve`` run as results tables (``bench/results.py``): every run, the
ratios between targets and each target's goodput; latencies in ms, numbers rounded for reading."""

from __future__ import annotations

from bench.results import Table
from bench.serve.goodput import GoodputResult
from bench.serve.report import RATIO_METRICS, RunRecord
from bench.serve.stats import Summary

RUN_COLUMNS = [
    "target",
    "load",
    "kind",
    "ok",
    "failed",
    "output tok/s",
    "req/s",
    "TTFT mean ms",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TPOT mean ms",
    "TPOT p99 ms",
    "ITL p99 ms",
    "E2E p50 ms",
]


def _ms(s: Summary | None, field: str) -> float | None:
    return None if s is None else round(getattr(s, field), 1)


def runs_table(records: list[RunRecord]) -> Table:
    """One row per load level and target."""
    rows = []
    for r in records:
        s = r.stats
        rows.append(
            [
                r.target,
                r.load,
                r.kind,
                s.completed,
                s.failed,
                round(s.output_throughput, 1),
                round(s.request_throughput, 3),
                _ms(s.ttft, "mean_ms"),
                _ms(s.ttft, "p50_ms"),
                _ms(s.ttft, "p99_ms"),
                _ms(s.tpot, "mean_ms"),
                _ms(s.tpot, "p99_ms"),
                _ms(s.itl, "p99_ms"),
                _ms(s.e2e, "p50_ms"),
            ]
        )
    return Table(title="runs", columns=RUN_COLUMNS, rows=rows)


def ratios_table(pair: str, rows: list[dict]) -> Table:
    """``other / base`` of ``RATIO_METRICS`` per load level (``pair`` is ``"other/base"``)."""
    cells = [[r["load"], r["kind"], *(None if r[m] is None else round(r[m], 3) for m in RATIO_METRICS)] for r in rows]
    return Table(title=f"ratios {pair}", columns=["load", "kind", *RATIO_METRICS], rows=cells)


def goodput_table(results: list[GoodputResult]) -> Table:
    """Each target's goodput (req/s) and the lowest rate that failed (None: every rate passed)."""
    rows = [[g.target, round(g.goodput, 3), g.first_failing] for g in results]
    return Table(title="goodput", columns=["target", "goodput req/s", "first failing req/s"], rows=rows)


def serve_tables(records: list[RunRecord], ratios: dict[str, list[dict]], goodputs: list[GoodputResult]) -> list[Table]:
    """Every table a run has: the runs, then the ratios of each target pair, then the goodput."""
    tables = [runs_table(records)] + [ratios_table(pair, rows) for pair, rows in ratios.items()]
    return tables + ([goodput_table(goodputs)] if goodputs else [])
