"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types, unknown fields refused).

Only what the server implements is declared; anything else is a 400 naming the field, so a
sampling option is never silently ignored. Non-standard extensions (as in vLLM): ``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens`` and
``return_token_ids`` (adds ``prompt_token_ids`` / ``token_ids`` to each choice).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from transfer.wire.sampling_params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` and no choices."""

    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions. ``None`` means the OpenAI default."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = Field(0, ge=-(2**31), lt=2**31, description="vLLM's extension: under overload a lower value is "
                          "forwarded sooner (within its API key) and shed later")
    timeout: float | None = Field(None, gt=0, description="seconds from arrival after which the request is dropped "
                                  "with 504 (queued or running); the server's request_timeout_s caps it")

    def stop_strings(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        """Engine ``SamplingParams``; raises ``pydantic.ValidationError`` naming the bad field."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed,
                 "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                 "repetition_penalty": self.repetition_penalty}
        kw = {k: v for k, v in given.items() if v is not None}
        if self.top_k is not None:
            kw["top_k"] = -1 if self.top_k == 0 else self.top_k
        return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, logprobs=logprobs,
                              logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()}, **kw)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings (one choice per prompt),
    a list of token ids, or a list of token-id lists."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    """A ``{"type": "text", "text": ...}`` content part (the only kind supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message; ``developer`` is treated as ``system``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        """``{"role", "content"}`` as the chat template expects (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
