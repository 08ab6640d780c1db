"""Incremental scan of the JSON object inside one ``<tool_call>`` block, for streaming a call's
arguments as the model writes them.

``CallScanner.feed(text)`` takes the block's text piece by piece (text known to be inside the block:
the caller holds back anything that may start the close tag) and walks the top-level object one
character at a time. It learns the call's ``name`` (the string value of key ``name``) and where its
arguments value starts (key ``arguments``, or ``parameters``, whichever comes first). The block is
**committed** as a call at the first character where the name is known and either the arguments
object has begun (its ``{``) or the top-level object has closed without arguments. Before that
point the scan may find that the block is no call (not an object, a name that is not a non-empty
string, arguments that are not an object, broken syntax at the top level): ``rejected`` is then
set and never cleared. After it, nothing un-commits the block: the arguments are the model's text
from their ``{`` to the matching ``}`` (verbatim, so every fragment streamed is final), or what was
written of them when the block or the output ended (then not valid JSON, as OpenAI warns its own
``arguments`` may be); a committed call without arguments has ``"{}"``. The state after a text
depends only on the text, never on how it was cut into pieces.
"""

from __future__ import annotations

import json

_ARG_KEYS = ("arguments", "parameters")
_SCALAR_END = ",}]" + " \t\r\n"


def _string(token: str) -> str | None:
    """The value of a JSON string token, or None if it is not one."""
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


class CallScanner:
    """Scan state of one call block (see the module docstring). Read ``committed``, ``rejected``,
    ``name`` and ``arguments()``; ``text`` is everything fed."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.committed = False
        self.rejected = False
        self._phase = "start"  # start, key, colon, value, after, done
        self._depth = 0
        self._in_str = self._escaped = False
        self._str_start = 0
        self._key: str | None = None
        self._value_start: int | None = None  # start of the depth-1 value being read
        self._args: tuple[int, int | None] | None = None  # (start, end or None while open) in text
        self._scanned = 0  # characters of text scanned

    def feed(self, text: str) -> None:
        """Scan ``text``, the next piece of the block."""
        at = len(self.text)
        self.text += text
        for i in range(at, len(self.text)):
            if self.rejected or self._phase == "done":
                return
            self._step(i, self.text[i])
            self._scanned = i + 1

    def arguments(self) -> str:
        """The arguments written so far ("" before the commit; ``"{}"`` for a committed call without)."""
        if not self.committed:
            return ""
        if self._args is None:
            return "{}"
        start, end = self._args
        return self.text[start : end if end is not None else self._scanned]

    def _step(self, i: int, c: str) -> None:
        if self._in_str:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_str = False
                if self._depth == 1:
                    self._string_ended(i)
            return
        if self._phase == "value" and self._depth == 1 and self._value_start is not None and c in _SCALAR_END:
            self._value_ended(i)  # a number, true, false or null ends here
        if c in " \t\r\n":
            return
        if self._depth > 1:
            self._nested(i, c)
        elif self._phase == "start":
            self._expect(c == "{", "key", depth=1)
        elif self._phase == "key":
            if c == '"':
                self._in_str, self._str_start = True, i
            else:
                self._close_or_reject(c)
        elif self._phase == "colon":
            self._expect(c == ":", "value")
        elif self._phase == "value":
            if self._value_start is None:
                self._value_began(i, c)
        elif self._phase == "after":
            if c == ",":
                self._phase = "key"
            else:
                self._close_or_reject(c)

    def _expect(self, ok: bool, phase: str, depth: int | None = None) -> None:
        if not ok:
            self._reject()
            return
        self._phase = phase
        if depth is not None:
            self._depth = depth

    def _close_or_reject(self, c: str) -> None:
        if c != "}":
            self._reject()
            return
        self._phase, self._depth = "done", 0
        if self.name is None:
            self._reject()
        self._try_commit()

    def _string_ended(self, i: int) -> None:
        if self._phase == "key":
            self._key, self._phase, self._value_start = _string(self.text[self._str_start : i + 1]), "colon", None
            if self._key is None:
                self._reject()
        elif self._phase == "value":
            self._value_ended(i + 1)

    def _value_began(self, i: int, c: str) -> None:
        self._value_start = i
        if self._key in _ARG_KEYS and self._args is None:
            if c != "{":
                self._reject()  # arguments must be an object
                return
            self._args = (i, None)
        if c in "{[":
            self._depth = 2
        elif c == '"':
            self._in_str, self._str_start = True, i
        self._try_commit()

    def _nested(self, i: int, c: str) -> None:
        if c == '"':
            self._in_str = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._value_ended(i + 1)

    def _value_ended(self, end: int) -> None:
        start = self._value_start
        value = self.text[start:end]
        if self._key == "name" and self.name is None:
            name = _string(value)
            if not name:
                self._reject()
                return
            self.name = name
        if self._args is not None and self._args[0] == start and self._args[1] is None:
            self._args = (start, end)
        self._phase, self._value_start = "after", None
        self._try_commit()

    def _try_commit(self) -> None:
        if (
            not self.committed
            and not self.rejected
            and self.name is not None
            and (self._args is not None or self._phase == "done")
        ):
            self.committed = True

    def _reject(self) -> None:
        if not self.committed:
            self.rejected = True
        self._phase = "done"  # a committed call keeps what it has; nothing after this is read
