"""Counters a scheduler keeps (exported as Prometheus metrics by the worker)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SchedulerStats:
    retractions: int = 0
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    oom_aborts: int = 0
    rejected_requests: int = 0
    prompt_tokens: int = 0
    prefill_computed_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    decode_steps: int = 0
    extend_steps: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
