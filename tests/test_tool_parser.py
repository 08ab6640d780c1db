"""The Hermes tool-call parser: whole outputs and the same outputs cut into stream pieces at every
point (tags split across pieces never leak into content, and the stream agrees with the whole)."""
from __future__ import annotations

import json

import pytest

from server.router.tool_parser import ToolCallStream, parse_tool_calls

CALL_F = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL_G = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def _stream(text: str, cuts: list[int]) -> tuple[str, list, list[str]]:
    """Feed ``text`` cut at ``cuts``: (content, calls, the content pieces released)."""
    s, released, bounds = ToolCallStream(), [], [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        released.append(s.feed(text[a:b]).content)
    released.append(s.finish().content)
    return "".join(released), s.calls, released


def _shape(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text,content,calls", [
    (CALL_F, "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("Let me check.\n" + CALL_F, "Let me check.", [("get_weather", {"city": "Paris", "days": 2})]),
    (CALL_F + "\n" + CALL_G + "\n", "", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
    ("no tools here < not a tag <tool", "no tools here < not a tag <tool", []),
    # malformed: returned as content, tags and the whitespace before them included
    ('Hi\n<tool_call>{"name": "f", "arguments": {"a": </tool_call>', 'Hi\n<tool_call>{"name": "f", "arguments": {"a": </tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    # cut by max_tokens: the open block is content
    ('A <tool_call>{"name": "f", "argu', 'A <tool_call>{"name": "f", "argu', []),
    (CALL_G + " then text", "then text", [("get_time", {})]),
])
def test_whole_output(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content and _shape(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("text", [CALL_F, "Sure thing!\n" + CALL_F + "\n" + CALL_G, "plain <tool_ text </tool_call>",
                                  'x <tool_call>{bad json}</tool_call> y'])
def test_every_cut_gives_the_whole_answer(text):
    want_content, want_calls = parse_tool_calls(text)
    for cut in range(1, len(text)):
        content, calls, released = _stream(text, [cut])
        assert content == want_content and _shape(calls) == _shape(want_calls), cut
    content, calls, released = _stream(text, list(range(1, len(text))))  # one character per piece
    assert content == want_content and _shape(calls) == _shape(want_calls)
    if want_calls:  # no piece of a tag is ever released as content
        assert all("<tool" not in r and "tool_call>" not in r for r in released)


def test_text_before_a_tag_streams_before_the_call_ends():
    s = ToolCallStream()
    assert s.feed("The weather").content == "The weather"
    assert s.feed(" now: <tool_").content == " now:"
    step = s.feed('call>{"name": "f", "arguments": {"x": 1}}')
    assert step.content == "" and step.calls == []
    step = s.feed("</tool_call>")
    assert [c.name for c in step.calls] == ["f"] and step.content == ""
    assert s.finish().content == ""
