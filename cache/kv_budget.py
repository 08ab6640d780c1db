"""Page budgets of the KV pools: the one place that turns tokens, reservations and the running
batch into page counts, for admission (prefill, colocated and decode), decode steps and retract.

Full-pool growth is exact (pages to the end of the reservation); SWA growth is bounded by the
window's span (``SWAWindow.max_pages``), since older SWA pages are released as a request goes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

from cache.handle import KVHandle
from cache.kv_manager import KVManager
from cache.page_count import PageCount


class Budgeted(Protocol):
    """What the budget reads of a request (``engine.request.Request`` is one)."""

    kv: KVHandle
    kv_len: int
    params: Any  # ``.ignore_eos``

    @property
    def seq_len(self) -> int: ...

    def remaining_new_tokens(self) -> int: ...


class PageBudget:
    """Page arithmetic over one ``KVManager``'s pools: the full pool and, for sliding-window
    hybrids, the SWA pool; counts are ``PageCount(full, swa)``.

    Contract: pure arithmetic. No method allocates, frees or evicts; each reads only the pools'
    sizes, what is obtainable now (free plus evictable radix cache, ``available``), and the
    handles and requests it is given, so asking twice gives the same answer.

    Invariants:
    - ``pages_for(n) == ceil(n / page_size)``; every need and growth is ``>= 0`` in each pool;
      ``swa`` is 0 everywhere for a model without an SWA pool.
    - A request's reservation is ``ceil(remaining_new_tokens * new_token_ratio)`` tokens
      (the whole remainder with ``ignore_eos``); full pages are charged to the end of it, SWA
      pages only up to ``window_pages`` held at once.
    - ``headroom = available - running reservation``: what admission may hand out (may be
      negative in a pool while the running batch is over its estimate).
    """

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv

    # ---- tokens to pages -------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        """Pages holding ``num_tokens`` tokens."""
        return self.kv.pages_for(num_tokens)

    @property
    def window_pages(self) -> int:
        """Most SWA pages one decoding request holds at once (0 without an SWA pool)."""
        return self.kv.window.max_pages() if self.kv.has_swa else 0

    def window_first_page(self, kv_len: int) -> int:
        """First logical page whose SWA KV a request with ``kv_len`` tokens still keeps."""
        return self.kv.window.keep_start(kv_len) // self.kv.page_size

    def prealloc_start(self, n_tokens: int) -> int:
        """First token of the SWA tail a decode worker preallocates for an ``n_tokens`` prompt
        (0 without an SWA pool: nothing to skip)."""
        kv = self.kv
        return kv.window.prealloc_start(n_tokens, kv.tree is not None) if kv.has_swa else 0

    def prefill_swa_tokens(self, prompt_len: int, chunk: int) -> int:
        """SWA KV a prompt holds at once while prefilled in chunks of ``chunk`` tokens: one chunk
        plus the window before it."""
        return min(prompt_len, chunk + self.window_pages * self.kv.page_size)

    def swa_pages_at_once(self, swa_tokens: int) -> int:
        """SWA pages a request needs at once: ``swa_tokens`` at admission, or its decode window."""
        return max(self.pages_for(swa_tokens), self.window_pages)

    # ---- reservations (new_token_ratio headroom) ---------------------------------------------
    @staticmethod
    def reserved_tokens(req: Budgeted, ratio: float) -> int:
        """Future decode tokens admission keeps room for (SGLang: ``max_new_tokens * ratio``)."""
        r = 1.0 if req.params.ignore_eos else ratio
        return math.ceil(req.remaining_new_tokens() * r)

    def decode_growth(self, handle: KVHandle, kv_len: int, future_tokens: int) -> PageCount:
        """Pages a decoding request at ``kv_len`` may still take for ``future_tokens`` more: full
        pages to the end; SWA pages up to its window's span (older ones are released as it goes)."""
        end = self.pages_for(kv_len + future_tokens)
        full = max(0, end - len(handle.full.pages))
        if not self.kv.has_swa:
            return PageCount(full)
        held = sum(1 for p in handle.swa.pages if p >= 0)
        span = min(self.window_pages, end - self.window_first_page(kv_len))
        return PageCount(full, max(0, span - held))

    def prompt_growth(self, seq_len: int, future_tokens: int) -> PageCount:
        """``decode_growth`` of a ``seq_len``-token prompt once prefilled and windowed."""
        full = max(0, self.pages_for(seq_len + future_tokens) - self.pages_for(seq_len))
        if not self.kv.has_swa:
            return PageCount(full)
        held = self.pages_for(seq_len) - self.window_first_page(seq_len)
        return PageCount(full, max(0, self.window_pages - held))

    def prompt_reservation(self, req: Budgeted, ratio: float, n_tokens: int | None = None) -> PageCount:
        """Pages beyond those of its first ``n_tokens`` (default: all ``seq_len``) tokens that a
        request being admitted is expected to take up to ``seq_len + reserved_tokens``."""
        n = req.seq_len if n_tokens is None else n_tokens
        return self.prompt_growth(n, req.seq_len + self.reserved_tokens(req, ratio) - n)

    def full_pages_to_admit(self, req: Budgeted, ratio: float, n_tokens: int) -> int:
        """Full pages a peer needs to take ``req`` with the KV of its first ``n_tokens`` tokens:
        those tokens' pages plus the ``prompt_reservation`` (what a migration offer asks for)."""
        return self.pages_for(n_tokens) + self.prompt_reservation(req, ratio, n_tokens).full

    def running_reservation(self, running: Iterable[Budgeted], ratio: float) -> PageCount:
        """Pages the admitted requests may still take: up to ``seq_len + reserved_tokens`` each."""
        total = PageCount()
        for r in running:
            total += self.decode_growth(r.kv, r.seq_len, self.reserved_tokens(r, ratio))
        return total

    def headroom(self, running: Iterable[Budgeted], ratio: float) -> PageCount:
        """What admission may hand out: obtainable pages minus the running reservation."""
        return self.kv.available() - self.running_reservation(running, ratio)

    # ---- decode steps and retract ------------------------------------------------------------
    def decode_need(self, reqs: Iterable[Budgeted], steps: int) -> PageCount:
        """New pages ``reqs`` need to decode ``steps`` more tokens each."""
        total = PageCount()
        for r in reqs:
            total += self.kv.prompt_demand(r.kv, r.kv_len + steps)
        return total

    def resume_need(self, kv_len: int, steps: int, swa_pages: int) -> PageCount:
        """Pages a retracted request at ``kv_len`` takes to come back with room for ``steps``
        steps: full pages capped at the pool (a request parked with a shorter reserve still
        comes back, alone) and its ``swa_pages`` window pages."""
        return PageCount(min(self.pages_for(kv_len + steps), self.kv.allocator.num_pages), swa_pages)

    def fits_beside(self, running: Iterable[Budgeted], steps: int, need: PageCount) -> bool:
        """True iff ``need`` is obtainable now after ``running``'s own ``steps``-step reserve."""
        return (self.kv.available() - self.decode_need(running, steps)).covers(need)

    def fits_alone(self, num_tokens: int) -> bool:
        """True iff one request of ``num_tokens`` tokens fits the empty pools (decoding)."""
        if self.pages_for(num_tokens) > self.kv.allocator.num_pages:
            return False
        return not self.kv.has_swa or self.window_pages <= self.kv.swa_allocator.num_pages

    @property
    def swa_pool_pages(self) -> int | None:
        """Size of the SWA pool in pages (None without one)."""
        return self.kv.swa_allocator.num_pages if self.kv.has_swa else None
