"""Scheduler-side KV manager: one page allocator plus an optional radix cache.

Contract (per pool): every page is exactly one of
- free (in the allocator),
- owned by one live request (``req.own_pages``), or
- held by the radix cache (possibly shared read-only by requests that locked a prefix).
``check_integrity`` asserts ``free + used + cached == total`` given the live requests.
Requests acquire pages only through ``match_prefix``/``ensure_pages`` and give them back only
through ``release``; eviction from the radix cache happens on demand inside ``ensure_pages``.
"""
from __future__ import annotations

from dataclasses import dataclass

from cache.page_allocator import PageAllocator
from cache.radix_cache import RadixCache
from engine.request import Request


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
        return -(-num_tokens // self.page_size)

    def available_pages(self) -> int:
        """Pages obtainable right now: free plus evictable from the radix cache."""
        return self.allocator.num_free() + (self.tree.evictable_size() if self.tree else 0)

    def match_prefix(self, req: Request, token_ids: list[int]) -> None:
        """Attach the longest cached page-aligned prefix of ``token_ids`` to ``req`` and lock it."""
        assert not req.pages, "prefix match on a request that already holds pages"
        if self.tree is None:
            return
        m = self.tree.match_prefix(token_ids)
        self.tree.lock(m.node)
        req.prefix_node = m.node
        req.pages = [int(p) for p in m.pages]
        req.num_shared_pages = len(req.pages)
        req.kv_len = req.cached_tokens = m.num_tokens

    def reserve_prompt(self, req: Request, n_tokens: int, extra_pages: int, budget: int) -> int | None:
        """Admission: attach the cached prefix of ``req.all_ids[:n_tokens - 1]``, then take pages for
        ``n_tokens`` tokens if those pages plus ``extra_pages`` (future decode tokens) fit in
        ``budget``. Returns the pages charged to the budget, or None with ``req`` left untouched."""
        self.match_prefix(req, req.all_ids[: n_tokens - 1])
        need = self.pages_for(n_tokens) - len(req.pages) + extra_pages
        if need > budget or not self.ensure_pages(req, n_tokens):
            self.release(req, insert=False)
            req.kv_len = req.cached_tokens = 0
            return None
        return need

    def evict(self, num_pages: int) -> None:
        """Make at least ``num_pages`` pages free by evicting the radix cache, if it can."""
        short = num_pages - self.allocator.num_free()
        if short > 0 and self.tree is not None:
            self.allocator.free(self.tree.evict(short))

    def ensure_pages(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req.pages`` to cover ``num_tokens`` tokens. False (nothing changed) if short."""
        need = self.pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return True
        self.evict(need)
        if not self.allocator.can_alloc(need):
            return False
        req.pages.extend(self.allocator.alloc(need))
        return True

    def release(self, req: Request, insert: bool) -> None:
        """Give back all of ``req``'s pages; with ``insert`` its full pages go to the radix cache.

        ``insert=False`` is the retract path: the KV is dropped, not cached.
        """
        own_start = req.num_shared_pages
        if insert and self.tree is not None:
            n_full = req.kv_len // self.page_size
            key = req.all_ids[: n_full * self.page_size]
            res = self.tree.insert(key, req.pages[:n_full])
            self.allocator.free(res.duplicate_pages)
            own_start = max(own_start, n_full)
        self.allocator.free(req.pages[own_start:])
        if req.prefix_node is not None:
            self.tree.unlock(req.prefix_node)
        req.pages, req.num_shared_pages, req.prefix_node = [], 0, None

    def usage(self, live: list[Request]) -> PoolUsage:
        cached = self.tree.total_size() if self.tree else 0
        return PoolUsage(
            total=self.allocator.num_pages,
            free=self.allocator.num_free(),
            used=sum(len(r.own_pages) for r in live),
            cached=cached,
            evictable=self.tree.evictable_size() if self.tree else 0,
        )

    def check_integrity(self, live: list[Request]) -> None:
        """Assert free + used + cached == total, no page owned twice, and allocator consistency."""
        self.allocator.check_integrity()
        u = self.usage(live)
        assert u.free + u.used + u.cached == u.total, f"page leak: {u}"
        owned = [p for r in live for p in r.own_pages] + (self.tree.all_pages() if self.tree else [])
        assert len(set(owned)) == len(owned), "a page is owned twice"
        if self.tree is not None:
            self.tree.check_integrity()
