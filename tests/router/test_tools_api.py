"""Tools at the router, against the scripted fake worker of tests/support/fake_worker.py (no model):
bad tools and tool choices are 400s naming the field (nothing sent); the tools and the tool history
reach the prompt (Hermes block, or the template's own ``tools``); ``required`` and a named tool send
the grammar of one call (checked here with llguidance on the real tokenizer); a scripted tool-call
output comes back as ``tool_calls``, whole and streamed as OpenAI streams them.
(With the real model, PD and colocated: tests/e2e/test_tools_e2e.py.)"""

from __future__ import annotations

import json

import pytest

from engine.grammar import GrammarCompiler
from server.router.openai_schemas import ChatMessage, ToolDef
from server.router.tool_prompt import template_input, template_takes_tools
from server.router.tools import ToolPlan
from tests.support.fake_worker import sse_events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 40, **body})


@pytest.mark.parametrize(
    "body,param,needle",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "unique"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools.0.function.parameters",
            "object",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
                ]
            },
            "tools.0.function.parameters",
            "grammar engine",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "'auto'"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "drop one",
        ),
        ({"messages": [*USER, {"role": "tool", "content": "sunny"}]}, "messages.1.tool_call_id", "tool_call_id"),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
            "JSON object",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(make_client, body, param, needle):
    client, worker, _ = make_client()
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert worker.requests == []


def test_tools_reach_the_prompt_and_none_hides_them(make_client, tokenizer):
    client, worker, _ = make_client()
    for choice in ("auto", "required", "none"):
        r = chat(client, tools=[WEATHER, TIME], tool_choice=choice)
        assert r.status_code == 200, r.text
    auto, required, none = (tokenizer.decode(w[1]) for w in worker.requests)
    assert "<tools>" in auto and '"name": "get_weather"' in auto and '"name": "get_time"' in auto
    assert "<tool_call>" in auto and "Answer with a function call now." in required
    assert "<tools>" not in none and "get_weather" not in none
    assert [w[2].structured is None for w in worker.requests] == [True, False, True]


def test_tool_history_is_rendered(make_client, tokenizer):
    client, worker, _ = make_client()
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no rain"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(worker.requests[0][1])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert (
        "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nno rain\n"
        "</tool_response><|im_end|>"
    ) in prompt


def test_a_template_with_tools_gets_them_itself():
    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{{ m.content }};{% endfor %}"
    )
    assert template_takes_tools(template) and not template_takes_tools("{{ messages }}")
    plan = ToolPlan(tools=(ToolDef.model_validate(WEATHER),), forced=None)
    msgs = [
        ChatMessage.model_validate(m)
        for m in [
            *USER,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "cold"},
        ]
    ]
    messages, variables = template_input(template, msgs, plan)
    assert variables["tools"][0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert messages[2] == {"role": "tool", "content": "cold", "tool_call_id": "c"}


def _accepts(tokenizer, so, text: str) -> bool:
    m = GrammarCompiler(tokenizer.backend_json, tokenizer.vocab_size, tokenizer.eos_token_ids).matcher(so)
    for t in tokenizer.encode(text):
        m.consume(t)
    return m.bitmask() is not None and m._m.is_accepting()


def test_forced_calls_send_the_grammar_of_one_call(make_client, tokenizer):
    client, worker, _ = make_client()
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        r = chat(client, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=8)
        assert r.status_code == 200, r.text
    required, forced = (w[2].structured for w in worker.requests)
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _accepts(tokenizer, required, weather) and _accepts(tokenizer, required, time_call)
    assert not _accepts(tokenizer, required, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}')
    assert not _accepts(tokenizer, required, "Sure, " + weather)
    assert _accepts(tokenizer, forced, time_call) and not _accepts(tokenizer, forced, weather)


def test_tool_call_output_is_parsed(make_client):
    client, _, _ = make_client({"pieces": [CALL_TEXT]})
    r = chat(client, tools=[WEATHER])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    plain = chat(client, tools=[WEATHER], tool_choice="none").json()["choices"][0]  # none: nothing parsed
    assert plain["message"]["content"] == CALL_TEXT and "tool_calls" not in plain["message"]
    assert plain["finish_reason"] == "stop"


def test_tool_call_output_streams_as_openai_does(make_client):
    client, _, _ = make_client({"pieces": [CALL_TEXT]})
    r = chat(client, tools=[WEATHER], stream=True)
    chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking." and "<" not in content
    parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert parts[0]["index"] == 0 and parts[0]["id"].startswith("call_") and parts[0]["type"] == "function"
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all("id" not in p and "name" not in p["function"] for p in parts[1:])
    assert json.loads("".join(p["function"]["arguments"] for p in parts)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_each_streamed_choice_has_its_own_calls(make_client):
    client, worker, _ = make_client({"pieces": ["Hi <tool_", 'call>{"name": "get_time"}</tool_call>']})
    r = chat(client, tools=[WEATHER, TIME], stream=True, n=2, max_tokens=30)
    chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    for index in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(d.get("content") or "" for d in deltas) == "Hi"
        heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
        assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_time")]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls", "tool_calls"]


def test_streamed_arguments_arrive_piecewise_and_match_the_whole_answer(make_client):
    """The output arrives in pieces: the arguments come in several chunks, as the model writes them,
    and their concatenation is exactly the non-streamed answer's ``arguments``."""
    cut = [0, 12, 25, 40, 52, 60, 66, 70, len(CALL_TEXT)]
    client, _, _ = make_client({"pieces": [CALL_TEXT[a:b] for a, b in zip(cut, cut[1:])]})
    whole = chat(client, tools=[WEATHER]).json()["choices"][0]["message"]["tool_calls"][0]["function"]
    r = chat(client, tools=[WEATHER], stream=True)
    chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    parts = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in chunks
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    fragments = [p["function"]["arguments"] for p in parts[1:]]
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""} and len(fragments) >= 3, parts
    assert "".join(fragments) == whole["arguments"] == '{"city": "Paris"}'
