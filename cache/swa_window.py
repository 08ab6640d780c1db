"""Window arithmetic of sliding-window (SWA) layers over paged KV (``docs/design/decode-radix-swa.md``).

Semantics as transformers: a query at position ``i`` sees keys ``i-W+1 .. i`` (``W`` keys, itself
included). A request with ``kv_len`` tokens of KV next computes position ``kv_len``, so it never
again reads keys before ``kv_len - W + 1``; a page entirely before that may be freed.

Pages are kept a little longer than that (``keep_start``): from ``kv_len - 1 - max(W, P)`` (one
window, or one page where a page is longer, before the last key written), widened where needed so
that the *page-truncated* radix key of the request (``floor(kv_len / P) * P`` tokens, what
``free_into_cache`` inserts) still has its whole window resident: otherwise a follow-up request that
matches that key could not reuse it. Every function here is pure; ``SWAWindow`` is shared by the KV
manager, the decode admission and tests.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_PAGE = -1  # a logical page of a request whose SWA KV is not resident (freed or never needed)


@dataclass(frozen=True)
class SWAWindow:
    window: int
    page_size: int

    def __post_init__(self) -> None:
        if self.window <= 0 or self.page_size <= 0:
            raise ValueError(f"sliding window {self.window} and page size {self.page_size} must be positive")

    def _floor(self, pos: int) -> int:
        return (max(0, pos) // self.page_size) * self.page_size

    def needed_from(self, pos: int) -> int:
        """First key position a query at ``pos`` reads."""
        return max(0, pos - self.window + 1)

    def keep_start(self, kv_len: int) -> int:
        """Page-aligned first position whose SWA KV a request with ``kv_len`` tokens keeps."""
        W, P = self.window, self.page_size
        margin = kv_len - 1 - max(W, P)  # one window (or page) before the last key written
        key_window = (kv_len // P) * P - W + 1  # the window of the page-truncated radix key
        return self._floor(min(margin, key_window))

    def prealloc_start(self, seq_len: int, radix: bool) -> int:
        """Decode admission: first position of the SWA tail preallocated for a ``seq_len``-token
        prompt. With the decode radix cache on, the margin of ``keep_start`` (895 tokens,
        page 64, window 127: 704, not 768); off: ``seq_len - W``, page aligned."""
        return self.keep_start(seq_len) if radix else self._floor(seq_len - self.window)

    def window_resident(self, resident: list[bool], num_pages: int) -> bool:
        """True iff a match ending after page ``num_pages`` has its window resident: every page
        from the one holding ``needed_from(num_pages * P)`` up to ``num_pages`` is."""
        first = self.needed_from(num_pages * self.page_size) // self.page_size
        return all(resident[first:num_pages])

    def longest_resident_match(self, resident: list[bool]) -> int:
        """The largest ``k <= len(resident)`` whose window is resident (0 always qualifies)."""
        last_hole = -1
        holes_before = []  # holes_before[k]: last non-resident page index < k
        for j, r in enumerate(resident):
            holes_before.append(last_hole)
            if not r:
                last_hole = j
        holes_before.append(last_hole)
        for k in range(len(resident), 0, -1):
            first = self.needed_from(k * self.page_size) // self.page_size
            if holes_before[k] < first:
                return k
        return 0

    def max_pages(self) -> int:
        """Most SWA pages a request can hold while decoding (pages over ``[keep_start, kv_len]``)."""
        P = self.page_size
        horizon = 2 * (self.window + 3 * P)
        return max(-(-(n + 1) // P) - self.keep_start(n) // P for n in range(horizon))
