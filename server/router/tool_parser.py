"""Hermes-style tool calls out of a model's text, whole or as it streams.

A call is ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (whitespace around the JSON
allowed; ``arguments`` an object, or absent for none). ``ToolCallStream.feed(text)`` takes the
output piece by piece and returns what can be shown now: content text (never a piece of a tag: a
suffix that could start ``<tool_call>`` or, inside a block, ``</tool_call>`` is held until the next
piece decides) and ``CallDelta``s, as OpenAI streams ``delta.tool_calls``: a call's first delta
carries its ``id`` and ``name`` (and empty arguments) as soon as the name is known and its arguments
object has begun; later ones carry fragments of the arguments text as the model writes them, whose
concatenation is exactly the call's final ``arguments`` (``server.router.tool_call_scan`` decides
when a block is a call and where its arguments are). ``finish()`` returns what was held. Text
before, between and after calls is content, except whitespace next to a call. A block that shows it
is no call before it is committed (malformed JSON, no name, arguments not an object) and a block
still open at the end without a commit are content, tags included, so nothing the model wrote is
lost; a committed call stays a call even if its JSON breaks or the output ends inside it (its
arguments are then what was written). ``parse_tool_calls(text)`` is the same run over a whole text,
so a non-streamed response and the concatenated stream agree, however the stream was cut.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from server.router.tool_call_scan import CallScanner
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


@dataclass(frozen=True)
class CallDelta:
    """One streamed piece of call ``index`` (0-based, per choice): the head (``id`` and ``name`` set,
    ``arguments`` "") or an arguments fragment (``id`` and ``name`` None)."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def as_delta_json(self) -> dict:
        """The OpenAI ``delta.tool_calls[0]`` object of this piece."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class StreamStep:
    """What one ``feed`` or ``finish`` releases: content text, call deltas, and the calls completed."""

    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)
    calls: list[ParsedCall] = field(default_factory=list)


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _OpenCall:
    """The block being read: its scanner, and once committed its id and the arguments sent."""

    def __init__(self) -> None:
        self.scan = CallScanner()
        self.id: str | None = None
        self.sent = 0  # characters of the arguments already released


class ToolCallStream:
    """Incremental Hermes tool-call parser for one choice (see the module docstring)."""

    def __init__(self) -> None:
        self._buf = ""
        self._call: _OpenCall | None = None  # the open block, if any
        self._after_call = False  # whitespace right after a call is dropped, not shown
        self._gap = ""  # whitespace before the open block: shown only if the block is no call
        self.calls: list[ParsedCall] = []

    def feed(self, text: str) -> StreamStep:
        """Take the next piece of output; returns what can be shown now."""
        self._buf += text
        step = StreamStep()
        while True:
            if self._call is not None:
                end = self._buf.find(CLOSE_TAG)
                if end < 0:
                    inside = len(self._buf) - _held_suffix(self._buf, CLOSE_TAG)
                    self._scan(self._buf[:inside], step)
                    self._buf = self._buf[inside:]
                    return step
                self._scan(self._buf[:end], step)
                self._buf = self._buf[end + len(CLOSE_TAG) :]
                self._close(step, CLOSE_TAG)
                continue
            start = self._buf.find(OPEN_TAG)
            if start >= 0:
                before, self._buf = self._buf[:start], self._buf[start + len(OPEN_TAG) :]
                kept = self._release(before.rstrip())
                step.content += kept
                self._gap = before[len(before.rstrip()) :] if kept or not self._after_call else ""
                self._call = _OpenCall()
                continue
            keep = _held_suffix(self._buf, OPEN_TAG)
            free = self._buf[: len(self._buf) - keep].rstrip()  # trailing whitespace waits: a call may follow
            step.content += self._release(free)
            self._buf = self._buf[len(free) :]
            return step

    def _scan(self, text: str, step: StreamStep) -> None:
        """Feed ``text`` (inside the open block) to its scanner; release the head and new arguments."""
        call = self._call
        call.scan.feed(text)
        if not call.scan.committed:
            return
        if call.id is None:
            call.id = f"call_{uuid.uuid4().hex[:24]}"
            step.deltas.append(CallDelta(len(self.calls), call.id, call.scan.name, ""))
        args = call.scan.arguments()
        if len(args) > call.sent:
            step.deltas.append(CallDelta(len(self.calls), None, None, args[call.sent :]))
            call.sent = len(args)

    def _close(self, step: StreamStep, tail: str) -> None:
        """The open block ended (``tail``: its close tag, or "" at the end of the output)."""
        call, self._call = self._call, None
        if call.scan.committed:
            done = ParsedCall(id=call.id, name=call.scan.name, arguments=call.scan.arguments())
            step.calls.append(done)
            self.calls.append(done)
            self._after_call = True
        else:
            step.content += f"{self._gap}{OPEN_TAG}{call.scan.text}{tail}"
            self._after_call = False

    def _release(self, text: str) -> str:
        """``text`` as content, less the whitespace right after a call."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def finish(self) -> StreamStep:
        """The output ended: release what was held (an open block as its call if committed, else as
        content, tag included)."""
        rest, self._buf = self._buf, ""
        step = StreamStep()
        if self._call is not None:
            self._scan(rest, step)
            self._close(step, "")
            return step
        step.content = self._release(rest)
        return step


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """``(content, calls)`` of a whole output (see the module docstring)."""
    stream = ToolCallStream()
    first, last = stream.feed(text), stream.finish()
    return first.content + last.content, stream.calls
