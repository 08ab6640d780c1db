"""Scheduler settings shared by colocated, prefill and decode workers."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CPU_CHUNKED_PREFILL, GPU_CHUNKED_PREFILL = 512, 2048
CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS = 256, 2048


class SchedulerConfig(BaseModel):
    """Batching, admission and retract knobs (defaults follow SGLang)."""

    model_config = ConfigDict(extra="forbid")

    max_running_requests: int = Field(64, ge=1, description="decode batch size cap")
    chunked_prefill_size: int | None = Field(
        None,
        ge=1,
        description="max prompt tokens computed per step (unset: 512 on CPU, 2048 on CUDA): a prompt that "
        "arrives while others prefill waits for at most one such step, so a smaller chunk lowers TTFT "
        "under load on a CPU, where a step of 2048 tokens is long",
    )
    mixed_batches: bool = Field(
        True,
        description="one forward carries the running decodes plus a chunk of prefill (decode rows first) "
        "instead of prefill and decode steps apart (colocated, and a decode worker's local prefill): "
        "running requests keep producing tokens while a prompt prefills, so TPOT and ITL tails stay "
        "low at the same throughput",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="mixed batches: rows of one forward while requests decode (decode rows first, prefill "
        "gets the rest, never less than the decode rows); bounds how long a prompt's chunk holds up the "
        "running decodes (unset: 256 on CPU, 2048 on CUDA). A step with nothing decoding prefills up to "
        "chunked_prefill_size",
    )
    prefill_step_s: float = Field(
        0.0,
        ge=0,
        description="prefill workers, and a decode worker's own prefill (selective disaggregation): each step's "
        "chunk is sized from a step cost fitted to the worker's recent prefill steps (a fixed part plus a "
        "cost per row, decode rows included) so that the step takes about this long, but never so small "
        "that the fixed part is over half of a step (where it is large, as on a loaded CPU, steps take "
        "longer than this and at least half of each computes rows); at least 16 tokens, at most "
        "chunked_prefill_size and the mixed budget, the first chunk 64 tokens, so a fast host keeps chunks "
        "of chunked_prefill_size. A worker reads its control messages (a role switch, a withdrawal, a "
        "drain, an abort) between steps, so on a slow or shared CPU this bounds their wait behind a long "
        "prompt (e.g. 0.5 for role switches within 2 s). Off by default (0: chunks of "
        "chunked_prefill_size): paced chunks cost prefill throughput on a loaded CPU "
        "(docs/design/role-switch.md#measured). Colocated workers do not pace (docs/design/selective-pd.md)",
    )
    continuation_forward_tokens: int = Field(
        0,
        ge=0,
        description="failover continuations (a dead worker's streams, which arrive as one burst): a forward "
        "computes at most this many of their prefill tokens, the shortest continuation (prompt + tokens sent) "
        "first, ahead of other waiting prompts, so a short one resumes after its own compute and the shorter "
        "ones' rather than the whole burst's. Where a forward costs about linearly in its tokens (a CPU) the "
        "burst's end moves little; where it hardly grows with the batch (an accelerator) it only delays the "
        "end (docs/design/failover.md). 0 = off: continuations are admitted as any request, in arrival order",
    )
    schedule_conservativeness: float = Field(
        1.0, gt=0, description="scales new_token_ratio; raise it if retracts are frequent"
    )
    init_new_token_ratio: float = Field(0.7, gt=0, le=1, description="initial reservation ratio (x conservativeness)")
    min_new_token_ratio_factor: float = Field(0.14, gt=0, le=1, description="floor = init ratio x this")
    new_token_ratio_decay_steps: int = Field(600, ge=1, description="decode steps from init to floor")
    retract_decode_steps: int = Field(20, ge=1, description="decode steps of room left to each request after a retract")
    retract_order: Literal["most-output", "least-output"] = Field(
        "most-output",
        description="which running request a retract takes first: most-output (most output tokens, then "
        "shortest input) parks the request nearest its end, which waits at most about as long as it has "
        "run; least-output (least output, then longest input, as SGLang) parks the newest, which waits "
        "for the older ones unless --migrate-after moves it to a peer (docs/design/retract.md)",
    )
    retract_test_interval: int | None = Field(None, ge=1, description="force a retract every N decode steps (testing)")
    test_step_delay_s: float = Field(
        0.0,
        ge=0,
        description="testing: the worker loop sleeps this long after every "
        "step that had work (a slow, oversubscribed machine)",
    )
    enable_radix_cache: bool = Field(True, description="reuse cached prompt prefixes")
    speculative_method: Literal["ngram", "off"] = Field(
        "ngram",
        description="speculative decoding (colocated and decode workers): ngram (default) drafts up to "
        "num_speculative_tokens tokens per decoding request from its own prompt + output (longest suffix match) "
        "and verifies them in one step, drafting only where the measured step cost says a draft pays; outputs "
        "are identical to decoding without it (docs/design/speculative.md). off: every step decodes one token "
        "per request",
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=32, description="speculative decoding: most draft tokens verified per request and step"
    )
    ngram_min: int = Field(2, ge=1, description="speculative ngram: shortest suffix that may match")
    ngram_max: int = Field(4, ge=1, description="speculative ngram: longest suffix tried first")
    speculative_config: str | None = Field(
        None,
        description='speculative decoding in vLLM\'s JSON form, e.g. {"method": "ngram", "num_speculative_tokens": '
        '4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}: sets the four fields above (giving one of them as '
        "well with another value is an error)",
    )
    spec_max_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="speculative decoding: a step drafts only while its tokens (decode rows, prefill tokens "
        "and drafted tokens) stay within this many and max_num_batched_tokens, drafts trimmed to fit. Unset: "
        "2 x spec_step_fixed_tokens, where a draft token needs a 2/3 chance of acceptance to pay, and at "
        "most spec_step_linear_tokens, so a compute-bound batch with more rows does not draft "
        "(docs/design/speculative.md)",
    )
    spec_step_linear_tokens: int = Field(
        96,
        ge=1,
        description="speculative decoding: the largest step (in tokens) over which a step's cost was measured "
        "to stay spec_step_fixed_tokens + T; the unset spec_max_batch_tokens never exceeds it (96: "
        "benchmarks.spec_step --curve on the embedded model, bfloat16 and float32, linear from 16 to 96 "
        "tokens; docs/design/speculative.md)",
    )
    spec_step_fixed_tokens: float = Field(
        12.0,
        gt=0,
        description="speculative decoding: a step's fixed cost in token rows (a step of T tokens costs about this "
        "+ T rows); a draft token is verified only while its chance of acceptance (the request's recent "
        "acceptance to the power of its place in the draft) times the step's cost exceeds the step's expected "
        "tokens, so a large batch drafts only likely tokens (12: measured with benchmarks.spec_step on the "
        "embedded model in bfloat16 on a 2-core CPU; docs/design/speculative.md). inf: draft whenever "
        "spec_max_batch_tokens allows (then set it: unset, it has no cap)",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_speculative_config(cls, data):
        """Expand ``speculative_config`` (vLLM's JSON) into the speculative fields."""
        if not isinstance(data, dict) or not data.get("speculative_config"):
            return data
        try:
            spec = json.loads(data["speculative_config"])
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError("speculative_config must be a JSON object")
        names = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens"}
        names |= {"prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max"}
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} (known: {sorted(names)})")
        out = {k: v for k, v in data.items() if k != "speculative_config"}
        for key, field in names.items():
            if key in spec:
                if field in out and out[field] != spec[key]:
                    raise ValueError(f"speculative_config sets {key}={spec[key]!r} but {field} is {out[field]!r}")
                out[field] = spec[key]
        return out

    @model_validator(mode="after")
    def _ngram_range(self) -> SchedulerConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        return self

    def for_device(self, device_type: str) -> SchedulerConfig:
        """This config with ``chunked_prefill_size`` and ``max_num_batched_tokens`` set for
        ``device_type`` ("cpu", "cuda") where unset; schedulers call it once with their runner's
        device and read both fields as ints."""
        cpu = device_type == "cpu"
        update = {}
        if self.chunked_prefill_size is None:
            update["chunked_prefill_size"] = CPU_CHUNKED_PREFILL if cpu else GPU_CHUNKED_PREFILL
        if self.max_num_batched_tokens is None:
            update["max_num_batched_tokens"] = CPU_BATCHED_TOKENS if cpu else GPU_BATCHED_TOKENS
        return self.model_copy(update=update) if update else self
