"""Reports of ``bench serve --goodput``: the line printed after each probe, the table of every
point, the goodput per target with the ratios against the first target, and a PNG of attainment
and P90 latencies against the request rate."""

from __future__ import annotations

from pathlib import Path

from bench.serve.goodput import GoodputPoint, GoodputResult, GoodputSpec
from bench.serve.report import markdown_table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


POINT_HEAD = (
    "target",
    "rate req/s",
    "attainment",
    "met/sent",
    "failed",
    "TTFT p50",
    "TTFT p90",
    "TPOT p50",
    "TPOT p90",
    "out tok/s",
    "pass",
)


def point_row(target: str, p: GoodputPoint) -> tuple:
    """One probe as a table row (latencies in ms)."""
    return (
        target,
        f"{p.rate:.4g}",
        f"{p.attainment:.1%}",
        f"{p.met}/{p.requests}",
        p.failed,
        _ms(p.ttft_p50_ms),
        _ms(p.ttft_p90_ms),
        _ms(p.tpot_p50_ms),
        _ms(p.tpot_p90_ms),
        f"{p.output_tok_s:.1f}",
        "yes" if p.passed else "no",
    )


def points_table(results: list[GoodputResult]) -> str:
    """Every probe of every target, in the order they ran."""
    return markdown_table(POINT_HEAD, [point_row(r.target, p) for r in results for p in r.points])


def _goodput_cell(r: GoodputResult) -> str:
    return f">= {r.goodput:.4g}" if r.capped else f"{r.goodput:.4g}"


def goodput_table(results: list[GoodputResult], spec: GoodputSpec) -> str:
    """Per target: the goodput (``>= R`` when no probed rate failed), the lowest failing rate, the
    number of probes, and its ratio to the first target's goodput."""
    base = results[0].goodput if results else 0.0
    head = (
        "target",
        f"goodput req/s (>= {spec.attainment:.0%} within TTFT {spec.slo.ttft_ms:g} ms and TPOT "
        f"{spec.slo.tpot_ms:g} ms)",
        "lowest failing rate",
        "points",
        f"vs {results[0].target}" if results else "ratio",
    )
    rows = [
        (
            r.target,
            _goodput_cell(r),
            "-" if r.first_failing is None else f"{r.first_failing:.4g}",
            len(r.points),
            f"{r.goodput / base:.2f}x" if base > 0 else "-",
        )
        for r in results
    ]
    return markdown_table(head, rows)


def plot_goodput(results: list[GoodputResult], spec: GoodputSpec, path: str | Path) -> None:
    """PNG: SLO attainment, TTFT P90 and TPOT P90 against the request rate, one colour per target,
    the targets (attainment share and SLOs) as dashed lines. ``RuntimeError`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'pdserve[bench]'") from None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (
        ("attainment", 100.0, spec.attainment * 100, "requests within both SLOs (%)"),
        ("ttft_p90_ms", 1.0, spec.slo.ttft_ms, "TTFT P90 (ms)"),
        ("tpot_p90_ms", 1.0, spec.slo.tpot_ms, "TPOT P90 (ms)"),
    )
    for i, r in enumerate(results):
        pts = sorted(r.points, key=lambda p: p.rate)
        for ax, (name, scale, _, _) in zip(axes, panels):
            ys = [float("nan") if getattr(p, name) is None else getattr(p, name) * scale for p in pts]
            ax.plot(
                [p.rate for p in pts], ys, marker="o", color=f"C{i}", label=f"{r.target} (goodput {_goodput_cell(r)}/s)"
            )
    for ax, (_, _, goal, title) in zip(axes, panels):
        ax.axhline(goal, linestyle="--", color="grey", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
