"""Counters a scheduler keeps (exported as Prometheus metrics by the worker)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SchedulerStats:
    retractions: int = 0
    preemptions: int = 0  # running requests retracted to start one of an API key under its share (PD decode)
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    oom_aborts: int = 0
    rejected_requests: int = 0
    swa_rejections: int = 0  # refused because their SWA KV cannot fit the SWA pool
    prompt_tokens: int = 0
    prefill_computed_tokens: int = 0
    prefill_compute_seconds: float = 0.0  # wall time of the forwards that computed them (PD prefill)
    cached_prompt_tokens: int = 0
    # failover continuations (Request.continuation): prompt + output tokens prefilled here, and those the
    # radix cache held at admission (computed + cached = the continuations' prefill lengths)
    continuation_prefill_tokens: int = 0
    continuation_cached_tokens: int = 0
    generation_tokens: int = 0
    direct_answers: int = 0  # one-token requests a prefill worker answered the router itself (PD)
    finished_requests: int = 0
    aborted_requests: int = 0
    decode_steps: int = 0
    extend_steps: int = 0
    mixed_steps: int = 0  # forwards that carried decode rows and prefill tokens together

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """Cumulative-bucket histogram a worker ships in ``WorkerStats.histograms``."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(buckets) + 1)  # last = +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    @property
    def count(self) -> int:
        return sum(self.counts)

    def as_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}
