"""A bursty trace and its goodput accounting: phases that alternate prefill-heavy and decode-heavy
traffic, and, per server configuration, the requests that met both SLOs.

- ``PhaseKind``: a phase's prompt range, answer length and open-loop arrival rate (req/s).
- ``phase_plan(cycles, steady)``: the phase kinds in order: ``prefill, decode`` repeated ``cycles``
  times, or one kind ``2 * cycles`` times (a steady trace: the same length, one kind only).
- ``make_trace``: per phase a Poisson process of its rate cut at the phase's end (``phase_s`` each),
  prompts drawn from its shape; deterministic in the seed. Every request's ``kind`` names its phase
  kind, its ``arrival_s`` is from the trace's start.
- ``outcome``: one configuration's figures over every request sent (failed ones miss their SLOs):
  goodput = requests meeting both the TTFT and the TPOT SLO per second of the trace (the same
  denominator for every configuration, so their ratio is the ratio of requests met), the share met,
  TTFT/TPOT p50/p99 of the successful requests, failures and role switches.
- ``goodput_table``: the rows and, per trace, the ratio of the planner's goodput to the best static
  configuration's on the same trace; ``phase_table``: the same requests per phase kind (which
  phase each split misses in).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from bench.serve.client import RequestResult
from bench.serve.stats import SLO, percentile
from bench.serve.workload import LengthCounter, PromptShape, RequestSpec, make_requests

PREFILL, DECODE = "prefill-heavy", "decode-heavy"


@dataclass(frozen=True)
class PhaseKind:
    """One kind of phase: prompts uniform in ``input_range`` tokens, ``output_len`` answer tokens,
    Poisson arrivals at ``rate`` req/s."""

    name: str
    input_range: tuple[int, int]
    output_len: int
    rate: float

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"{self.name}: the arrival rate must be > 0 req/s, got {self.rate}")


def default_kinds(prefill_rate: float, decode_rate: float) -> dict[str, PhaseKind]:
    """The goal's two phase kinds: 1,500-2,000-token prompts with 16-token answers, and 100-token
    prompts with 256-token answers, at the given rates."""
    return {
        PREFILL: PhaseKind(PREFILL, (1500, 2000), 16, prefill_rate),
        DECODE: PhaseKind(DECODE, (100, 100), 256, decode_rate),
    }


def phase_plan(cycles: int, steady: str | None = None) -> list[str]:
    """``[prefill-heavy, decode-heavy] * cycles``, or ``[steady] * 2 * cycles``."""
    if cycles < 1:
        raise ValueError(f"cycles must be >= 1, got {cycles}")
    if steady is not None:
        if steady not in (PREFILL, DECODE):
            raise ValueError(f"a steady trace is {PREFILL} or {DECODE}, got {steady!r}")
        return [steady] * (2 * cycles)
    return [PREFILL, DECODE] * cycles


def phase_arrivals(rate: float, phase_s: float, rng: random.Random) -> list[float]:
    """Poisson arrival offsets (s) in ``[0, phase_s)`` at ``rate`` req/s (the first after one gap)."""
    out, t = [], rng.expovariate(rate)
    while t < phase_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def make_trace(
    plan: list[str], kinds: dict[str, PhaseKind], phase_s: float, counter: LengthCounter, seed: int
) -> list[RequestSpec]:
    """The requests of ``plan`` (phase kinds in order, ``phase_s`` each), indexed in arrival order."""
    if not phase_s > 0:
        raise ValueError(f"phase length must be > 0 s, got {phase_s}")
    rng = random.Random(seed)
    out: list[RequestSpec] = []
    for i, name in enumerate(plan):
        kind = kinds[name]
        times = phase_arrivals(kind.rate, phase_s, rng)
        shape = PromptShape(len(times), kind.input_range[0], kind.input_range[1], kind.output_len, kind=name)
        for spec, t in zip(make_requests(shape, counter, rng.randrange(2**31), start_index=len(out)), times):
            out.append(RequestSpec(spec.index, spec.prompt, spec.prompt_len, spec.output_len, name, i * phase_s + t))
    return out


@dataclass(frozen=True)
class Outcome:
    """One configuration on one trace (see the module docstring); latencies in ms (None: no sample)."""

    config: str
    trace: str
    requests: int
    met: int
    failed: int
    trace_s: float
    goodput: float
    met_share: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    role_switches: int
    planner: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(seconds: list[float], q: float) -> float | None:
    return round(percentile([s * 1000 for s in seconds], q), 1) if seconds else None


def outcome(
    config: str,
    trace: str,
    results: list[RequestResult],
    trace_s: float,
    slo: SLO,
    role_switches: int = 0,
    planner: bool = False,
) -> Outcome:
    """The figures of ``results`` (every request sent) over a trace of ``trace_s`` seconds."""
    if slo.ttft_ms is None or slo.tpot_ms is None:
        raise ValueError("goodput needs both a TTFT and a TPOT SLO")
    ok = [r for r in results if r.ok]
    met = sum(slo.met(r) for r in results)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return Outcome(
        config=config,
        trace=trace,
        requests=len(results),
        met=met,
        failed=len(results) - len(ok),
        trace_s=trace_s,
        goodput=round(met / trace_s, 4),
        met_share=round(met / len(results), 3) if results else 0.0,
        ttft_p50_ms=_pct(ttft, 50),
        ttft_p99_ms=_pct(ttft, 99),
        tpot_p50_ms=_pct(tpot, 50),
        tpot_p99_ms=_pct(tpot, 99),
        role_switches=role_switches,
        planner=planner,
    )


def planner_ratio(rows: list[Outcome], trace: str) -> float | None:
    """The planner's goodput over the best static configuration's on ``trace``; None without both
    (or when the best static met nothing)."""
    static = [r.goodput for r in rows if r.trace == trace and not r.planner]
    planned = [r.goodput for r in rows if r.trace == trace and r.planner]
    if not static or not planned or max(static) == 0:
        return None
    return round(max(planned) / max(static), 3)


COLUMNS = [
    "trace",
    "configuration",
    "requests",
    "met SLOs",
    "goodput req/s",
    "met share",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "failed",
    "role switches",
    "planner / best static",
]


def goodput_table(rows: list[Outcome]) -> list[list]:
    """Table rows (``COLUMNS``): one per outcome, the planner's ratio on its trace's planner rows."""
    return [
        [
            r.trace,
            r.config,
            r.requests,
            r.met,
            r.goodput,
            r.met_share,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.tpot_p50_ms,
            r.tpot_p99_ms,
            r.failed,
            r.role_switches,
            planner_ratio(rows, r.trace) if r.planner else None,
        ]
        for r in rows
    ]


def format_table(rows: list[list]) -> str:
    """``rows`` under ``COLUMNS`` as fixed-width text ("-" for no value)."""
    return format_rows(COLUMNS, rows)


PHASE_COLUMNS = ["trace", "configuration", "phase kind", "requests", "met SLOs", "TTFT p50 ms", "TPOT p50 ms", "failed"]


def phase_table(requests: list[dict], slo: SLO) -> list[list]:
    """Per trace, configuration and phase kind (in first-seen order): requests, those meeting both
    SLOs, TTFT/TPOT p50 (ms) of the successful ones, failures. ``requests``: the benchmark's raw
    records (``trace``, ``config``, ``kind``, ``ttft_s``, ``tpot_s``, ``error``): which phase of
    the trace each split misses in."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in requests:
        groups.setdefault((r["trace"], r["config"], r["kind"]), []).append(r)
    rows = []
    for (trace, config, kind), rs in groups.items():
        ok = [r for r in rs if r["error"] is None]
        met = sum(
            r["ttft_s"] is not None
            and r["ttft_s"] * 1000 <= slo.ttft_ms
            and (r["tpot_s"] is None or r["tpot_s"] * 1000 <= slo.tpot_ms)
            for r in ok
        )
        ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
        tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
        rows.append([trace, config, kind, len(rs), met, _pct(ttft, 50), _pct(tpot, 50), len(rs) - len(ok)])
    return rows


def phase_ceiling(phase_rows: list[list], rows: list[Outcome]) -> dict[str, tuple[int, float | None]]:
    """Per trace with a static configuration: (requests meeting both SLOs had each phase kind run at
    the static configuration that met most in it, that over the best static configuration's met
    count). A planner that switched at no cost between the static splits would meet that many: on
    a trace whose phases carry very different request counts it caps what any planner can gain.
    ``phase_rows``: ``phase_table``'s rows; ``rows``: the outcomes (which are the planner's)."""
    planners = {(r.trace, r.config) for r in rows if r.planner}
    best: dict[tuple[str, str], int] = {}
    for trace, config, kind, _, met, *_ in phase_rows:
        if (trace, config) not in planners:
            best[(trace, kind)] = max(best.get((trace, kind), 0), met)
    ceiling: dict[str, int] = {}
    for (trace, _), met in best.items():
        ceiling[trace] = ceiling.get(trace, 0) + met
    out = {}
    for trace, met in ceiling.items():
        static = max(r.met for r in rows if r.trace == trace and not r.planner)
        out[trace] = (met, round(met / static, 3) if static else None)
    return out


def format_rows(columns: list[str], rows: list[list]) -> str:
    """``rows`` under ``columns`` as fixed-width text ("-" for no value)."""
    cells = [columns] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
