"""Sampling parameters and the stop check: plain pydantic/Python, no torch.

Imported by the router, the wire protocol and the workers alike, so a process that only routes
requests never loads torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from transfer.wire.enums import FinishReason

MAX_LOGPROBS = 20
"""Largest accepted ``SamplingParams.logprobs`` (number of top alternatives returned)."""
MAX_LOGIT_BIAS = 1024
"""Most entries accepted in ``SamplingParams.logit_bias``."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class StructuredOutput(BaseModel):
    """A constraint on the output, enforced token by token with a grammar engine's masks.

    ``kind``: "json" (``spec`` is a JSON schema, as JSON text), "regex" (a regular expression the
    whole output matches), "choice" (``spec`` is a JSON list of strings: the output is one of them)
    or "grammar" (a Lark grammar, llguidance's dialect).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "regex", "choice", "grammar"]
    spec: str


class SamplingParams(BaseModel):
    """Immutable, validated sampling settings of one request.

    Fields (defaults in brackets):

    - ``max_new_tokens`` [16]: >= 1; generation finishes with reason "length" at this count.
    - ``temperature`` [1.0]: finite, >= 0; ``0`` selects greedy decoding (argmax).
    - ``top_p`` [1.0]: in (0, 1]; keep the smallest set of most likely tokens whose probability
      mass reaches ``top_p``.
    - ``top_k`` [-1]: ``-1`` (disabled) or >= 1; keep the ``top_k`` most likely tokens.
    - ``min_p`` [0.0]: in [0, 1]; drop tokens whose probability is below ``min_p * max_prob``.
    - ``seed`` [None]: per-request RNG seed; ``None`` uses torch's global RNG.
    - ``repetition_penalty`` [1.0]: > 0; HF semantics over prompt and generated ids.
    - ``frequency_penalty`` / ``presence_penalty`` [0.0]: in [-2, 2]; OpenAI semantics over
      generated ids only.
    - ``stop_token_ids`` [()]: non-negative ids that finish generation (reason "stop"), honoured
      even when ``ignore_eos`` is set.
    - ``ignore_eos`` [False]: do not stop on the model's EOS ids.
    - ``logprobs`` [None]: ``None`` = no logprobs; ``n`` in 0..20 = return the chosen token's
      logprob plus the top ``n`` alternatives (``0``: chosen token only).
    - ``prompt_logprobs`` [None]: ``None`` = none; ``n`` in 0..20 = the logprob of every prompt
      token after the first (under the raw distribution given the tokens before it) plus the top
      ``n`` alternatives, computed over the whole prompt (the prefix cache is not used for it).
    - ``structured`` [None]: a ``StructuredOutput``: tokens the constraint cannot continue with are
      masked before sampling (greedy rows too); logprobs stay those of the raw distribution.
    - ``logit_bias`` [()]: ``(token_id, bias)`` pairs sorted by id (a ``{id: bias}`` mapping is
      accepted), bias in [-100, 100], added to the logits before penalties and sampling (OpenAI
      semantics: -100 bans a token, +100 all but forces it; greedy rows see it too). Logprobs stay
      those of the raw distribution.

    Unknown fields are rejected; invalid values raise ``pydantic.ValidationError`` naming the field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @field_validator("max_new_tokens")
    @classmethod
    def _check_max_new_tokens(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v: float) -> float:
        if not (0.0 < v <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {v}")
        return v

    @field_validator("min_p")
    @classmethod
    def _check_min_p(cls, v: float) -> float:
        if not (0.0 <= v <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v: int | None) -> int | None:
        if v is not None and not (_SEED_MIN <= v <= _SEED_MAX):
            raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _check_repetition_penalty(cls, v: float) -> float:
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {v}")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _check_openai_penalty(cls, v: float, info) -> float:
        if not (-2.0 <= v <= 2.0):
            raise ValueError(f"{info.field_name} must be in [-2, 2], got {v}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {bad}")
        return v

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _check_logprobs(cls, v: int | None, info) -> int | None:
        if v is not None and not (0 <= v <= MAX_LOGPROBS):
            raise ValueError(f"{info.field_name} must be None or in [0, {MAX_LOGPROBS}], got {v}")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, v):
        pairs = sorted((int(k), float(b)) for k, b in (v.items() if isinstance(v, dict) else v))
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}")
        ids = [t for t, _ in pairs]
        if len(set(ids)) < len(ids):
            raise ValueError("logit_bias names a token id twice")
        bad = [(t, b) for t, b in pairs if t < 0 or not (math.isfinite(b) and -100.0 <= b <= 100.0)]
        if bad:
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {bad[:5]}")
        return tuple(pairs)

    @property
    def is_greedy(self) -> bool:
        """True iff ``temperature == 0``: the sampler returns the argmax of the penalised logits."""
        return self.temperature == 0.0

    @property
    def uses_repetition_penalty(self) -> bool:
        """True iff ``repetition_penalty != 1`` (the state then tracks prompt+generated ids)."""
        return self.repetition_penalty != 1.0

    @property
    def uses_count_penalties(self) -> bool:
        """True iff a frequency or presence penalty is set (the state then counts generated ids)."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def uses_penalties(self) -> bool:
        """True iff a logit bias or a repetition / frequency / presence penalty changes the logits."""
        return bool(self.logit_bias) or self.uses_repetition_penalty or self.uses_count_penalties


def check_stop(
    token_id: int,
    params: SamplingParams,
    eos_token_ids: Sequence[int] | set[int] | frozenset[int],
    num_generated: int,
) -> FinishReason | None:
    """Finish reason after generating ``token_id`` (``num_generated`` counts it), or ``None``.

    Returns ``"stop"`` if ``token_id`` is an EOS id (unless ``params.ignore_eos``) or one of
    ``params.stop_token_ids``; otherwise ``"length"`` if ``num_generated >= params.max_new_tokens``;
    otherwise ``None``. "stop" wins when both apply.
    """
    if token_id in params.stop_token_ids:
        return FinishReason.STOP
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if num_generated >= params.max_new_tokens:
        return FinishReason.LENGTH
    return None
