"""SWA window arithmetic and the two-lifetime radix cache ."""

from __future__ import annotations

import pytest

from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from cache.page_count import PageCount
from cache.swa_window import NO_PAGE, SWAWindow


def test_seed_reviewers_case_window_starts_at_704():
    w = SWAWindow(window=127, page_size=64)
    assert w.prealloc_start(895, radix=True) == 704  # not 768: the page-truncated key keeps its window
    assert w.prealloc_start(895, radix=False) == 768  # seq_len - W without the decode radix cache
    # the key free_into_cache inserts is 832 tokens; a match there needs keys from 832 - 126 = 706
    assert w.window_resident([False] * 11 + [True] * 2, 13)
    assert not w.window_resident([False] * 12 + [True], 13)


@pytest.mark.parametrize("window,page", [(127, 64), (100, 64), (8, 4), (5, 4), (16, 16), (3, 8)])
def test_keep_start_keeps_every_window_a_query_or_a_match_needs(window, page):
    w = SWAWindow(window, page)
    for n in range(1, 6 * (window + page)):
        k = w.keep_start(n)
        assert k % page == 0 and k <= w.needed_from(n)  # the next query's keys
        assert k <= w.needed_from((n // page) * page)  # a match at the inserted key
        assert -(-(n + 1) // page) - k // page <= w.max_pages()


def test_longest_resident_match_stops_before_a_hole_in_the_window():
    w = SWAWindow(8, 4)  # a match ending at page k needs pages from (4k - 7) // 4 on
    assert w.longest_resident_match([True] * 5) == 5
    assert w.longest_resident_match([False, False, False, True, True]) == 5
    assert w.longest_resident_match([True, True, False, True, False]) == 2
    assert w.longest_resident_match([False, True]) == 0


def make_kv(num_pages=64, swa_pages=16, window=8, page=4) -> KVManager:
    return KVManager(PageAllocator(num_pages), page, True, PageAllocator(swa_pages), SWAWindow(window, page))


def finish(kv: KVManager, tokens: list[int], kv_len: int | None = None) -> None:
    """A request that computed ``tokens`` (its window released as it went), then finished."""
    h = kv.reserve_prompt(tokens, len(tokens), PageCount(), kv.available())[0]
    kv.release_window(h, kv_len or len(tokens))
    kv.free_into_cache(h, tokens)


def test_finished_request_leaves_full_kv_and_only_its_window_of_swa():
    kv = make_kv()
    tokens = list(range(40))  # 10 pages, window 8 -> keep from keep_start(40) = 28
    finish(kv, tokens)
    assert kv.tree.total_size() == 10 and kv.tree.swa_total_size() == 3
    kv.check_integrity([])
    h = kv.match_prefix(tokens + [99])  # multi-turn: the next turn matches all 40 tokens
    assert h.cached_tokens == 40 and h.swa.pages[:8] == [NO_PAGE] * 8 and min(h.swa.pages[8:]) >= 0
    kv.check_integrity([h])
    kv.free(h)
    assert h.empty and kv.tree.swa_protected_size() == 0 and kv.tree.protected_size() == 0


def test_match_in_the_middle_of_a_tombstoned_prefix_falls_back():
    kv = make_kv()
    finish(kv, list(range(40)))
    # a prompt sharing only the first 24 tokens: the window before token 24 was freed
    h = kv.match_prefix(list(range(24)) + [77] * 10)
    assert h.cached_tokens == 0
    kv.free(h)
    kv.check_integrity([])


def test_locks_balance_per_pool_and_swa_eviction_tombstones_only_unlocked_pages():
    kv = make_kv()
    a, b = list(range(40)), list(range(100, 140))
    finish(kv, a)
    finish(kv, b)
    held = kv.match_prefix(a + [1])  # locks a's full path and its window's SWA pages
    assert kv.tree.swa_protected_size() == 2  # pages 8, 9: keys 33..39 for the query at 40
    kv.evict_swa(kv.swa_allocator.num_pages)  # everything evictable: b's window and a's page 7
    assert kv.tree.swa_total_size() == 2
    assert kv.match_prefix(b + [1]).cached_tokens == 0  # b lost its window: no reuse
    kv.free(kv.match_prefix([]))
    kv.free(held)
    kv.check_integrity([])
    assert kv.tree.swa_protected_size() == 0 and kv.tree.protected_size() == 0


def test_full_eviction_frees_both_pools():
    kv = make_kv()
    finish(kv, list(range(40)))
    free_full, free_swa = kv.allocator.num_free(), kv.swa_allocator.num_free()
    kv.evict(kv.allocator.num_pages)
    assert kv.allocator.num_free() == free_full + 10 and kv.swa_allocator.num_free() == free_swa + 3
    assert kv.tree.total_size() == kv.tree.swa_total_size() == 0
    kv.check_integrity([])


def test_split_keeps_per_page_swa_locks():
    """A lock taken on a long node, then a split inside it (another prompt), unlocks exactly."""
    kv = make_kv()
    tokens = list(range(48))
    finish(kv, tokens)
    h = kv.match_prefix(tokens + [5])
    other = kv.match_prefix(tokens[:36] + [9] * 8)  # splits the node at 36 tokens
    kv.check_integrity([h, other])
    kv.free(other)
    kv.free(h)
    kv.check_integrity([])
    assert kv.tree.swa_protected_size() == 0


def test_decode_prealloc_takes_only_the_swa_tail():
    kv = make_kv(swa_pages=64)
    n = 41
    start = kv.window.prealloc_start(n, radix=True)
    h, charged = kv.reserve_prompt(list(range(n)), n, PageCount(), kv.available(), swa_from=start)
    assert charged == PageCount(kv.pages_for(n), kv.pages_for(n) - start // 4)
    assert h.swa.pages[: start // 4] == [NO_PAGE] * (start // 4)
    kv.free(h)
    kv.check_integrity([])


def test_duplicate_swa_pages_of_a_concurrent_copy_go_back():
    kv = make_kv(swa_pages=32)
    tokens = list(range(40))
    h1 = kv.reserve_prompt(tokens, 40, PageCount(), kv.available())[0]
    h2 = kv.reserve_prompt(tokens, 40, PageCount(), kv.available())[0]
    for h in (h1, h2):
        kv.release_window(h, 40)
    kv.free_into_cache(h1, tokens)
    kv.free_into_cache(h2, tokens)  # its full and SWA pages are duplicates now
    kv.check_integrity([])
    assert kv.swa_allocator.num_free() == kv.swa_allocator.num_pages - kv.tree.swa_total_size()
    assert kv.tree.swa_total_size() == 3 and kv.allocator.num_free() == kv.allocator.num_pages - 10


def test_a_sibling_branch_revives_tombstones_of_the_shared_prefix():
    """Request A decoded long enough to drop the SWA of its first pages; B shares A's first pages
    and still holds them when it finishes: the tree takes B's pages over A's tombstones, so B's
    own prompt can be matched again (found on Gemma 3: 540 and 520 tokens sharing 300)."""
    kv = make_kv(num_pages=64, swa_pages=64)
    a = list(range(48))
    b = a[:24] + list(range(200, 204))  # a match of b reads page 5, inside the shared part
    hb = kv.reserve_prompt(b, len(b), PageCount(), kv.available())[0]  # B runs beside A
    finish(kv, a)  # A's window release tombstoned its early pages
    kv.free_into_cache(hb, b)  # B never slid: all its SWA pages resident
    h = kv.match_prefix(b + [1])
    assert h.cached_tokens == 28
    kv.check_integrity([h])
    kv.free(h)
    kv.check_integrity([])
