"""Scheduler settings shared by colocated, prefill and decode workers."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


CPU_CHUNKED_PREFILL, GPU_CHUNKED_PREFILL = 512, 2048


class SchedulerConfig(BaseModel):
    """Batching, admission and retract knobs (defaults follow SGLang)."""

    model_config = ConfigDict(extra="forbid")

    max_running_requests: int = Field(64, ge=1, description="decode batch size cap")
    chunked_prefill_size: int | None = Field(
        None, ge=1, description="max prompt tokens computed per step (unset: 512 on CPU, 2048 on CUDA; on the 2-core "
                                "CPU box 512 gave 0.57x / 0.68x the mean TTFT of 2048 at c=8 / 32 and 1.10x / 1.19x "
                                "the output tok/s: a prompt that arrives while others prefill waits for a shorter step)")
    mixed_batches: bool = Field(False, description="colocated: one forward carries the running decodes plus a chunk "
                                "of prefill (decode rows first) instead of prefill and decode steps apart (off by "
                                "default until an A/B on a quiet machine shows it wins end to end)")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="mixed batches: tokens of one forward, "
                                               "decode rows (one each) first, then prefill up to "
                                               "chunked_prefill_size; lower it to bound inter-token latency while "
                                               "prompts arrive (None: chunked_prefill_size in all, the prefill "
                                               "never less than half of it)")
    schedule_conservativeness: float = Field(1.0, gt=0, description="scales new_token_ratio; raise it if retracts are frequent")
    init_new_token_ratio: float = Field(0.7, gt=0, le=1, description="initial reservation ratio (x conservativeness)")
    min_new_token_ratio_factor: float = Field(0.14, gt=0, le=1, description="floor = init ratio x this")
    new_token_ratio_decay_steps: int = Field(600, ge=1, description="decode steps from init to floor")
    retract_decode_steps: int = Field(20, ge=1, description="decode steps of room left to each request after a retract")
    retract_test_interval: int | None = Field(None, ge=1, description="force a retract every N decode steps (testing)")
    test_step_delay_s: float = Field(0.0, ge=0, description="testing: the worker loop sleeps this long after every "
                                     "step that had work (a slow, oversubscribed machine)")
    enable_radix_cache: bool = Field(True, description="reuse cached prompt prefixes")

    def for_device(self, device_type: str) -> "SchedulerConfig":
        """This config with ``chunked_prefill_size`` set for ``device_type`` ("cpu", "cuda") when
        unset; schedulers call it once with their runner's device and read the field as an int."""
        if self.chunked_prefill_size is not None:
            return self
        size = CPU_CHUNKED_PREFILL if device_type == "cpu" else GPU_CHUNKED_PREFILL
        return self.model_copy(update={"chunked_prefill_size": size})

    @model_validator(mode="after")
    def _budget_above_decode_rows(self) -> "SchedulerConfig":
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= self.max_running_requests:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be larger than "
                             f"max_running_requests ({self.max_running_requests}): a step's decode rows come first "
                             f"and prefill only gets the tokens left; raise --max-num-batched-tokens or lower "
                             f"--max-running-requests")
        return self
