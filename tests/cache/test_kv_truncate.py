"""``truncate``: a speculative step's rejected positions give their own pages back, never the
radix-cache prefix the handle shares; the pool invariant holds after."""

from __future__ import annotations

import pytest

from cache.kv_manager import KVManager, truncate
from cache.page_allocator import PageAllocator

P = 4


def test_truncate_frees_only_own_pages_past_the_tokens_kept():
    kv = KVManager(PageAllocator(16), P, enable_radix_cache=True)
    first = kv.match_prefix(list(range(12)))
    assert kv.ensure_pages(first, 12)
    kv.free_into_cache(first, list(range(12)))  # 3 pages cached
    h = kv.match_prefix(list(range(12)) + [50])
    assert h.full.num_shared == 3
    assert kv.ensure_pages(h, 12 + 1 + 8)  # one position + 8 drafted: 6 pages
    free_before = kv.allocator.num_free()
    assert truncate(kv, h, 14) == 2  # 14 tokens kept: 4 pages
    assert len(h.pages) == 4 and kv.allocator.num_free() == free_before + 2
    kv.check_integrity([h])
    assert truncate(kv, h, 16) == 0  # nothing past a full page
    with pytest.raises(AssertionError):
        truncate(kv, h, 8)  # would cut the shared prefix
    kv.free(h)
    kv.check_integrity([])
