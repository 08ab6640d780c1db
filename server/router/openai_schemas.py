"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types, unknown fields refused).

Declared here: OpenAI's fields and vLLM's extensions of them (the names of vLLM's OpenAI server). A
field declared by neither is a 400 naming it. A declared field is one of three kinds (the
request-field reference, ``docs/usage/request-fields.md``, lists every one): supported; accepted and
ignored (it cannot change the output here, e.g. ``metadata``, ``user``); or refused unless it has
its default value, with a message saying why (``server.router.extensions`` holds those two lists and
the checks), so a sampling option is never silently dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from transfer.wire.sampling_params import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` and no choices;
    ``continuous_usage_stats`` (vLLM) adds, with ``include_usage``, the usage so far to every chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False

    @property
    def final_usage(self) -> bool:
        """Whether the stream ends with a usage-only chunk."""
        return bool(self.include_usage)

    @property
    def usage_every_chunk(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM: only together with ``include_usage``)."""
        return bool(self.include_usage and self.continuous_usage_stats)


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions. ``None`` means the OpenAI default."""

    model: str | None = None
    n: int | None = 1
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
    # vLLM extensions, supported
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    return_tokens_as_token_ids: bool | None = None
    # accepted and ignored (see server.router.extensions.IGNORED)
    user: str | None = None
    priority: int = Field(
        0,
        ge=-(2**31),
        lt=2**31,
        description="vLLM's extension: under overload a lower value is "
        "forwarded sooner (within its API key) and shed later",
    )
    timeout: float | None = Field(
        None,
        gt=0,
        description="seconds from arrival after which the request is dropped "
        "with 504 (queued or running); the server's request_timeout_s caps it",
    )
    metadata: dict[str, str] | None = None
    store: bool | None = None
    spaces_between_special_tokens: bool = True
    length_penalty: float = 1.0
    session_id: str | None = None
    stream_interval: int | None = Field(None, ge=1)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    thinking_token_budget: int | None = None
    # refused unless default (see server.router.extensions.REFUSED)
    min_tokens: int = 0
    use_beam_search: bool = False
    watermarking: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None
    repetition_detection: dict | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logits_processors: list | None = None

    def wanted_prompt_logprobs(self) -> int | None:
        """How many top alternatives per prompt token the engine must compute (None: none):
        ``prompt_logprobs``, and on completions ``echo`` with ``logprobs`` (the echoed prompt's logprobs)."""
        return self.prompt_logprobs

    def stop_strings(self) -> list[str]:
        """``stop`` as a list of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        """Engine ``SamplingParams``; raises ``pydantic.ValidationError`` naming the bad field."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        kw = {k: v for k, v in given.items() if v is not None}
        if self.top_k is not None:
            kw["top_k"] = -1 if self.top_k == 0 else self.top_k
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.wanted_prompt_logprobs(),
            logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()},
            **kw,
        )


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings (one choice per prompt),
    a list of token ids, or a list of token-id lists."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    prompt_embeds: str | list[str] | None = None

    def wanted_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` and ``logprobs`` at least ``logprobs`` (vLLM)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class TextPart(_Strict):
    """A ``{"type": "text", "text": ...}`` content part (the only kind supported)."""

    type: Literal["text"]
    text: str


class FunctionDef(_Strict):
    """A tool's function: ``name`` (letters, digits, ``_`` and ``-``, at most 64), what it does, and
    its arguments' JSON schema (``parameters``; absent: any JSON object). ``strict`` is accepted:
    a forced call always follows the schema here."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    """One entry of ``tools`` (OpenAI's shape; functions are the only kind)."""

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    """The function a named ``tool_choice`` forces."""

    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` ``{"type": "function", "function": {"name": ...}}``: call exactly that tool."""

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Strict):
    """The function of a replayed tool call: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Strict):
    """A tool call of an assistant message replayed by the client (``message.tool_calls[i]``)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    """One chat message; ``developer`` is treated as ``system``. ``refusal`` (an assistant
    message replayed by a client) is accepted and not rendered; ``tool_calls`` (assistant) and
    ``tool_call_id`` (``role: "tool"``, the call it answers) carry tool history, rendered by
    ``server.router.tool_prompt``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined; none: "")."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return content or ""

    def as_template_dict(self) -> dict:
        """``{"role", "content"}`` as the chat template expects (text parts joined)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict | None = None
    # accepted and ignored (see server.router.extensions.IGNORED)
    include_reasoning: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    media_io_kwargs: dict | None = None
    mm_processor_kwargs: dict | None = None
    # tool calling (server.router.tools)
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required" (checked with a clear 400)
    parallel_tool_calls: bool | None = None
    # refused unless default (see server.router.extensions.REFUSED)
    chat_template: str | None = None


class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` with a ``prompt`` (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    """``POST /tokenize`` with ``messages``, rendered as ``/v1/chat/completions`` would (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]
