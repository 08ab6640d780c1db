"""The request fields this server accepts but does not act on, and those it refuses unless left at
their default, each with the reason a client is told (``docs/usage/request-fields.md`` lists the same).

``check_extensions(req)`` raises a 400 ``APIError`` naming the first refused field that has a
value other than its default; ignored fields need no check (their reason is documentation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.router.errors import APIError
from server.router.openai_schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

# Accepted and ignored: the reason each cannot change what this server returns.
IGNORED: dict[str, str] = {
    "user": "an end-user id for abuse monitoring; nothing here reads it",
    "metadata": "tags for stored completions; this server stores nothing",
    "store": "this server stores no completions (nothing to retrieve later)",
    "spaces_between_special_tokens": "only slow (Python) tokenizers insert such spaces; the served models' are fast",
    "length_penalty": "applies to beam search only (use_beam_search is refused)",
    "session_id": "a client's conversation id; routing here is by load, not by session",
    "stream_interval": "every scheduler step's tokens are streamed as they come",
    "vllm_xargs": "arguments for custom logits processors; none are installed",
    "thinking_token_budget": "the served models do not think (no reasoning section to budget)",
    "include_reasoning": "the served models produce no separate reasoning",
    "reasoning_effort": "the served models have no reasoning mode",
    "parallel_tool_calls": "tool_choice auto returns every call the model writes; a forced call (required or "
    "a named tool) is always exactly one",
    "media_io_kwargs": "the served models are text only",
    "mm_processor_kwargs": "the served models are text only",
}


@dataclass(frozen=True)
class Refusal:
    """A field refused unless ``allowed(value)``; ``planned`` marks a later feature of this server."""

    field: str
    reason: str
    allowed: Callable[[Any], bool] = lambda v: v is None
    planned: bool = False


def _falsy(v: Any) -> bool:
    return not v


REFUSED: tuple[Refusal, ...] = (
    Refusal("min_tokens", "the sampler has no minimum length (only 0)", lambda v: v == 0),
    Refusal("use_beam_search", "beam search is not implemented", _falsy),
    Refusal("watermarking", "output watermarking is not implemented", _falsy),
    Refusal("allowed_token_ids", "restricting the vocabulary is not implemented (logit_bias can ban tokens)"),
    Refusal("bad_words", "banned words are not implemented (logit_bias can ban single tokens)", _falsy),
    Refusal("logprob_token_ids", "logprobs of chosen token ids are not implemented"),
    Refusal(
        "cache_salt",
        "the prefix cache is not partitioned by salt; a salt would promise an isolation this server does not give",
    ),
    Refusal(
        "kv_transfer_params",
        "pdserve moves the KV cache between its own workers; external KV connector parameters do not apply",
    ),
    Refusal("ec_transfer_params", "there is no encoder cache (text-only models)"),
    Refusal("repetition_detection", "repetition detection is not implemented"),
    Refusal("logits_processors", "custom logits processors cannot be loaded from a request"),
    Refusal("prompt_embeds", "prompts must be text or token ids"),
    Refusal("suffix", "suffix (fill-in-the-middle) is not implemented", _falsy),
    Refusal(
        "chat_template",
        "a chat template sent with the request is not trusted (as in vLLM without "
        "--trust-request-chat-template); the model's own template is used",
    ),
)


def check_extensions(req: SamplingFields) -> None:
    """400 ``APIError`` naming the first refused field of ``req`` that is set to a non-default value."""
    for rule in REFUSED:
        if rule.field not in type(req).model_fields:
            continue
        value = getattr(req, rule.field)
        if not rule.allowed(value):
            later = " (planned)" if rule.planned else ""
            raise APIError(
                400, f"{rule.field}={_short(value)} is not supported{later}: {rule.reason}", param=rule.field
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def documented_fields() -> set[str]:
    """Every top-level field of both request bodies (what ``docs/usage/request-fields.md`` must list)."""
    return set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
