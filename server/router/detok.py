"""Incremental output text with stop strings.

``TextStream`` turns streamed token ids into text deltas. Stop strings are matched on the
detokenized text, across token boundaries: the last ``max(len(stop)) - 1`` characters are held
back until more text shows they cannot start a stop string (or the stream ends). When a stop
string appears, the text is cut before it (after it with ``include_stop``, vLLM's
``include_stop_str_in_output``) and the stream reports ``stopped``.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """Text of one generated sequence, released incrementally.

    Contract: the concatenation of every string returned by :meth:`push` and :meth:`finish`
    equals the full decoded output, cut before the earliest stop string if one occurs (after it
    with ``include_stop``). After a stop string is seen (``stopped`` is True) further pushes return ''.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        """Start an empty stream; empty stop strings are ignored."""
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._include = include_stop
        self._stops = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, ids: Iterable[int]) -> str:
        """Feed new token ids; return the text that is now safe to release."""
        if self.stopped:
            return ""
        self.text += self._detok.feed(ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of stream: return everything not yet released (cut at a stop string)."""
        if not self.stopped:
            self.text += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = self._find_stop()
        if cut is not None:
            self.text, self.stopped, final = self.text[:cut], True, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self._hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def _find_stop(self) -> int | None:
        """Where the text ends at the earliest stop string at or after the released text: its start,
        or its end with ``include_stop`` (see module doc)."""
        hits = [
            (i, i + len(s) if self._include else i) for s in self._stops if (i := self.text.find(s, self.sent)) >= 0
        ]
        return min(hits)[1] if hits else None
