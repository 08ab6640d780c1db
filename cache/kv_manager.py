"""Scheduler-side KV manager: page allocators plus an optional radix cache, over handles.

Contract (per pool): every page is exactly one of
- free (in the allocator),
- owned by one live request (``handle.full.own`` / ``handle.swa.own``), or
- held by the radix cache (possibly shared read-only by requests that locked a prefix).
``check_integrity(handles)`` asserts ``free + used + cached == total`` for the live handles, for
the full pool and, for sliding-window hybrids, the SWA pool.
Handles acquire pages only through ``match_prefix``/``reserve_prompt``/``ensure_pages`` and give
them back only through ``release_window``/``free``/``free_into_cache`` and the module's
``truncate``; the radix cache is evicted on demand inside ``ensure_pages``. Nothing here knows
what a request is: callers pass handles and token ids.

SWA pool (``swa`` given): a handle's SWA entries run parallel to its full pages. ``swa_from``
(a token position) says where a new allocation starts holding SWA pages (the decode worker's
preallocated tail); ``release_window`` frees the ones no query of the request can read again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.handle import KVHandle, PoolPages
from cache.page_allocator import PageAllocator, ceil_div
from cache.page_count import PageCount
from cache.radix_cache import RadixCache
from cache.swa_radix_cache import SWARadixCache
from cache.swa_window import NO_PAGE, SWAWindow


@dataclass(frozen=True)
class PoolUsage:
    total: int
    free: int
    used: int
    cached: int
    evictable: int


class KVManager:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        enable_radix_cache: bool,
        swa_allocator: PageAllocator | None = None,
        window: SWAWindow | None = None,
    ) -> None:
        if (swa_allocator is None) != (window is None):
            raise ValueError("an SWA pool needs both its allocator and its window")
        self.allocator = allocator
        self.swa_allocator = swa_allocator
        self.window = window
        self.page_size = page_size
        self.tree = None
        if enable_radix_cache:
            self.tree = SWARadixCache(page_size, window) if window else RadixCache(page_size)
        self.swa_pages_released = 0  # SWA pages freed because they left every window

    @property
    def has_swa(self) -> bool:
        return self.window is not None

    def pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size)

    def available_pages(self) -> int:
        """Full-pool pages obtainable right now: free plus evictable from the radix cache."""
        return self.allocator.num_free() + (self.tree.evictable_size() if self.tree else 0)

    def available(self) -> PageCount:
        """Pages obtainable right now in each pool."""
        if not self.has_swa:
            return PageCount(self.available_pages())
        swa = self.swa_allocator.num_free() + (self.tree.swa_evictable_size() if self.tree else 0)
        return PageCount(self.available_pages(), swa)

    def make_free(self, need: PageCount) -> bool:
        """Evict the radix cache until ``need`` is free in each pool; True iff it then is."""
        self.evict(need.full)
        if not self.has_swa:
            return self.allocator.num_free() >= need.full
        self.evict_swa(need.swa)
        return self.allocator.num_free() >= need.full and self.swa_allocator.num_free() >= need.swa

    # ---- acquiring ---------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> KVHandle:
        """A new handle holding the longest cached page-aligned prefix of ``token_ids``, locked
        (for SWA: whose window is resident; only the window's SWA pages are locked and kept)."""
        handle = KVHandle(swa=PoolPages() if self.has_swa else None)
        if self.tree is None:
            return handle
        m = self.tree.match_prefix(token_ids)
        handle.full.node = m.node
        handle.full.pages = [int(p) for p in m.pages]
        handle.full.num_shared = len(handle.full.pages)
        handle.cached_tokens = m.num_tokens
        if not self.has_swa:
            self.tree.lock(m.node)
            return handle
        locked = self.tree.lock(m.node, self.window.needed_from(m.num_tokens) // self.page_size)
        handle.swa.pages = [int(p) for p in locked]
        handle.swa.num_shared = len(handle.swa.pages)
        return handle

    def prompt_demand(self, handle: KVHandle, n_tokens: int, swa_from: int = 0, swa_to: int | None = None) -> PageCount:
        """Pages ``ensure_pages(handle, n_tokens, swa_from, swa_to)`` would take."""
        n = self.pages_for(n_tokens)
        full = max(0, n - len(handle.full.pages))
        if not self.has_swa:
            return PageCount(full)
        n_swa = n if swa_to is None else self.pages_for(min(n_tokens, swa_to))
        return PageCount(full, max(0, n_swa - max(len(handle.swa.pages), swa_from // self.page_size)))

    def reserve_prompt(
        self,
        token_ids: Sequence[int],
        n_tokens: int,
        extra: PageCount,
        budget: PageCount,
        swa_from: int = 0,
        swa_chunk: int | None = None,
    ) -> tuple[KVHandle, PageCount] | None:
        """Admission: match the cached prefix of ``token_ids[:n_tokens - 1]``, then take pages for
        ``n_tokens`` tokens (SWA pages from ``swa_from`` on, and with ``swa_chunk`` only for the
        first ``swa_chunk`` uncached tokens: chunked prefill grows them chunk by chunk) if those
        plus ``extra`` (future decode tokens) fit in ``budget``. Returns ``(handle, pages
        charged)``, or None with nothing held."""
        handle = self.match_prefix(token_ids[: n_tokens - 1])
        swa_to = None if swa_chunk is None else handle.cached_tokens + swa_chunk
        need = self.prompt_demand(handle, n_tokens, swa_from, swa_to) + extra
        if not budget.covers(need) or not self.ensure_pages(handle, n_tokens, swa_from, swa_to):
            self.free(handle)
            return None
        return handle, need

    def evict(self, num_pages: int) -> None:
        """Make at least ``num_pages`` full-pool pages free by evicting the radix cache, if it can."""
        short = num_pages - self.allocator.num_free()
        if short <= 0 or self.tree is None:
            return
        if not self.has_swa:
            return self.allocator.free(self.tree.evict(short))
        full, swa = self.tree.evict_full(short)
        self.allocator.free(full)
        self.swa_allocator.free(swa)

    def evict_swa(self, num_pages: int) -> None:
        """Make at least ``num_pages`` SWA pages free by tombstoning the radix cache's, if it can."""
        short = num_pages - self.swa_allocator.num_free()
        if short > 0 and self.tree is not None:
            self.swa_allocator.free(self.tree.evict_swa(short))

    def ensure_pages(self, handle: KVHandle, num_tokens: int, swa_from: int = 0, swa_to: int | None = None) -> bool:
        """Grow ``handle`` to cover ``num_tokens`` tokens (new logical pages before ``swa_from``
        get no SWA page; with ``swa_to``, SWA pages only up to that token). False, with nothing
        changed, if a pool is short."""
        need = self.prompt_demand(handle, num_tokens, swa_from, swa_to)
        self.evict(need.full)
        if self.has_swa:
            self.evict_swa(need.swa)
            if not self.swa_allocator.can_alloc(need.swa):
                return False
        if not self.allocator.can_alloc(need.full):
            return False
        handle.full.pages.extend(self.allocator.alloc(need.full))
        if self.has_swa:
            n = self.pages_for(num_tokens if swa_to is None else min(num_tokens, swa_to))
            handle.swa.pages.extend([NO_PAGE] * max(0, n - need.swa - len(handle.swa.pages)))
            handle.swa.pages.extend(self.swa_allocator.alloc(need.swa))
        return True

    # ---- giving back -------------------------------------------------------------------------
    def release_window(self, handle: KVHandle, kv_len: int) -> int:
        """Free the request's own SWA pages before ``window.keep_start(kv_len)``; returns how many."""
        if not self.has_swa or not handle.swa.pages:
            return 0
        swa = handle.swa
        stop = min(self.window.keep_start(kv_len) // self.page_size, len(swa.pages))
        gone = [j for j in range(swa.num_shared, stop) if swa.pages[j] >= 0]
        if gone:
            self.swa_allocator.free([swa.pages[j] for j in gone])
            for j in gone:
                swa.pages[j] = NO_PAGE
            self.swa_pages_released += len(gone)
        return len(gone)

    def drop_swa(self, handle: KVHandle, logical_pages: Sequence[int]) -> None:
        """Free the own SWA pages at these logical pages (their KV never arrived)."""
        swa = handle.swa
        gone = [
            j for j in logical_pages if swa is not None and swa.num_shared <= j < len(swa.pages) and swa.pages[j] >= 0
        ]
        if gone:
            self.swa_allocator.free([swa.pages[j] for j in gone])
        for j in gone:
            swa.pages[j] = NO_PAGE

    def restore(self, handle: KVHandle, num_tokens: int, swa_index: Sequence[int]) -> bool:
        """Resume: ``handle`` (empty, or holding only the prefix ``cache.prefix_share.park`` kept) gets full pages for
        the rest of ``num_tokens`` tokens and, with an SWA pool (empty handles only), SWA pages
        exactly at the logical pages ``swa_index``. False, with nothing changed, if a pool is short."""
        n = self.pages_for(num_tokens)
        kept = len(handle.full.pages)
        assert kept == handle.full.num_shared and not (kept and self.has_swa), "restore: not a parked handle"
        if not self.make_free(PageCount(n - kept, len(swa_index))):
            return False
        handle.full.pages = handle.full.pages + self.allocator.alloc(n - kept)
        if self.has_swa:
            handle.swa = PoolPages(pages=[NO_PAGE] * n)
            for j, p in zip(swa_index, self.swa_allocator.alloc(len(swa_index))):
                handle.swa.pages[j] = p
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
        key = token_ids[: n_full * self.page_size]
        if self.has_swa:
            res = self.tree.insert(key, handle.pages[:n_full], handle.swa.pages[:n_full])
            self.swa_allocator.free(res.duplicate_swa_pages)
        else:
            res = self.tree.insert(key, handle.pages[:n_full])
        self.allocator.free(res.duplicate_pages)
        self._release(handle, max(handle.full.num_shared, n_full))

    def _release(self, handle: KVHandle, own_start: int) -> None:
        self.allocator.free(handle.pages[own_start:])
        if handle.swa is not None:
            self.swa_allocator.free([p for p in handle.swa.pages[max(own_start, handle.swa.num_shared) :] if p >= 0])
        if handle.full.node is not None:
            if self.has_swa:
                self.tree.unlock(handle.full.node, handle.swa.pages[: handle.swa.num_shared])
            else:
                self.tree.unlock(handle.full.node)
        handle.full.clear()
        if handle.swa is not None:
            handle.swa.clear()
        handle.cached_tokens = 0

    # ---- accounting ----------------------------------------------------------------------------
    def usage(self, live: Sequence[KVHandle], pool: str = "full") -> PoolUsage | None:
        """Pages by state of the full pool, or of the SWA pool (``pool="swa"``; None without one)."""
        if pool == "full":
            return PoolUsage(
                total=self.allocator.num_pages,
                free=self.allocator.num_free(),
                used=sum(len(h.full.own) for h in live),
                cached=self.tree.total_size() if self.tree else 0,
                evictable=self.tree.evictable_size() if self.tree else 0,
            )
        if not self.has_swa:
            return None
        return PoolUsage(
            total=self.swa_allocator.num_pages,
            free=self.swa_allocator.num_free(),
            used=sum(len(h.swa.own) for h in live if h.swa is not None),
            cached=self.tree.swa_total_size() if self.tree else 0,
            evictable=self.tree.swa_evictable_size() if self.tree else 0,
        )

    def check_integrity(self, live: Sequence[KVHandle]) -> None:
        """Assert free + used + cached == total per pool, no page owned twice, allocator consistency."""
        self.allocator.check_integrity()
        _check_pool(
            self.usage(live),
            [p for h in live for p in h.full.own] + (self.tree.all_pages() if self.tree else []),
            "full",
        )
        if self.has_swa:
            self.swa_allocator.check_integrity()
            _check_pool(
                self.usage(live, "swa"),
                [p for h in live if h.swa is not None for p in h.swa.own]
                + (self.tree.all_swa_pages() if self.tree else []),
                "swa",
            )
        if self.tree is not None:
            self.tree.check_integrity()


def _check_pool(u: PoolUsage, owned: list[int], name: str) -> None:
    assert u.free + u.used + u.cached == u.total, f"{name} page leak: {u}"
    assert len(set(owned)) == len(owned), f"a {name} page is owned twice"


def truncate(kv: KVManager, handle: KVHandle, num_tokens: int) -> int:
    """Give back ``handle``'s own pages past the first ``num_tokens`` tokens' (a speculative step's
    rejected positions) in each pool; returns how many full-pool pages. The pages kept must cover
    the shared (radix) ones: those are never cut."""
    keep = kv.pages_for(num_tokens)
    assert keep >= handle.full.num_shared, "truncate: would cut the radix-cache prefix"
    gone = handle.full.pages[keep:]
    if gone:
        kv.allocator.free(gone)
        del handle.full.pages[keep:]
    if handle.swa is not None and len(handle.swa.pages) > keep:
        kv.swa_allocator.free([p for p in handle.swa.pages[max(keep, handle.swa.num_shared) :] if p >= 0])
        del handle.swa.pages[keep:]
    return len(gone)
