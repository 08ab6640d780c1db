"""Interference study: a Poisson stream of short chat-like requests with long prompts (1,500+
tokens) arriving at random among them. What counts is the short requests' TPOT and TTFT: in a
colocated server every long prefill stalls the decode batch; PD moves prefill to another worker."""

from __future__ import annotations

from dataclasses import dataclass

from bench.serve.report import RunRecord
from bench.serve.runner import Measured
from bench.serve.stats import SLO, compute_stats
from bench.serve.workload import (
    LengthCounter,
    PromptShape,
    RequestSpec,
    make_requests,
    merge_by_arrival,
    poisson_arrivals,
)


@dataclass(frozen=True)
class InterferenceSpec:
    """Short requests at ``short_rate`` req/s and long ones at ``long_rate`` (None: spread the long
    ones over the short stream's expected duration)."""

    short: PromptShape
    short_rate: float
    long: PromptShape
    long_rate: float | None = None

    def effective_long_rate(self) -> float:
        if self.long_rate is not None:
            return self.long_rate
        window = self.short.num_prompts / self.short_rate
        return max(self.long.num_prompts, 1) / max(window, 1e-9)


def interference_requests(spec: InterferenceSpec, counter: LengthCounter, seed: int) -> list[RequestSpec]:
    """Short and long requests merged by arrival time (``kind`` is ``short`` or ``long``); deterministic."""
    short = poisson_arrivals(make_requests(spec.short, counter, seed), spec.short_rate, seed + 1)
    long = make_requests(spec.long, counter, seed + 2, start_index=len(short))
    long = poisson_arrivals(long, spec.effective_long_rate(), seed + 3, first_at_zero=False)
    return merge_by_arrival(short, long)


def interference_records(target: str, measured: Measured, slo: SLO, load: str) -> list[RunRecord]:
    """One record per kind: ``short`` (the figure that matters), ``long``, and ``mixed`` (both)."""
    out = []
    for kind in ("short", "long", "mixed"):
        rs = [r for r in measured.results if kind == "mixed" or r.kind == kind]
        out.append(RunRecord(target, load, None, None, compute_stats(rs, measured.duration_s, slo), rs, kind=kind))
    return out
