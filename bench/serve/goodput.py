"""Goodput (``bench serve --goodput``): the highest Poisson request rate at which at least a target
share of requests (``attainment``, 0.9 as in DistServe) meets BOTH the TTFT and the TPOT SLO.

The search is independent of HTTP: it asks a ``probe(rate) -> GoodputPoint`` for each rate it
tries. It starts at ``start_rate`` and doubles while the point passes (stopping at ``max_rate``:
the goodput is then at least the last rate, ``capped``); from the first failing rate it bisects
between the highest passing and the lowest failing rate, at most ``iters`` more probes, and stops
early once the two are no more than ``min_step`` req/s apart. When the start rate already fails,
the bracket is (0, start). The goodput is the highest rate that passed (0 when none did).
Attainment counts every request sent: a failed request (HTTP error, cut stream) misses its SLOs.
The search assumes attainment falls as the rate rises; with noise it still ends after a bounded
number of probes, and every point is reported so a non-monotone curve is visible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from bench.serve.client import RequestResult
from bench.serve.stats import SLO, percentile

DEFAULT_ATTAINMENT = 0.9


@dataclass(frozen=True)
class GoodputSpec:
    """What to search for and how far (see the module docstring)."""

    slo: SLO
    attainment: float = DEFAULT_ATTAINMENT
    start_rate: float = 1.0
    max_rate: float = 64.0
    iters: int = 4
    min_step: float = 0.05

    def __post_init__(self) -> None:
        if self.slo.ttft_ms is None or self.slo.tpot_ms is None:
            raise ValueError(
                "--goodput needs both --slo-ttft-ms and --slo-tpot-ms (e.g. --slo-ttft-ms 1000 --slo-tpot-ms 100)"
            )
        if not (self.slo.ttft_ms > 0 and self.slo.tpot_ms > 0):
            raise ValueError(
                f"--slo-ttft-ms and --slo-tpot-ms must be > 0, got {self.slo.ttft_ms} and {self.slo.tpot_ms}"
            )
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--slo-attainment is a share of requests in (0, 1], e.g. 0.9; got {self.attainment}")
        if not 0 < self.start_rate <= self.max_rate:
            raise ValueError(
                f"--goodput-start-rate must be > 0 and <= --goodput-max-rate, got {self.start_rate} and {self.max_rate}"
            )
        if self.iters < 0 or self.min_step < 0:
            raise ValueError(
                f"--goodput-iters and --goodput-min-step must be >= 0, got {self.iters} and {self.min_step}"
            )


@dataclass(frozen=True)
class GoodputPoint:
    """One probed rate: how many of its ``requests`` met both SLOs (``met``), how many failed
    outright, the share met (``attainment``), latency percentiles of the successful requests in ms
    (None when there is no sample), output tokens/s over the run, and whether it ``passed``."""

    rate: float
    requests: int
    met: int
    failed: int
    attainment: float
    passed: bool
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    output_tok_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _pct_ms(seconds: list[float], q: float) -> float | None:
    return percentile([s * 1000 for s in seconds], q) if seconds else None


def measure_point(
    rate: float, results: list[RequestResult], duration_s: float, slo: SLO, attainment: float
) -> GoodputPoint:
    """The ``GoodputPoint`` of one run at ``rate``: ``results`` are every request sent (failures
    included) and ``duration_s`` the wall time of the run. A run of no requests passes nothing."""
    ok = [r for r in results if r.ok]
    met = sum(slo.met(r) for r in results)
    share = met / len(results) if results else 0.0
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    return GoodputPoint(
        rate,
        len(results),
        met,
        len(results) - len(ok),
        share,
        bool(results) and share >= attainment,
        _pct_ms(ttft, 50),
        _pct_ms(ttft, 90),
        _pct_ms(tpot, 50),
        _pct_ms(tpot, 90),
        sum(r.output_tokens for r in ok) / max(duration_s, 1e-9),
    )


@dataclass
class GoodputResult:
    """The outcome for one target: ``goodput`` (req/s, the highest passing rate; 0 if none passed),
    ``first_failing`` (the lowest failing rate; None when every rate up to ``max_rate`` passed, so
    the goodput is a lower bound: ``capped``) and every probe in the order it ran."""

    target: str
    goodput: float
    first_failing: float | None
    points: list[GoodputPoint] = field(default_factory=list)

    @property
    def capped(self) -> bool:
        return self.first_failing is None

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "goodput": self.goodput,
            "first_failing": self.first_failing,
            "capped": self.capped,
            "points": [p.to_dict() for p in self.points],
        }


def search_goodput(target: str, spec: GoodputSpec, probe: Callable[[float], GoodputPoint]) -> GoodputResult:
    """Double from ``spec.start_rate`` until a point fails (or ``max_rate``), then bisect; see the
    module docstring. ``probe`` runs one load at the given rate and returns its point."""
    points: list[GoodputPoint] = []

    def passes(rate: float) -> bool:
        points.append(probe(rate))
        return points[-1].passed

    lo, hi, rate = 0.0, None, spec.start_rate
    while True:
        if not passes(rate):
            hi = rate
            break
        lo = rate
        if rate * 2 > spec.max_rate:
            break
        rate *= 2
    if hi is not None:
        for _ in range(spec.iters):
            if hi - lo <= spec.min_step:
                break
            mid = (lo + hi) / 2
            if passes(mid):
                lo = mid
            else:
                hi = mid
    return GoodputResult(target, lo, hi, points)
