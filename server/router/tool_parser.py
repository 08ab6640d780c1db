"""Hermes-style tool calls out of a model's text, whole or as it streams.

A call is ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (whitespace around the JSON
allowed; ``arguments`` an object, or absent for none). ``ToolCallStream.feed(text)`` takes the
output piece by piece and returns what can be shown now: content text (never a piece of a tag: a
suffix that could start ``<tool_call>`` is held until the next piece decides) and the calls
completed in it; ``finish()`` returns what was held. Text before, between and after calls is
content, except whitespace next to a call. A block whose JSON is not a call (malformed JSON, no
name, arguments not an object) and a block still open at the end are content, tags included, so
nothing the model wrote is lost. ``parse_tool_calls(text)`` is the same run over a whole text, so a
non-streamed response and the concatenated stream agree.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from server.router.tools import CLOSE_TAG, OPEN_TAG


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: ``id`` (``call_<hex>``), the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def as_message_json(self) -> dict:
        """The OpenAI ``message.tool_calls[i]`` object."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamStep:
    """What one ``feed`` or ``finish`` releases: content text and the calls completed."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def _call_of(block: str) -> ParsedCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=obj["name"],
                      arguments=json.dumps(args, ensure_ascii=False))


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallStream:
    """Incremental Hermes tool-call parser for one choice (see the module docstring)."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._after_call = False  # whitespace right after a call is dropped, not shown
        self._gap = ""  # whitespace before the open block: shown only if the block is no call
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> StreamStep:
        """Take the next piece of output; returns what can be shown now."""
        self._buf += text
        step = StreamStep()
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE_TAG)
                if end < 0:
                    return step
                block, self._buf = self._buf[:end], self._buf[end + len(CLOSE_TAG):]
                self._in_call = False
                call = _call_of(block)
                if call is None:
                    step.content += f"{self._gap}{OPEN_TAG}{block}{CLOSE_TAG}"
                    self._after_call = False
                else:
                    step.calls.append(call)
                    self.calls.append(call)
                    self._after_call = True
                continue
            start = self._buf.find(OPEN_TAG)
            if start >= 0:
                before, self._buf = self._buf[:start], self._buf[start + len(OPEN_TAG):]
                kept = self._release(before.rstrip())
                step.content += kept
                self._gap = before[len(before.rstrip()):] if kept or not self._after_call else ""
                self._in_call = True
                continue
            keep = _held_suffix(self._buf, OPEN_TAG)
            free = self._buf[:len(self._buf) - keep].rstrip()  # trailing whitespace waits: a call may follow
            step.content += self._release(free)
            self._buf = self._buf[len(free):]
            return step

    def _release(self, text: str) -> str:
        """``text`` as content, less the whitespace right after a call."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def finish(self) -> StreamStep:
        """The output ended: release what was held (an open block as content, tag included)."""
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return StreamStep(content=f"{self._gap}{OPEN_TAG}{rest}")
        return StreamStep(content=self._release(rest))


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """``(content, calls)`` of a whole output (see the module docstring)."""
    stream = ToolCallStream()
    first, last = stream.feed(text), stream.finish()
    return first.content + last.content, stream.calls
