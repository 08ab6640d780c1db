"""Scheduler settings shared by colocated, prefill and decode workers."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SchedulerConfig(BaseModel):
    """Batching, admission and retract knobs (defaults follow SGLang)."""

    model_config = ConfigDict(extra="forbid")

    max_running_requests: int = Field(64, ge=1, description="decode batch size cap")
    chunked_prefill_size: int = Field(2048, ge=1, description="max prompt tokens computed per step")
    mixed_batches: bool = Field(False, description="colocated: one forward carries the running decodes plus a chunk "
                                "of prefill (decode rows first) instead of prefill and decode steps apart (off by "
                                "default until an A/B on a quiet machine shows it wins end to end)")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="mixed batches: tokens of one forward, "
                                               "decode rows (one each) first, then prefill up to "
                                               "chunked_prefill_size; lower it to bound inter-token latency while "
                                               "prompts arrive (None: chunked_prefill_size of prefill on top of "
                                               "the decode rows)")
    schedule_conservativeness: float = Field(1.0, gt=0, description="scales new_token_ratio; raise it if retracts are frequent")
    init_new_token_ratio: float = Field(0.7, gt=0, le=1, description="initial reservation ratio (x conservativeness)")
    min_new_token_ratio_factor: float = Field(0.14, gt=0, le=1, description="floor = init ratio x this")
    new_token_ratio_decay_steps: int = Field(600, ge=1, description="decode steps from init to floor")
    retract_decode_steps: int = Field(20, ge=1, description="decode steps of room left to each request after a retract")
    retract_test_interval: int | None = Field(None, ge=1, description="force a retract every N decode steps (testing)")
    test_step_delay_s: float = Field(0.0, ge=0, description="testing: the worker loop sleeps this long after every "
                                     "step that had work (a slow, oversubscribed machine)")
    enable_radix_cache: bool = Field(True, description="reuse cached prompt prefixes")

    @model_validator(mode="after")
    def _budget_above_decode_rows(self) -> "SchedulerConfig":
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.max_running_requests:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be larger than "
                             f"max_running_requests ({self.max_running_requests}): a step's decode rows come first "
                             f"and prefill only gets the tokens left; raise --max-num-batched-tokens or lower "
                             f"--max-running-requests")
        return self
