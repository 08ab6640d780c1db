"""Chat messages and tools as the chat template receives them.

``template_input(template, messages, plan)`` returns ``(messages, variables)`` for
``Tokenizer.apply_chat_template``:

- a template that reads a ``tools`` variable (Qwen2.5's, Hermes 2 Pro's) gets the tools in it
  (OpenAI's shape) and the history as such templates expect it: assistant ``tool_calls`` with
  ``arguments`` parsed to objects, ``role: "tool"`` messages with their ``tool_call_id``;
- any other template (SmolLM2's) gets plain ``{"role", "content"}`` messages: the tools are listed
  in the system message between ``<tools></tools>`` with the Hermes instruction to answer
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; a replayed call becomes such a
  block in the assistant's content, and a tool result a user message
  ``<tool_response>...</tool_response>`` (consecutive results share one message).

Without a plan (no tools, or ``tool_choice`` "none") no tool is shown, history is still rendered.
"""

from __future__ import annotations

import json
from functools import lru_cache

from server.router.errors import APIError
from server.router.openai_schemas import ChatMessage
from server.router.tools import CLOSE_TAG, OPEN_TAG, ToolPlan

_INSTRUCTION = (
    "You may call functions, listed in <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call one, write its name and arguments as JSON between <tool_call></tool_call> tags:\n"
    f'{OPEN_TAG}\n{{{{"name": <function name>, "arguments": <arguments object>}}}}\n{CLOSE_TAG}'
)
_FORCED = {"required": "Answer with a function call now.", "named": "Answer with a call of the function {name} now."}


@lru_cache(maxsize=8)
def template_takes_tools(template: str | None) -> bool:
    """Whether the Jinja ``template`` reads a ``tools`` variable (False for none or one that fails to parse)."""
    if not template:
        return False
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return "tools" in meta.find_undeclared_variables(Environment().parse(template))
    except TemplateSyntaxError:
        return False


def _arguments(i: int, j: int, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(
            400,
            f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object as text, got {text[:60]!r}",
            param=f"messages.{i}.tool_calls.{j}.function.arguments",
        )
    return value


def _call_block(name: str, arguments: dict) -> str:
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE_TAG}"


def _check_history(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise APIError(
                400,
                f"messages[{i}].tool_calls is only allowed on assistant messages, not {m.role}",
                param=f"messages.{i}.tool_calls",
            )
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(
                400,
                f"messages[{i}] (role tool) needs tool_call_id, the id of the call it answers",
                param=f"messages.{i}.tool_call_id",
            )


def _native(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        d = m.as_template_dict()
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(i, j, c.function.arguments)},
                }
                for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        out.append(d)
    return out


def _hermes(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        d = m.as_template_dict()
        if m.tool_calls:
            blocks = [
                _call_block(c.function.name, _arguments(i, j, c.function.arguments)) for j, c in enumerate(m.tool_calls)
            ]
            d["content"] = "\n".join(([d["content"]] if d["content"] else []) + blocks)
        if m.role == "tool":
            response = f"<tool_response>\n{d['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + response
                continue
            d = {"role": "user", "content": response, "tool_results": True}
        out.append(d)
    out = [{"role": d["role"], "content": d["content"]} for d in out]
    if plan is None:
        return out
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in plan.tools)
    text = _INSTRUCTION.format(tools=listed)
    if plan.forced == "required":
        text += "\n" + _FORCED["required"]
    elif plan.forced is not None:
        text += "\n" + _FORCED["named"].format(name=plan.forced)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def template_input(template: str | None, messages: list[ChatMessage], plan: ToolPlan | None) -> tuple[list[dict], dict]:
    """``(messages, template variables)`` for the chat template (see the module docstring); 400
    ``APIError`` naming the message of a malformed tool call or tool result."""
    _check_history(messages)
    if template_takes_tools(template):
        tools = [t.model_dump(exclude_none=True) for t in plan.tools] if plan else None
        return _native(messages), ({"tools": tools} if tools else {})
    return _hermes(messages, plan), {}
