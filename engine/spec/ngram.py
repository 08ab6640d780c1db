"""N-gram lookup drafter over one request's own tokens (prompt + output).

``NgramIndex`` proposes the tokens that followed the most recent earlier occurrence of the
sequence's longest suffix of length in ``[n_min, n_max]`` (longest first), as an overlapping copy
(a match ``p`` tokens back drafts the period-``p`` continuation). The index is
incremental: ``extend`` costs ``O(n_max - n_min + 1)`` dictionary writes per token and
``propose`` ``O((n_max - n_min + 1) * n_max + k)``, independent of the sequence's length, so a
decode step pays for its new tokens only.

Invariant: for every n in range and every position ``i < len(tokens)`` with ``i >= n``, the entry
for the n-gram ``tokens[i - n : i]`` holds the largest such ``i`` (the index of the token that
followed it), so a lookup of the current suffix finds an occurrence whose follower is known and
never the suffix itself.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """Incremental n-gram -> next-position index over a growing token sequence."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest use

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: Iterable[int]) -> None:
        """Append tokens; each one makes the n-grams ending just before it point at it."""
        toks, last = self.tokens, self._last
        for t in new_tokens:
            i = len(toks)  # t's index: the n-grams ending at i - 1 are followed by t
            toks.append(t)
            for n in range(self.n_min, min(self.n_max, i) + 1):
                last[tuple(toks[i - n : i])] = i

    def propose(self, k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest matching suffix
        (length ``n_max`` down to ``n_min``), copied forward past the sequence's end; ``[]`` when no
        suffix recurs or ``k <= 0``."""
        return self.lookup(k)[0]

    def lookup(self, k: int, longest: int = 0) -> tuple[list[int], int]:
        """``(propose(k), match length)``: the match length is how many tokens before the draft's
        source equal the sequence's suffix, counted up to ``max(longest, n_max)`` (at least
        ``n_min`` when the draft is not empty, 0 when it is); ``O(longest)`` more than ``propose``."""
        toks = self.tokens
        L = len(toks)
        if k <= 0:
            return [], 0
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            at = self._last.get(tuple(toks[L - n :]))
            if at is not None:
                while n < longest and n < at and toks[at - 1 - n] == toks[L - 1 - n]:
                    n += 1
                return _copy_forward(toks, at, k), n
        return [], 0


def _copy_forward(toks: list[int], at: int, k: int) -> list[int]:
    """``k`` tokens copied from ``toks[at:]``, continuing past the end with the copy itself (an
    overlapping copy, as LZ77's): a loop of period ``len(toks) - at`` is drafted k tokens ahead,
    not cut at the sequence's end."""
    out = toks[at : at + k]
    period = len(toks) - at
    while len(out) < k:
        out.append(out[len(out) - period])
    return out
