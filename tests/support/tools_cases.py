"""The end-to-end tool-call cases, shared by the colocated server (tests/clients/test_openai_table.py)
and the PD one (tests/e2e/test_tools_e2e.py): the real model through the official ``openai`` client,
unmodified. ``required`` (greedy) and a named tool (sampled, seeded), whole and streamed (the
same call both ways; the stream's arguments arrive in several fragments and are put together by
the SDK's own stream accumulator): every answer is
exactly one call of an allowed tool whose arguments validate against its schema, and the call
replayed with its result is accepted."""

from __future__ import annotations

import json

import jsonschema
from openai.lib.streaming.chat import ChatCompletionStreamState

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_ARGS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 32}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_ARGS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME_ARGS},
    },
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def _streamed(client, **kw) -> tuple[str, list[dict], str]:
    """(content, calls as {id, name, arguments, fragments}, finish reason) of a streamed answer, put
    together from ``delta.tool_calls`` by the ``openai`` SDK's own accumulator
    (``ChatCompletionStreamState``, what ``client.chat.completions.stream`` uses); checks that each
    call's first delta carries id, type and name and the later ones only index and arguments, and
    counts the argument fragments."""
    state, heads, fragments = ChatCompletionStreamState(), {}, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        for c in chunk.choices:
            for part in c.delta.tool_calls or []:
                if part.index not in heads:
                    heads[part.index] = part
                    assert part.id and part.type == "function" and part.function.name, part
                else:
                    assert part.id is None and part.function.name is None and part.function.arguments, part
                    fragments[part.index] = fragments.get(part.index, 0) + 1
    choice = state.get_final_completion().choices[0]
    calls = [
        {"id": t.id, "name": t.function.name, "arguments": t.function.arguments, "fragments": fragments.get(k, 0)}
        for k, t in enumerate(choice.message.tool_calls or [])
    ]
    return choice.message.content or "", calls, choice.finish_reason


def _valid(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def check_forced_tool_calls(client) -> None:
    """Run every case against ``client`` (an ``openai.OpenAI`` on a launched server)."""
    model = client.models.list().data[0].id
    cases = [("required", 0, None), (NAMED, 1.0, 3)]  # greedy, and sampled with a seed: both reproducible
    first = None
    for choice, temperature, seed in cases:
        kw = dict(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=48,
            temperature=temperature,
            seed=seed,
        )
        allowed = set(SCHEMAS) if choice == "required" else {"get_time"}
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", (msg.content, r.choices[0].finish_reason)
        assert len(msg.tool_calls) == 1 and not msg.content, msg
        call = msg.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        _valid(call.function.name, call.function.arguments, allowed)
        content, calls, finish = _streamed(client, **kw)
        assert finish == "tool_calls" and content == "" and len(calls) == 1, (content, calls, finish)
        _valid(calls[0]["name"], calls[0]["arguments"], allowed)
        assert calls[0]["id"].startswith("call_") and calls[0]["fragments"] > 1, calls  # streamed piecewise
        assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
        first = first or msg
    # the call replayed with its result (the client's own message object) is rendered and answered
    reply = client.chat.completions.create(
        model=model,
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
        messages=[*ASK, first, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, sunny"}],
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls") and reply.usage.completion_tokens > 0
