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
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` and no choices;
    ``continuous_usage_stats`` (vLLM) adds, with ``include_usage``, the usage so far to every chunk."""

    include_usage: bool | None = False
    """A last chunk carries `usage` and no choices."""
    continuous_usage_stats: bool | None = False
    """vLLM: with `include_usage`, every chunk carries its choice's usage so far."""

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
    """The served model's name (404 otherwise), or absent."""
    n: int | None = 1
    """Choices per prompt, 1..64, streamed with their index; choice i is seeded `seed + i` (vLLM)."""
    stream: bool = False
    """Answer as server-sent events, `data: [DONE]` last."""
    stream_options: StreamOptions | None = None
    """Streaming options (`include_usage`, `continuous_usage_stats`); only with `stream: true`."""
    stop: str | list[str] | None = None
    """Stop strings, matched across token boundaries; not part of the text."""
    temperature: float | None = None
    """Sampling temperature; 0 = greedy."""
    top_p: float | None = None
    """Nucleus sampling: the smallest set of tokens whose probabilities reach this sum."""
    top_k: int | None = None
    """vLLM: sample among the k most likely tokens; 0 or -1 = off."""
    min_p: float | None = None
    """vLLM: drop tokens below this fraction of the most likely token's probability."""
    seed: int | None = None
    """Seed of this request's sampling: reproducible per (seed, prompt, parameters) in both modes."""
    presence_penalty: float | None = None
    """Subtracted from the logit of every token already in the output."""
    frequency_penalty: float | None = None
    """Subtracted from a token's logit once per time it is already in the output."""
    repetition_penalty: float | None = None
    """vLLM: divides the positive logits (multiplies the negative) of tokens seen in prompt or output."""
    stop_token_ids: list[int] | None = None
    """vLLM: token ids that end the output; the stop token counts in usage, shows in ids and logprobs, not in text."""
    ignore_eos: bool = False
    """vLLM: keep generating past the end-of-sequence token (up to `max_tokens`)."""
    skip_special_tokens: bool = True
    """vLLM: leave special tokens out of the text."""
    return_token_ids: bool = False
    """vLLM: `prompt_token_ids` / `token_ids` per choice (first chunk / each chunk when streaming)."""
    logit_bias: dict[str, float] | None = None
    """Token id (a string) -> bias in [-100, 100] added to its logit."""
    # vLLM extensions, supported
    include_stop_str_in_output: bool = False
    """vLLM: the text keeps the stop string (and a stop token's text)."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """vLLM: keep k prompt tokens (-1: the context length); `truncation_side` picks which."""
    truncation_side: Literal["left", "right"] | None = None
    """vLLM: `left` (the default: keep the last k prompt tokens) or `right` (keep the first k)."""
    request_id: str | None = Field(None, min_length=1, max_length=256)
    """vLLM: the response id becomes `cmpl-<request_id>` / `chatcmpl-<request_id>`."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM: logprobs name tokens `token_id:<id>`."""
    # accepted and ignored (see server.router.extensions.IGNORED)
    user: str | None = None
    """An end-user id for abuse monitoring."""
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
    """Tags for stored completions."""
    store: bool | None = None
    """Store the completion for later retrieval."""
    spaces_between_special_tokens: bool = True
    """vLLM: put spaces between special tokens in the text."""
    length_penalty: float = 1.0
    """vLLM: beam search's length penalty."""
    session_id: str | None = None
    """A client's conversation id."""
    stream_interval: int | None = Field(None, ge=1)
    """vLLM: tokens per streamed chunk."""
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    """vLLM: arguments for custom logits processors."""
    thinking_token_budget: int | None = None
    """vLLM: the most tokens a reasoning model may think for."""
    # refused unless default (see server.router.extensions.REFUSED)
    min_tokens: int = 0
    """vLLM: the fewest tokens to generate before a stop may end the output."""
    use_beam_search: bool = False
    """vLLM: beam search instead of sampling."""
    watermarking: bool | None = None
    """vLLM: watermark the output."""
    allowed_token_ids: list[int] | None = None
    """vLLM: sample only among these token ids."""
    bad_words: list[str] | None = None
    """vLLM: words the output may not contain."""
    prompt_logprobs: int | None = None
    """vLLM: k in 0..20; per prompt token `null` (the first) or its logprob with the top k (prefill computes it)."""
    logprob_token_ids: list[int] | None = None
    """vLLM: token ids whose logprobs to return at every step."""
    cache_salt: str | None = None
    """vLLM: a salt that partitions the prefix cache between tenants."""
    kv_transfer_params: dict | None = None
    """vLLM: parameters of an external KV connector."""
    ec_transfer_params: dict | None = None
    """vLLM: parameters of an encoder-cache connector."""
    repetition_detection: dict | None = None
    """vLLM: stop when the output starts repeating itself."""
    response_format: dict | None = None
    """`text`, `json_object` or `json_schema` (`{"json_schema": {"name", "schema"}}`): the output follows it."""
    structured_outputs: dict | None = None
    """vLLM: exactly one of `json`, `regex`, `choice`, `grammar` (Lark, llguidance's dialect), `json_object`."""
    guided_json: str | dict | None = None
    """vLLM's older name: the output follows this JSON schema (an object or its text)."""
    guided_regex: str | None = None
    """vLLM's older name: the whole output matches this regex."""
    guided_choice: list[str] | None = None
    """vLLM's older name: the output is one of these strings."""
    guided_grammar: str | None = None
    """vLLM's older name: the output follows this Lark grammar (llguidance's dialect; not GBNF)."""
    logits_processors: list | None = None
    """vLLM: custom logits processors to load for this request."""

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
    """Text, texts (one choice each), token ids, or lists of token ids."""
    max_tokens: int | None = 16
    """The most tokens to generate; 0 only with `echo` (the prompt's logprobs alone)."""
    logprobs: int | None = None
    """k: per output token its logprob and the k best (vLLM: the sampled token too)."""
    echo: bool = False
    """The prompt's text leads the completion; with `logprobs`, its tokens lead the logprobs (the first `null`)."""
    best_of: int | None = None
    """n..64 sequences, the `n` with the highest cumulative logprob returned; cannot stream when above `n`."""
    suffix: str | None = None
    """Text after the completion (fill-in-the-middle)."""
    add_special_tokens: bool = True
    """vLLM: the tokenizer adds the model's special tokens (BOS) to the prompt."""
    prompt_embeds: str | list[str] | None = None
    """vLLM: the prompt as embeddings (base64 tensors)."""

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
    """Roles system/developer/user/assistant/tool, text content or text parts, tool calls and results."""
    max_tokens: int | None = None
    """The most tokens to generate; absent: what the context leaves."""
    max_completion_tokens: int | None = None
    """The most tokens to generate; wins over `max_tokens`."""
    logprobs: bool = False
    """Return each output token's logprob."""
    top_logprobs: int | None = None
    """With `logprobs: true`: the k best tokens at each step too."""
    echo: bool = False
    """vLLM: the reply starts with the last message's content if it is the assistant's."""
    add_generation_prompt: bool = True
    """vLLM: passed to the chat template (open an assistant turn)."""
    continue_final_message: bool = False
    """vLLM: the reply continues the last message (needs `add_generation_prompt: false`)."""
    add_special_tokens: bool = False
    """vLLM: the tokenizer adds special tokens too (the template already writes them)."""
    documents: list[dict[str, str]] | None = None
    """vLLM: a chat template variable (templates that do not use it ignore it)."""
    chat_template_kwargs: dict | None = None
    """vLLM: extra chat template variables."""
    # accepted and ignored (see server.router.extensions.IGNORED)
    include_reasoning: bool = True
    """vLLM: return a reasoning model's reasoning separately."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """How long a reasoning model may think."""
    media_io_kwargs: dict | None = None
    """vLLM: options of image, audio and video loading."""
    mm_processor_kwargs: dict | None = None
    """vLLM: options of the multimodal processor."""
    # tool calling (server.router.tools)
    tools: list[ToolDef] | None = None
    """Functions the model may call (OpenAI's shape), rendered into the prompt; calls are parsed from the output."""
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required" (checked with a clear 400)
    """`auto`, `none`, `required`, or `{"type": "function", "function": {"name"}}` (that tool, forced)."""
    parallel_tool_calls: bool | None = None
    """Whether the model may call several tools in one reply."""
    # refused unless default (see server.router.extensions.REFUSED)
    chat_template: str | None = None
    """vLLM: a chat template to use instead of the model's."""


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
