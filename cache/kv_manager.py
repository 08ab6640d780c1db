"""Scheduler-side KV manager: one page allocator plus an optional radix cache, over handles.

Contract (per pool): every page is exactly one of
- free (in the allocator),
- owned by one live request (``handle.full.own``), or
- held by the radix cache (possibly shared read-only by requests that locked a prefix).
``check_integrity(handles)`` asserts ``free + used + cached == total`` for the live handles.
Handles acquire pages only through ``match_prefix``/``reserve_prompt``/``ensure_pages`` and give
them back only through ``free``/``free_into_cache``; the radix cache is evicted on demand inside
``ensure_pages``. Nothing here knows what a request is: callers pass handles and token ids.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.handle import KVHandle
from cache.page_allocator import PageAllocator, ceil_div
from cache.radix_cache import RadixCache


@dataclass(frozen=True)
class PoolUsage:
    total: int
    free: int
    used: int
    cached: int
    evictable: int


class KVManager:
    def __init__(self, allocator: PageAllocator, page_size: int, enable_radix_cache: bool) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.tree = RadixCache(page_size) if enable_radix_cache else None

    def pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size)

    def available_pages(self) -> int:
        """Pages obtainable right now: free plus evictable from the radix cache."""
        return self.allocator.num_free() + (self.tree.evictable_size() if self.tree else 0)

    def match_prefix(self, token_ids: Sequence[int]) -> KVHandle:
        """A new handle holding the longest cached page-aligned prefix of ``token_ids``, locked."""
        handle = KVHandle()
        if self.tree is None:
            return handle
        m = self.tree.match_prefix(token_ids)
        self.tree.lock(m.node)
        handle.full.node = m.node
        handle.full.pages = [int(p) for p in m.pages]
        handle.full.num_shared = len(handle.full.pages)
        handle.cached_tokens = m.num_tokens
        return handle

    def reserve_prompt(self, token_ids: Sequence[int], n_tokens: int, extra_pages: int,
                       budget: int) -> tuple[KVHandle, int] | None:
        """Admission: match the cached prefix of ``token_ids[:n_tokens - 1]``, then take pages for
        ``n_tokens`` tokens if those pages plus ``extra_pages`` (future decode tokens) fit in
        ``budget``. Returns ``(handle, pages charged to the budget)``, or None with nothing held."""
        handle = self.match_prefix(token_ids[: n_tokens - 1])
        need = self.pages_for(n_tokens) - len(handle.pages) + extra_pages
        if need > budget or not self.ensure_pages(handle, n_tokens):
            self.free(handle)
            return None
        return handle, need

    def evict(self, num_pages: int) -> None:
        """Make at least ``num_pages`` pages free by evicting the radix cache, if it can."""
        short = num_pages - self.allocator.num_free()
        if short > 0 and self.tree is not None:
            self.allocator.free(self.tree.evict(short))

    def ensure_pages(self, handle: KVHandle, num_tokens: int) -> bool:
        """Grow ``handle`` to cover ``num_tokens`` tokens. False (nothing changed) if short."""
        need = self.pages_for(num_tokens) - len(handle.pages)
        if need <= 0:
            return True
        self.evict(need)
        if not self.allocator.can_alloc(need):
            return False
        handle.full.pages.extend(self.allocator.alloc(need))
        return True

    def free(self, handle: KVHandle) -> None:
        """Give back every page of ``handle`` without caching it (abort, retract); empties it."""
        self._release(handle, handle.full.num_shared)

    def free_into_cache(self, handle: KVHandle, token_ids: Sequence[int]) -> None:
        """Finish: the full pages of ``token_ids`` (the tokens whose KV is in ``handle``, in order)
        go to the radix cache, the rest back to the allocator; empties ``handle``."""
        if self.tree is None:
            return self.free(handle)
        n_full = len(token_ids) // self.page_size
        res = self.tree.insert(token_ids[: n_full * self.page_size], handle.pages[:n_full])
        self.allocator.free(res.duplicate_pages)
        self._release(handle, max(handle.full.num_shared, n_full))

    def _release(self, handle: KVHandle, own_start: int) -> None:
        self.allocator.free(handle.pages[own_start:])
        if handle.full.node is not None:
            self.tree.unlock(handle.full.node)
        handle.full.clear()
        handle.cached_tokens = 0

    def usage(self, live: Sequence[KVHandle]) -> PoolUsage:
        return PoolUsage(
            total=self.allocator.num_pages,
            free=self.allocator.num_free(),
            used=sum(len(h.full.own) for h in live),
            cached=self.tree.total_size() if self.tree else 0,
            evictable=self.tree.evictable_size() if self.tree else 0,
        )

    def check_integrity(self, live: Sequence[KVHandle]) -> None:
        """Assert free + used + cached == total, no page owned twice, and allocator consistency."""
        self.allocator.check_integrity()
        u = self.usage(live)
        assert u.free + u.used + u.cached == u.total, f"page leak: {u}"
        owned = [p for h in live for p in h.full.own] + (self.tree.all_pages() if self.tree else [])
        assert len(set(owned)) == len(owned), "a page is owned twice"
        if self.tree is not None:
            self.tree.check_integrity()
