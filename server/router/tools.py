"""A chat request's tools and ``tool_choice``, checked, and the constraint that enforces a forced call.

``tool_plan(req)`` returns the ``ToolPlan`` of a ``/v1/chat/completions`` request, or None when no
tool may be called (no ``tools``, or ``tool_choice`` "none"). A 400 ``APIError`` names the field when
a tool's ``parameters`` is not a JSON schema the grammar engine takes, two tools share a name,
``tool_choice`` names a tool not in ``tools`` or forces a call without ``tools``, or a forced call
meets another output constraint (``response_format`` and its vLLM cousins).

``ToolPlan.constraint()`` is the grammar (llguidance Lark, ``StructuredOutput`` kind "grammar") of
one Hermes-style call, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, whose
name is one of the allowed tools and whose arguments match that tool's ``parameters``: set for
``required`` (any tool) and a named tool (that one), None for ``auto`` (the output is free and parsed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.grammar_spec import check
from server.router.errors import APIError
from server.router.openai_schemas import ChatCompletionRequest, ToolDef
from transfer.wire.sampling_params import StructuredOutput

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """The tools a request may call. ``forced``: "required" (one call of any tool), a tool's name
    (one call of that tool) or None (``auto``: the model chooses, its output is parsed)."""

    tools: tuple[ToolDef, ...]
    forced: str | None

    def allowed(self) -> tuple[ToolDef, ...]:
        """The tools a forced call may name (all of them unless one is named)."""
        if self.forced in (None, "required"):
            return self.tools
        return tuple(t for t in self.tools if t.function.name == self.forced)

    def constraint(self) -> StructuredOutput | None:
        """The grammar of one call of an allowed tool, or None for ``auto``."""
        if self.forced is None:
            return None
        variants = [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or _ANY_OBJECT},
            }
            for t in self.allowed()
        ]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        lark = (
            f"start: {json.dumps(OPEN_TAG + chr(10))} call {json.dumps(chr(10) + CLOSE_TAG)}\n"
            f"call: %json {json.dumps(schema)}\n"
        )
        return StructuredOutput(kind="grammar", spec=lark)


def _check_tools(tools: list[ToolDef]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise APIError(
                400,
                f"tools[{i}].function.name {fn.name!r} is used by an earlier tool; tool names must be unique",
                param=f"tools.{i}.function.name",
            )
        seen.add(fn.name)
        if fn.parameters is None:
            continue
        param = f"tools.{i}.function.parameters"
        if fn.parameters.get("type", "object") != "object":
            raise APIError(
                400,
                f'{param} must be a JSON schema of an object ("type": "object"), got type '
                f"{fn.parameters.get('type')!r}",
                param=param,
            )
        try:
            error = check(StructuredOutput(kind="json", spec=json.dumps(fn.parameters)))
        except ModuleNotFoundError as e:
            raise APIError(400, f"tools cannot be checked here: {e}", param=param) from None
        if error:
            raise APIError(400, f"{param} is not a JSON schema the grammar engine takes: {error}", param=param)


def _other_constraint(req: ChatCompletionRequest) -> str | None:
    for name in (
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ):
        value = getattr(req, name)
        if value is not None and not (name == "response_format" and value.get("type") == "text"):
            return name
    return None


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """The checked ``ToolPlan`` of ``req`` or None (see the module docstring)."""
    choice = req.tool_choice
    tools = req.tools or []
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise APIError(
            400,
            f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
            f'"function": {{"name": ...}}}}, got {choice!r}',
            param="tool_choice",
        )
    if not isinstance(choice, str) and choice is not None:
        name = choice.function.name
        if name not in {t.function.name for t in tools}:
            given = ", ".join(t.function.name for t in tools) or "none"
            raise APIError(
                400, f"tool_choice names function {name!r}, which is not in tools (given: {given})", param="tool_choice"
            )
        forced: str | None = name
    elif choice == "required":
        if not tools:
            raise APIError(400, 'tool_choice "required" needs at least one tool in tools', param="tool_choice")
        forced = "required"
    else:
        forced = None
    _check_tools(tools)
    if not tools or choice == "none":
        return None
    other = _other_constraint(req)
    if forced is not None and other:
        raise APIError(
            400,
            f"tool_choice {forced!r} forces a tool call, which cannot also follow {other}; drop one of them",
            param=other,
        )
    plan = ToolPlan(tools=tuple(tools), forced=forced)
    constraint = plan.constraint()
    if constraint is not None:
        try:
            error = check(constraint)
        except ModuleNotFoundError as e:
            raise APIError(400, f"tool_choice {forced!r} cannot be enforced here: {e}", param="tool_choice") from None
        if error:
            raise APIError(
                400,
                f"tool_choice {forced!r}: the grammar engine refuses the call's grammar: {error}",
                param="tool_choice",
            )
    return plan
