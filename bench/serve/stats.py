"""Serving statistics over ``RequestResult``s: latency summaries, throughput, goodput.

Definitions (as in vLLM's serving benchmark):
- TTFT: request sent -> first chunk with text.
- TPOT per request: (E2E - TTFT) / (output tokens - 1); requests with < 2 output tokens have none.
- ITL: every gap between consecutive text chunks, pooled over all requests.
- E2E: request sent -> stream closed.
- output tok/s: output tokens of successful requests / wall duration of the run.
- goodput: successful requests per second whose TTFT and TPOT both meet the given SLOs.
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from bench.serve.client import RequestResult


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation; ``ValueError`` if empty."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Mean, median and P99 of one latency in milliseconds, over ``count`` samples."""

    count: int
    mean_ms: float
    p50_ms: float
    p99_ms: float


def summarize(seconds: list[float]) -> Summary | None:
    """``Summary`` of latencies given in seconds (None when there are none)."""
    if not seconds:
        return None
    ms = [s * 1000 for s in seconds]
    return Summary(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 99))


@dataclass(frozen=True)
class SLO:
    """Latency targets in ms; None means no target on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, r: RequestResult) -> bool:
        """True if ``r`` succeeded and meets every given target (a missing TPOT meets a TPOT target)."""
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000 > self.ttft_ms):
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


@dataclass
class RunStats:
    """Statistics of one run (one load level against one server)."""

    requests: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    output_len_mismatches: int
    ttft: Summary | None
    tpot: Summary | None
    itl: Summary | None
    e2e: Summary | None
    goodput: float | None = None
    goodput_requests: int | None = None
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def compute_stats(results: list[RequestResult], duration_s: float, slo: SLO = SLO()) -> RunStats:
    """``RunStats`` of ``results`` measured over ``duration_s`` wall seconds."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.expected_prompt_len for r in ok)
    dur = max(duration_s, 1e-9)
    good = [r for r in ok if slo.met(r)] if slo.given else None
    errors = sorted({r.error for r in results if r.error})
    return RunStats(
        requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        input_tokens=in_tokens,
        output_tokens=out_tokens,
        request_throughput=len(ok) / dur,
        output_throughput=out_tokens / dur,
        output_len_mismatches=sum(r.output_tokens != r.expected_output_len for r in ok),
        ttft=summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot=summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl=summarize([g for r in ok for g in r.itl_s]),
        e2e=summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        goodput=None if good is None else len(good) / dur,
        goodput_requests=None if good is None else len(good),
        errors=errors[:10],
    )
