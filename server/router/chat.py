"""``POST /v1/chat/completions``: messages rendered with the model's chat template.

Streaming sends, per choice, a role delta first (``{"role": "assistant", "content": ""}``), then
content deltas, then a chunk with an empty delta and the finish reason, then (with
``stream_options.include_usage``) one chunk with ``usage`` and no choices. vLLM's template
extensions are honoured: ``add_generation_prompt``, ``continue_final_message`` (the reply continues
the last message), ``documents`` and ``chat_template_kwargs`` (template variables), and ``echo``
(the reply starts with the last message's content when that message is the assistant's).

Tools (``tools``, ``tool_choice``; ``server.router.tools``): the tools are rendered into the prompt
(``server.router.tool_prompt``); ``required`` and a named tool constrain the output to one call with
the grammar engine; unless ``tool_choice`` is "none", every choice's output is parsed
(``server.router.tool_parser``): calls go to ``message.tool_calls`` (streamed: ``delta.tool_calls``,
a chunk with the call's index, id, type and name and empty arguments as soon as the name is known,
then chunks with only the index and fragments of the arguments as the model writes them, whose
concatenation is the non-streamed ``arguments``), the rest is content, and a finish by stop after a
call is reported as ``"tool_calls"``.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from server.router.choices import ChoiceRun, Piece
from server.router.common import (
    check_common,
    check_max_tokens,
    new_runs,
    now_s,
    response_id,
    sampling_params,
    stream_usage,
    token_label,
    truncate_prompt,
    usage,
)
from server.router.context import RouterContext
from server.router.errors import APIError
from server.router.http_util import parse_model
from server.router.openai_schemas import ChatCompletionRequest
from server.router.parallel import check_n
from server.router.prompt_logprobs import prompt_logprobs_json
from server.router.serving import serve_choices
from server.router.tool_parser import CallDelta, ParsedCall, ToolCallStream, parse_tool_calls
from server.router.tool_prompt import template_input
from server.router.tools import ToolPlan, tool_plan


def render_text(ctx: RouterContext, req, plan: ToolPlan | None = None) -> str:
    """The messages of ``req`` (a chat or chat-tokenize request) rendered with the chat template,
    with ``plan``'s tools; 400 ``APIError`` if the template fails or the options contradict each other."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true; set "
            "add_generation_prompt to false to continue the last message",
            param="continue_final_message",
        )
    messages, tool_vars = template_input(ctx.tokenizer.chat_template, req.messages, plan)
    extra = {**(req.chat_template_kwargs or {}), **({"documents": req.documents} if req.documents else {}), **tool_vars}
    try:
        text = ctx.tokenizer.apply_chat_template(messages, req.add_generation_prompt, extra)
    except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError) as e:  # bad template kwargs
        raise APIError(400, str(e), param="messages") from None
    if req.continue_final_message:  # cut what the template writes after the last message's content
        last = messages[-1]["content"]
        at = text.rfind(last) if last else -1
        if at < 0:
            raise APIError(
                400,
                "continue_final_message: the last message's content was not found in the rendered prompt",
                param="continue_final_message",
            )
        text = text[: at + len(last)]
    return text


def render_prompt(ctx: RouterContext, req: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
    """Token ids of the rendered messages (special tokens added only if ``add_special_tokens``)."""
    return ctx.tokenizer.encode(render_text(ctx, req, plan), add_special_tokens=req.add_special_tokens)


def _max_tokens(req: ChatCompletionRequest) -> tuple[int | None, str]:
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    check_max_tokens(req.max_tokens, "max_tokens")
    if req.max_completion_tokens is not None:
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def _logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


async def create_chat_completion(ctx: RouterContext, request: Request, body: dict) -> Response:
    """Handle one chat completions request (body read and parsed as a JSON object); raises ``APIError`` on refusal."""
    arrival = time.monotonic()
    req = parse_model(ChatCompletionRequest, body)
    check_common(ctx, req)
    max_tokens, name = _max_tokens(req)
    params = sampling_params(req, max_tokens, _logprobs(req), name)
    plan = tool_plan(req)
    forced = plan.constraint() if plan else None
    if forced is not None:
        params = params.model_copy(update={"structured": forced})
    n, _ = check_n(req.n, None, req.stream)
    runs = new_runs(
        ctx, 0, n, truncate_prompt(ctx, render_prompt(ctx, req, plan), req), params, req, max_tokens is None, arrival
    )
    return await serve_choices(
        ctx,
        request,
        runs,
        req.stream,
        ChatFormat(ctx, req, plan is not None),
        stream_usage(req)[0],
        priority=req.priority,
    )


def _finish_reason(reason: str | None, calls: list[ParsedCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


class ChatFormat:
    """OpenAI chat completion response and ``chat.completion.chunk`` chunks."""

    def __init__(self, ctx: RouterContext, req: ChatCompletionRequest, parse_tools: bool = False) -> None:
        self.ctx, self.req = ctx, req
        self.parse_tools = parse_tools
        self._streams: dict[int, ToolCallStream] = {}  # choice index -> its tool-call parser (streaming)
        self.id, self.created = response_id("chatcmpl", req.request_id), now_s()
        last = req.messages[-1]
        self.echo = last.as_template_dict()["content"] if req.echo and last.role == "assistant" else ""

    def _base(self, choices: list[dict], obj: str = "chat.completion.chunk") -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.model_name, "choices": choices}

    def _entry(self, token_id: int, logprob: float | None) -> dict:
        text = token_label(self.ctx.tokenizer, token_id, self.req.return_tokens_as_token_ids)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _logprobs(self, ids, logprobs, tops) -> dict | None:
        if not self.req.logprobs:
            return None
        content = []
        for tid, lp, alts in zip(ids, logprobs, tops):
            content.append({**self._entry(tid, lp), "top_logprobs": [self._entry(i, v) for i, v in alts or []]})
        return {"content": content}

    def full(self, runs: list[ChoiceRun]) -> dict:
        """The complete ``chat.completion`` response."""
        choices = []
        for r in runs:
            message, reason = {"role": "assistant", "content": self.echo + r.text}, r.finish_reason
            if self.parse_tools:
                content, calls = parse_tool_calls(r.text)
                if calls:
                    message = {
                        "role": "assistant",
                        "content": (self.echo + content) or None,
                        "tool_calls": [c.as_message_json() for c in calls],
                    }
                    reason = _finish_reason(reason, calls)
            c = {
                "index": r.index,
                "message": message,
                "logprobs": self._logprobs(r.token_ids, r.logprobs, r.top_logprobs),
                "finish_reason": reason,
            }
            if self.req.return_token_ids:
                c.update(prompt_token_ids=r.session.prompt_ids, token_ids=r.token_ids)
            choices.append(c)
        out = {**self._base(choices, "chat.completion"), "usage": usage(runs)}
        if self.req.prompt_logprobs is not None:  # vLLM: one list for the (shared) prompt, top level
            out["prompt_logprobs"] = prompt_logprobs_json(self.ctx.tokenizer, runs[0])
        return out

    def opening(self, runs: list[ChoiceRun]) -> list[dict]:
        """The role delta of each choice (with prompt token ids if asked for)."""
        out = []
        for r in runs:
            c = {
                "index": r.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if self.req.return_token_ids:
                c["prompt_token_ids"] = r.session.prompt_ids
            chunk = self._base([c])
            if self.req.prompt_logprobs is not None and not out:
                chunk["prompt_logprobs"] = prompt_logprobs_json(self.ctx.tokenizer, r)
            out.append(chunk)
            if self.echo:
                out.append(
                    self._base(
                        [{"index": r.index, "delta": {"content": self.echo}, "logprobs": None, "finish_reason": None}]
                    )
                )
        return out

    def chunks(self, run: ChoiceRun, piece: Piece) -> list[dict]:
        """A content delta (if there is text or tokens to show), then the finish chunk on the last piece."""
        out = []
        text, deltas = piece.text, []
        if self.parse_tools:
            stream = self._streams.setdefault(run.index, ToolCallStream())
            step = stream.feed(piece.text)
            if piece.finish_reason:
                last = stream.finish()
                step.content, step.deltas = step.content + last.content, step.deltas + last.deltas
            text, deltas = step.content, step.deltas
        wants_tokens = self.req.logprobs or self.req.return_token_ids
        if text or (wants_tokens and piece.ids):
            c = {
                "index": run.index,
                "delta": {"content": text},
                "logprobs": self._logprobs(piece.ids, piece.logprobs, piece.top_logprobs),
                "finish_reason": None,
            }
            if self.req.return_token_ids:
                c["token_ids"] = piece.ids
            out.append(self._base([c]))
        out.extend(self._call_chunk(run.index, d) for d in deltas)
        if piece.finish_reason:
            reason = piece.finish_reason
            if self.parse_tools:
                reason = _finish_reason(reason, self._streams[run.index].calls)
            out.append(self._base([{"index": run.index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
        return out

    def _call_chunk(self, index: int, delta: CallDelta) -> dict:
        """The ``delta.tool_calls`` chunk of one piece of a call of choice ``index``."""
        return self._base(
            [
                {
                    "index": index,
                    "delta": {"tool_calls": [delta.as_delta_json()]},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def closing(self, runs: list[ChoiceRun]) -> list[dict]:
        """The usage chunk when ``stream_options.include_usage``."""
        if not stream_usage(self.req)[1]:
            return []
        return [{**self._base([]), "usage": usage(runs)}]
