"""The Hermes tool-call parser: whole outputs and the same outputs cut into stream pieces at every
point (tags split across pieces never leak into content, and the stream agrees with the whole), and
the streamed call deltas: a head with id and name, then argument fragments released as they are
written whose concatenation is the whole answer's ``arguments`` exactly, for every cut."""

from __future__ import annotations

import json
import random

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


@pytest.mark.parametrize(
    "text,content,calls",
    [
        (CALL_F, "", [("get_weather", {"city": "Paris", "days": 2})]),
        ("Let me check.\n" + CALL_F, "Let me check.", [("get_weather", {"city": "Paris", "days": 2})]),
        (CALL_F + "\n" + CALL_G + "\n", "", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
        ('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
        ("no tools here < not a tag <tool", "no tools here < not a tag <tool", []),
        # malformed before the call is known: returned as content, tags and the whitespace before them included
        (
            'Hi\n<tool_call>{"name": "f", "argu: {"a": 1}}</tool_call>',
            'Hi\n<tool_call>{"name": "f", "argu: {"a": 1}}</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
            '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
            [],
        ),
        ('<tool_call>["f", {}]</tool_call>', '<tool_call>["f", {}]</tool_call>', []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            [],
        ),
        # cut by max_tokens before the arguments began: the open block is content
        ('A <tool_call>{"name": "f", "argu', 'A <tool_call>{"name": "f", "argu', []),
        # the name after the arguments, the "parameters" spelling, text after the object dropped
        (
            '<tool_call>{"arguments": {"x": [1, {"y": "}"}]}, "name": "g"}</tool_call>',
            "",
            [("g", {"x": [1, {"y": "}"}]})],
        ),
        ('<tool_call>{"name": "f", "parameters": {"q": "a\\"b"}} </tool_call>', "", [("f", {"q": 'a"b'})]),
        (CALL_G + " then text", "then text", [("get_time", {})]),
    ],
)
def test_whole_output(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content and _shape(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(
    "text",
    [
        CALL_F,
        "Sure thing!\n" + CALL_F + "\n" + CALL_G,
        "plain <tool_ text </tool_call>",
        "x <tool_call>{bad json}</tool_call> y",
    ],
)
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


def test_a_committed_call_keeps_what_was_written():
    """Once the name is known and the arguments object has begun, the block is a call (its fragments
    were streamed): broken JSON or the end of the output leave the arguments as written."""
    content, calls = parse_tool_calls('Hi\n<tool_call>{"name": "f", "arguments": {"a": </tool_call> bye')
    assert content == "Hibye" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": ')]
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": "x</tool_ca')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": "x</tool_ca')]


CALL_H = (
    '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"b\\" {c}", "n": [1, 2.5e3, true, null], '
    '"o": {"k": "v"}}}\n</tool_call>'
)
STREAMED = [
    CALL_F,
    "Sure thing!\n" + CALL_F + "\n" + CALL_G,
    CALL_H + " and " + CALL_G,
    '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>',
    '<tool_call>{"name": "bare"}</tool_call>',
    "x <tool_call>{bad json}</tool_call> y",
    '<tool_call>{"name": "f", "arguments": {"a": "b"',  # cut by max_tokens inside the arguments
]


def _run(text: str, bounds: list[int]) -> tuple[str, list, list]:
    """Feed ``text`` cut at ``bounds`` (0 and len included): (content, calls, deltas)."""
    s, content, deltas = ToolCallStream(), "", []
    for a, b in zip(bounds, bounds[1:]):
        step = s.feed(text[a:b])
        content, deltas = content + step.content, deltas + step.deltas
    step = s.finish()
    return content + step.content, s.calls, deltas + step.deltas


def _check_deltas(deltas, calls) -> None:
    """Each call: one head first (id, name, empty arguments), then fragments only, joined = arguments."""
    assert sorted({d.index for d in deltas}) == list(range(len(calls)))
    for k, call in enumerate(calls):
        mine = [d for d in deltas if d.index == k]
        head, rest = mine[0], mine[1:]
        assert (head.id, head.name, head.arguments) == (call.id, call.name, "")
        assert all(d.id is None and d.name is None and d.arguments for d in rest)
        assert "".join(d.arguments for d in rest) == call.arguments
        assert head.as_delta_json() == {
            "index": k,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }
        assert all(d.as_delta_json() == {"index": k, "function": {"arguments": d.arguments}} for d in rest)


@pytest.mark.parametrize("text", STREAMED)
def test_streamed_arguments_agree_with_the_whole_answer_at_every_cut(text):
    want_content, want_calls = parse_tool_calls(text)
    want = [(c.name, c.arguments) for c in want_calls]
    cuts = [[c] for c in range(1, len(text))] + [list(range(1, len(text)))]
    rng = random.Random(len(text))
    cuts += [sorted(rng.sample(range(1, len(text)), rng.randint(2, 12))) for _ in range(200)]
    for cut in cuts:
        content, calls, deltas = _run(text, [0, *cut, len(text)])
        assert content == want_content and [(c.name, c.arguments) for c in calls] == want, cut
        _check_deltas(deltas, calls)


def test_arguments_stream_as_they_are_written():
    """Fed one character at a time: the head comes out at the arguments' ``{``, before the call
    closes, and every later character of the arguments is released as soon as it is read."""
    s, before_close = ToolCallStream(), []
    text = CALL_F
    close = text.index("</tool_call>")
    for i, ch in enumerate(text):
        step = s.feed(ch)
        if i < close:
            before_close += step.deltas
    args_open = text.index('{"city"')
    assert before_close[0].id is not None and before_close[0].name == "get_weather"
    fragments = [d.arguments for d in before_close[1:]]
    assert "".join(fragments) == '{"city": "Paris", "days": 2}'
    assert len(fragments) == close - args_open - 2  # one per character, up to the "}" (not the outer one, not "\n")
    assert s.calls[0].arguments == '{"city": "Paris", "days": 2}'
