"""The tables ``bench.two_routers`` prints, and its JSON payload, from the ``PhaseResult``s of a run.

Per phase: output tok/s, req/s, TTFT p50/p99, TPOT p50 (ms), failed requests, the requests each
router served, and what each worker of the measured role finished (requests, generated tokens) with
the spread (max - min) / mean, and the CPU ms per output token of the routers and of the workers
(CPU time does not depend on what else the host runs: on a busy host it tells whether B costs more
work than A, where tok/s cannot). Then the medians of A and of B over their rounds and B/A, and the
split of every B phase pooled: the figure the goal "load spread within 20 %" is about.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

from bench.multirouter.phases import PhaseResult, WorkerSplit, median_of

METRICS = {  # column -> value of a phase (None when the phase has no such sample)
    "tok/s": lambda p: p.stats.output_throughput,
    "req/s": lambda p: p.stats.request_throughput,
    "TTFT p50 ms": lambda p: p.stats.ttft.p50_ms if p.stats.ttft else None,
    "TTFT p99 ms": lambda p: p.stats.ttft.p99_ms if p.stats.ttft else None,
    "TPOT p50 ms": lambda p: p.stats.tpot.p50_ms if p.stats.tpot else None,
}
CPU = {  # column -> CPU ms per output token of a phase's processes (independent of the host's other load)
    "routers CPU ms/tok": lambda p: p.cpu_ms_per_token("router-"),
    "workers CPU ms/tok": lambda p: p.cpu_ms_per_token(("prefill", "decode", "colocated")),
}
SPREAD_GOAL = 0.20
THROUGHPUT_GOAL = 0.95  # B/A tok/s at or above this is "the same throughput" within a quiet host's noise


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _counts(d: dict[str, float]) -> str:
    return " / ".join(f"{v:.0f}" for _, v in sorted(d.items()))


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def phases_table(phases: list[PhaseResult], router_names: dict[str, str]) -> str:
    """One row per phase, in run order."""
    head = [
        "phase",
        "routers",
        "requests",
        "failed",
        *METRICS,
        *CPU,
        "served per router",
        "finished per worker",
        "spread",
        "tokens per worker",
        "spread",
    ]
    rows = []
    for p in phases:
        served = " / ".join(f"{router_names[u]} {p.split.router_ok.get(u, 0):.0f}" for u in router_names)
        rows.append(
            [
                p.name,
                "+".join(router_names[u] for u in p.routers),
                str(p.stats.requests),
                str(len(p.failures)),
                *(_num(f(p)) for f in METRICS.values()),
                *(_num(f(p), 2) for f in CPU.values()),
                served,
                _counts(p.split.finished),
                _pct(p.split.finished_spread),
                _counts(p.split.tokens),
                _pct(p.split.tokens_spread),
            ]
        )
    return _markdown(head, rows)


@dataclass(frozen=True)
class Summary:
    """Medians of A and B over their rounds, B/A per metric, and B's pooled split."""

    median_a: dict[str, float | None]
    median_b: dict[str, float | None]
    ratio: dict[str, float | None]
    pooled_b: WorkerSplit
    pooled_a: WorkerSplit

    @classmethod
    def of(cls, phases: list[PhaseResult]) -> Summary:
        a = [p for p in phases if p.kind == "A"]
        b = [p for p in phases if p.kind == "B"]
        ma = {k: median_of(a, f) for k, f in {**METRICS, **CPU}.items()}
        mb = {k: median_of(b, f) for k, f in {**METRICS, **CPU}.items()}
        ratio = {k: (mb[k] / ma[k] if ma[k] and mb[k] is not None else None) for k in ma}
        pool = lambda ps: reduce(WorkerSplit.plus, (p.split for p in ps), WorkerSplit())  # noqa: E731
        return cls(ma, mb, ratio, pool(b), pool(a))

    def table(self) -> str:
        rows = [
            ["A (one router), median", *(_num(v, 1 if k in METRICS else 2) for k, v in self.median_a.items())],
            ["B (two routers), median", *(_num(v, 1 if k in METRICS else 2) for k, v in self.median_b.items())],
            ["B / A", *(_num(v, 3) for v in self.ratio.values())],
        ]
        return _markdown(["", *METRICS, *CPU], rows)

    def spread_lines(self, role: str) -> list[str]:
        """The pooled split of B (and of A, for reference) against the goal."""
        out = []
        for name, split in (("B (two routers)", self.pooled_b), ("A (one router)", self.pooled_a)):
            if not split.finished:
                out.append(f"{name}: no phase ran to the end")
                continue
            workers = ", ".join(sorted(split.finished))
            out.append(
                f"{name}, every round pooled, per {role} worker ({workers}): finished "
                f"{_counts(split.finished)} (spread {_pct(split.finished_spread)}), generated tokens "
                f"{_counts(split.tokens)} (spread {_pct(split.tokens_spread)})"
            )
        return out

    def verdict(self) -> list[str]:
        """The goal's two figures with met / not met (a verdict only means something on a quiet host)."""
        r, s = self.ratio["tok/s"], self.pooled_b.finished_spread
        return [
            f"goal 'same throughput as one router': B/A tok/s = {_num(r, 3)} "
            f"({'met' if r is not None and r >= THROUGHPUT_GOAL else 'NOT met'} at >= {THROUGHPUT_GOAL})",
            f"goal 'load spread within 20%': B finished-requests spread = {_pct(s)} "
            f"({'met' if s is not None and s <= SPREAD_GOAL else 'NOT met'})",
        ]

    def to_dict(self) -> dict:
        return {
            "median_a": self.median_a,
            "median_b": self.median_b,
            "b_over_a": self.ratio,
            "pooled_b": self.pooled_b.to_dict(),
            "pooled_a": self.pooled_a.to_dict(),
        }
