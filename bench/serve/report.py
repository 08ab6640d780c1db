"""Reports of a ``bench serve`` run: run records, the text tables, ratios between modes, JSON, PNG."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.serve.client import RequestResult
from bench.serve.cpu import cpu_fields, cpu_rows, router_goal_line
from bench.serve.stats import RunStats, Summary


@dataclass
class RunRecord:
    """One load level against one target. ``target``: the mode launched (``colocated``/``pd``) or
    ``server`` for ``--base-url``; ``kind``: which requests ``stats`` covers (``all``, ``short``, ``long``);
    ``cpu_s``: CPU seconds per server process over ``cpu_wall_s`` (None when the bench did not launch
    the server, or for the ``short``/``long`` parts of an interference run)."""

    target: str
    load: str
    concurrency: int | None
    request_rate: float | None
    stats: RunStats
    results: list[RequestResult]
    kind: str = "all"
    cpu_s: dict[str, float] | None = None
    cpu_wall_s: float = 0.0

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("results", "stats", "cpu_s", "cpu_wall_s")}
        d.update(cpu_fields(self.cpu_s, self.cpu_wall_s, self.stats.output_tokens))
        d["stats"] = self.stats.to_dict()
        d["requests"] = [
            {**{k: v for k, v in asdict(r).items() if k != "output_text"}, "tpot_s": r.tpot_s} for r in self.results
        ]
        return d


def _ms(s: Summary | None, field: str) -> str:
    return "-" if s is None else f"{getattr(s, field):.0f}"


_HEAD = (
    "target",
    "load",
    "kind",
    "ok",
    "fail",
    "tok/s",
    "req/s",
    "TTFT mean",
    "TTFT p50",
    "TTFT p99",
    "TPOT mean",
    "TPOT p99",
    "ITL p99",
    "E2E p50",
    "goodput",
)


def _row(r: RunRecord) -> tuple:
    s = r.stats
    good = "-" if s.goodput is None else f"{s.goodput:.2f}/s ({s.goodput_requests})"
    return (
        r.target,
        r.load,
        r.kind,
        s.completed,
        s.failed,
        f"{s.output_throughput:.1f}",
        f"{s.request_throughput:.2f}",
        _ms(s.ttft, "mean_ms"),
        _ms(s.ttft, "p50_ms"),
        _ms(s.ttft, "p99_ms"),
        _ms(s.tpot, "mean_ms"),
        _ms(s.tpot, "p99_ms"),
        _ms(s.itl, "p99_ms"),
        _ms(s.e2e, "p50_ms"),
        good,
    )


def markdown_table(head: tuple, rows: list[tuple]) -> str:
    """A GitHub-markdown table."""
    lines = ["| " + " | ".join(map(str, head)) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def runs_table(records: list[RunRecord]) -> str:
    """Every run as one row; latencies in ms."""
    return markdown_table(_HEAD, [_row(r) for r in records])


def cpu_table(records: list[RunRecord]) -> str:
    """Per load level and server process: CPU s, CPU ms per output token, % of one core; then the
    router's % of one core per 100 output tok/s against the goal. Empty if no record has CPU times."""
    measured = [r for r in records if r.cpu_s is not None]
    if not measured:
        return ""
    rows, goals = [], []
    for r in measured:
        f = cpu_fields(r.cpu_s, r.cpu_wall_s, r.stats.output_tokens)
        rows += cpu_rows(r.load, f)
        goals.append(router_goal_line(r.load, f["router_core_pct_per_100_tok_s"]))
    head = ("load", "process", "CPU s", "CPU ms/out tok", "% of one core")
    return markdown_table(head, rows) + "\n" + "\n".join(goals)


def _value(s: RunStats, metric: str) -> float | None:
    if metric == "tok/s":
        return s.output_throughput
    summary = getattr(s, metric.split()[0].lower())
    return (
        None
        if summary is None
        else getattr(summary, {"mean": "mean_ms", "p50": "p50_ms", "p99": "p99_ms"}[metric.split()[1]])
    )


RATIO_METRICS = ("TTFT mean", "TTFT p99", "TPOT p99", "tok/s")


def ratios(records: list[RunRecord], base: str, other: str) -> list[dict]:
    """``other / base`` of ``RATIO_METRICS`` for every (load, kind) both targets ran."""
    by_key = {(r.target, r.load, r.kind): r for r in records}
    out = []
    for r in records:
        if r.target != base or (other, r.load, r.kind) not in by_key:
            continue
        o = by_key[(other, r.load, r.kind)]
        row = {"load": r.load, "kind": r.kind}
        for m in RATIO_METRICS:
            a, b = _value(r.stats, m), _value(o.stats, m)
            row[m] = None if a is None or b is None or a == 0 else b / a
        out.append(row)
    return out


def ratios_table(rows: list[dict], base: str, other: str) -> str:
    head = ("load", "kind", *(f"{m} {other}/{base}" for m in RATIO_METRICS))
    fmt = [(r["load"], r["kind"], *("-" if r[m] is None else f"{r[m]:.2f}x" for m in RATIO_METRICS)) for r in rows]
    return markdown_table(head, fmt)


def cache_table(effects: dict[str, dict]) -> str:
    """Per target: prefix hit rate of each worker role and KV bytes shipped per request."""
    roles = sorted({role for e in effects.values() for role in e["hit_rate"]})
    rows = [
        (
            target,
            *(f"{e['hit_rate'][r]:.1%}" if r in e["hit_rate"] else "-" for r in roles),
            "-" if e["kv_bytes_per_request"] is None else f"{e['kv_bytes_per_request'] / 1e6:.2f}",
        )
        for target, e in effects.items()
    ]
    return markdown_table(("target", *(f"{r} hit rate" for r in roles), "KV MB shipped/req"), rows)


def write_json(path: str | Path, payload: dict) -> None:
    """Write ``payload`` (records already turned into dicts) as indented JSON."""
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def plot(records: list[RunRecord], path: str | Path) -> None:
    """PNG of TTFT, TPOT (P50 solid, P99 dashed) and output tok/s against load, one colour per target.

    Needs matplotlib (``pip install 'pdserve[bench]'``); ``RuntimeError`` saying so otherwise."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pdserve[bench]'") from None
    main = [r for r in records if r.kind == "all"]
    if not main:
        return _plot_interference(plt, records, path)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, target in enumerate(dict.fromkeys(r.target for r in main)):
        rs = [r for r in main if r.target == target]
        xs = [r.concurrency if r.concurrency is not None else r.request_rate for r in rs]
        color = f"C{i}"
        for ax, metric in zip(axes[:2], ("ttft", "tpot")):
            for q, style in (("p50_ms", "-"), ("p99_ms", "--")):
                ys = [getattr(getattr(r.stats, metric), q) if getattr(r.stats, metric) else float("nan") for r in rs]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{target} {q[:3].upper()}")
        axes[2].plot(xs, [r.stats.output_throughput for r in rs], marker="o", color=color, label=target)
    closed = bool(main) and main[0].concurrency is not None
    xlabel = "concurrency" if closed else "request rate (req/s)"
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "output tokens/s")):
        levels = sorted({r.concurrency for r in main}) if closed else []
        if len(levels) > 1:
            ax.set_xscale("log", base=2)  # 1, 8, 32: evenly spaced, labelled as numbers
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.minorticks_off()
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_interference(plt, records: list[RunRecord], path: str | Path) -> None:
    """Bars of the short and long requests' P99 TTFT and P99 TPOT, one group per target."""
    kinds = [k for k in ("short", "long") if any(r.kind == k for r in records)]
    targets = list(dict.fromkeys(r.target for r in records))
    by_key = {(r.target, r.kind): r for r in records}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.8 / max(len(targets), 1)
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for i, target in enumerate(targets):
            ys = [
                getattr(getattr(by_key[(target, k)].stats, metric), "p99_ms", float("nan"))
                if (target, k) in by_key and getattr(by_key[(target, k)].stats, metric)
                else float("nan")
                for k in kinds
            ]
            ax.bar([j + i * width for j in range(len(kinds))], ys, width, label=target, color=f"C{i}")
        ax.set_xticks([j + width * (len(targets) - 1) / 2 for j in range(len(kinds))], [f"{k} requests" for k in kinds])
        ax.set_title(f"{metric.upper()} P99 (ms) under long-prompt interference")
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
