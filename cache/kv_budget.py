"""Page budgets of the KV pools for admission and decode: how much a request may still take.

Full-pool growth is exact (pages to the end of the reservation); SWA growth is bounded by the
window's span (``SWAWindow.max_pages``), since older SWA pages are released as a request goes.
"""
from __future__ import annotations

from cache.handle import KVHandle
from cache.kv_manager import KVManager
from cache.page_count import PageCount


def fits_alone(kv: KVManager, num_tokens: int) -> bool:
    """True iff one request of ``num_tokens`` tokens fits the empty pools (decoding)."""
    if kv.pages_for(num_tokens) > kv.allocator.num_pages:
        return False
    return not kv.has_swa or kv.window.max_pages() <= kv.swa_allocator.num_pages


def decode_growth(kv: KVManager, handle: KVHandle, kv_len: int, future_tokens: int) -> PageCount:
    """Pages a decoding request at ``kv_len`` may still take for ``future_tokens`` more: full
    pages to the end; SWA pages up to its window's span (older ones are released as it goes)."""
    end = kv.pages_for(kv_len + future_tokens)
    full = max(0, end - len(handle.full.pages))
    if not kv.has_swa:
        return PageCount(full)
    held = sum(1 for p in handle.swa.pages if p >= 0)
    span = min(kv.window.max_pages(), end - kv.window.keep_start(kv_len) // kv.page_size)
    return PageCount(full, max(0, span - held))


def prompt_growth(kv: KVManager, seq_len: int, future_tokens: int) -> PageCount:
    """``decode_growth`` of a ``seq_len``-token prompt once prefilled and windowed."""
    full = kv.pages_for(seq_len + future_tokens) - kv.pages_for(seq_len)
    if not kv.has_swa:
        return PageCount(max(0, full))
    held = kv.pages_for(seq_len) - kv.window.keep_start(seq_len) // kv.page_size
    return PageCount(max(0, full), max(0, kv.window.max_pages() - held))
