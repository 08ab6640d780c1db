"""Tests for cache.radix_cache.RadixCache (CPU only, no torch needed)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cache.radix_cache import InsertResult, MatchResult, RadixCache


@pytest.fixture(params=[1, 16], ids=["ps1", "ps16"])
def page_size(request) -> int:
    return request.param


@pytest.fixture
def cache(page_size):
    c = RadixCache(page_size)
    yield c
    c.check_integrity()  # integrity after every test


def toks(ps: int, *page_tokens: int) -> list[int]:
    """Key of len(page_tokens) pages; page i is filled with token page_tokens[i]."""
    out: list[int] = []
    for t in page_tokens:
        out.extend([t] * ps)
    return out


def pages_of(result: MatchResult) -> list[int]:
    return [int(p) for p in result.pages]


def test_match_empty_tree(cache, page_size):
    r = cache.match_prefix(toks(page_size, 1, 2, 3))
    assert isinstance(r, MatchResult)
    assert r.num_tokens == 0 and len(r.pages) == 0
    assert r.pages.dtype == np.int32
    assert r.node is cache.root
    assert cache.match_prefix([]).num_tokens == 0
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.evict(5) == []


def test_insert_then_match_full_partial_unaligned(cache, page_size):
    ps = page_size
    key = toks(ps, 1, 2, 3, 4)
    res = cache.insert(key, [10, 11, 12, 13])
    assert isinstance(res, InsertResult)
    assert res.num_cached_tokens == 0 and res.duplicate_pages == []
    assert cache.total_size() == cache.evictable_size() == 4
    cache.check_integrity()

    full = cache.match_prefix(key)
    assert pages_of(full) == [10, 11, 12, 13] and full.num_tokens == 4 * ps
    assert full.node is res.node

    longer = cache.match_prefix(key + toks(ps, 9))
    assert pages_of(longer) == [10, 11, 12, 13]

    partial = cache.match_prefix(toks(ps, 1, 2, 7))
    assert pages_of(partial) == [10, 11] and partial.num_tokens == 2 * ps
    cache.check_integrity()

    # Non-page-aligned prompt: only whole pages match.
    unaligned = key[: 3 * ps - 1] if ps > 1 else key[:3]
    r = cache.match_prefix(unaligned)
    expect = [10, 11] if ps > 1 else [10, 11, 12]
    assert pages_of(r) == expect and r.num_tokens == len(expect) * ps
    if ps > 1:
        # A prompt that differs only in the last token of a page does not match that page.
        k = list(key)
        k[2 * ps - 1] = 99
        assert pages_of(cache.match_prefix(k)) == [10]
        assert cache.match_prefix(key[: ps - 1]).num_tokens == 0
    # Inputs may be numpy arrays too.
    assert pages_of(cache.match_prefix(np.array(key, dtype=np.int64))) == [10, 11, 12, 13]


def test_insert_shared_prefix_returns_cached_length(cache, page_size):
    ps = page_size
    cache.insert(toks(ps, 1, 2, 3), [0, 1, 2])
    # Caller computed the whole key itself: its first two pages duplicate the tree's.
    res = cache.insert(toks(ps, 1, 2, 5, 6), [20, 21, 22, 23])
    assert res.num_cached_tokens == 2 * ps
    assert sorted(res.duplicate_pages) == [20, 21]
    assert cache.total_size() == 5
    assert pages_of(cache.match_prefix(toks(ps, 1, 2, 5, 6))) == [0, 1, 22, 23]
    assert pages_of(cache.match_prefix(toks(ps, 1, 2, 3))) == [0, 1, 2]
    assert sorted(cache.all_pages()) == [0, 1, 2, 22, 23]

    # Caller reused the tree's pages from a match: nothing is a duplicate.
    m = cache.match_prefix(toks(ps, 1, 2, 3, 8))
    res2 = cache.insert(toks(ps, 1, 2, 3, 8), list(m.pages) + [30])
    assert res2.num_cached_tokens == 3 * ps and res2.duplicate_pages == []

    # Re-inserting an existing key: all cached, node is the existing one.
    res3 = cache.insert(toks(ps, 1, 2, 3), [40, 41, 42])
    assert res3.num_cached_tokens == 3 * ps and sorted(res3.duplicate_pages) == [40, 41, 42]
    assert res3.node is cache.match_prefix(toks(ps, 1, 2, 3)).node
    assert cache.total_size() == 6


def test_insert_length_mismatch_raises(cache, page_size):
    with pytest.raises(ValueError):
        cache.insert(toks(page_size, 1, 2), [1])
    with pytest.raises(ValueError):
        cache.insert(toks(page_size, 1) + [5], [1, 2, 3])
    assert cache.total_size() == 0
    # Empty key is fine and a no-op.
    res = cache.insert([], [])
    assert res.num_cached_tokens == 0 and res.node is cache.root


def test_split_in_middle_of_edge(cache, page_size):
    ps = page_size
    a = cache.insert(toks(ps, 1, 2, 3, 4), [0, 1, 2, 3])
    b = cache.insert(toks(ps, 1, 2, 7), [10, 11, 12])
    assert b.num_cached_tokens == 2 * ps
    cache.check_integrity()
    root_children = list(cache.root.children.values())
    assert len(root_children) == 1
    mid = root_children[0]
    assert len(mid.key) == 2 * ps and [int(p) for p in mid.pages] == [0, 1]
    assert len(mid.children) == 2
    assert a.node.parent is mid and b.node.parent is mid  # old handle survived the split
    assert pages_of(cache.match_prefix(toks(ps, 1, 2, 3, 4))) == [0, 1, 2, 3]
    assert pages_of(cache.match_prefix(toks(ps, 1, 2, 7))) == [0, 1, 12]
    assert cache.total_size() == 5


def test_split_on_match_then_lock_protects_only_matched(cache, page_size):
    ps = page_size
    cache.insert(toks(ps, 1, 2, 3, 4), [0, 1, 2, 3])
    m = cache.match_prefix(toks(ps, 1, 2, 9))
    assert pages_of(m) == [0, 1]
    cache.lock(m.node)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    assert sorted(cache.evict(100)) == [2, 3]
    assert cache.total_size() == 2 and cache.protected_size() == 2
    cache.unlock(m.node)
    assert sorted(cache.evict(100)) == [0, 1]
    assert cache.total_size() == 0


def test_lock_prevents_eviction_unlock_allows(cache, page_size):
    ps = page_size
    r1 = cache.insert(toks(ps, 1, 2), [0, 1])
    cache.insert(toks(ps, 5, 6), [2, 3])
    cache.lock(r1.node)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    cache.check_integrity()
    assert sorted(cache.evict(10)) == [2, 3]  # only the unlocked leaf goes
    assert cache.evict(10) == []
    assert pages_of(cache.match_prefix(toks(ps, 1, 2))) == [0, 1]
    # Lock twice, unlock once: still protected.
    cache.lock(r1.node)
    cache.unlock(r1.node)
    assert cache.evict(10) == []
    cache.unlock(r1.node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 2
    assert sorted(cache.evict(1)) == [0, 1]


def test_locked_child_protects_ancestors(cache, page_size):
    ps = page_size
    cache.insert(toks(ps, 1, 2), [0, 1])
    deep = cache.insert(toks(ps, 1, 2, 3), [0, 1, 2])
    cache.insert(toks(ps, 1, 2, 4), [0, 1, 3])
    cache.lock(deep.node)
    assert cache.protected_size() == 3
    assert cache.evict(100) == [3]
    assert sorted(cache.all_pages()) == [0, 1, 2]
    cache.unlock(deep.node)


def test_lru_order(cache, page_size):
    ps = page_size
    cache.insert(toks(ps, 1), [0])
    cache.insert(toks(ps, 2), [1])
    cache.insert(toks(ps, 3), [2])
    cache.match_prefix(toks(ps, 1))  # 1 is now the most recent; 2 is the oldest
    assert cache.evict(1) == [1]
    assert cache.evict(1) == [2]
    assert cache.evict(1) == [0]
    assert cache.total_size() == 0


def test_lru_parent_becomes_candidate_after_children(cache, page_size):
    ps = page_size
    cache.insert(toks(ps, 1, 2), [0, 1])
    cache.insert(toks(ps, 1, 3), [0, 2])  # splits: [1] -> {[2], [3]}
    cache.insert(toks(ps, 9), [3])  # newest
    # Oldest leaves [2] and [3] go first, then their parent [1] (its time is the one of [3]'s
    # insert, older than [9]).
    assert cache.evict(1) == [1]
    assert cache.evict(1) == [2]
    assert cache.evict(1) == [0]
    assert cache.evict(1) == [3]


def test_evict_returns_exactly_inserted_pages(cache, page_size):
    ps = page_size
    rng = random.Random(1)
    handed: set[int] = set()
    next_page = 0
    for _ in range(30):
        n = rng.randint(1, 5)
        key = toks(ps, *[rng.randint(0, 3) for _ in range(n)])
        pages = list(range(next_page, next_page + n))
        next_page += n
        res = cache.insert(key, pages)
        handed.update(pages)
        handed.difference_update(res.duplicate_pages)
    cache.check_integrity()
    in_tree = set(cache.all_pages())
    assert in_tree == handed
    evicted: list[int] = []
    while cache.total_size():
        got = cache.evict(3)
        assert got, "evict made no progress with evictable pages left"
        assert not set(got) & set(cache.all_pages()), "evicted page still in tree"
        evicted.extend(got)
        cache.check_integrity()
    assert len(evicted) == len(set(evicted)), "duplicate page in evict output"
    assert set(evicted) == handed


def test_evict_frees_whole_leaves(cache, page_size):
    ps = page_size
    cache.insert(toks(ps, 1, 2, 3, 4), [0, 1, 2, 3])
    assert sorted(cache.evict(1)) == [0, 1, 2, 3]  # may free more than asked
    assert cache.evict(0) == []


def test_double_unlock_raises(cache, page_size):
    r = cache.insert(toks(page_size, 1, 2), [0, 1])
    cache.lock(r.node)
    cache.unlock(r.node)
    with pytest.raises(RuntimeError):
        cache.unlock(r.node)
    with pytest.raises(RuntimeError):
        cache.unlock(cache.root)
    assert cache.protected_size() == 0


def test_stale_handles_raise(cache, page_size):
    r = cache.insert(toks(page_size, 1), [0])
    assert cache.evict(1) == [0]
    with pytest.raises(ValueError):
        cache.lock(r.node)
    r2 = cache.insert(toks(page_size, 2), [1])
    cache.lock(r2.node)
    with pytest.raises(RuntimeError):
        cache.reset()  # locked
    cache.unlock(r2.node)
    assert cache.reset() == [1]
    assert cache.total_size() == 0 and cache.all_pages() == []
    with pytest.raises(ValueError):
        cache.lock(r2.node)
    cache.lock(cache.root)
    cache.unlock(cache.root)


def test_matched_pages_are_read_only(cache, page_size):
    cache.insert(toks(page_size, 1, 2), [0, 1])
    m = cache.match_prefix(toks(page_size, 1))
    with pytest.raises(ValueError):
        m.pages[0] = 7
    assert pages_of(cache.match_prefix(toks(page_size, 1, 2))) == [0, 1]


def test_randomized_page_conservation(cache, page_size):
    """~300 seeded scheduler-like ops; pages are never lost, duplicated or freed while cached."""
    ps = page_size
    rng = random.Random(1234 + ps)
    next_page = 0
    handed_in: set[int] = set()  # every page ever passed to insert (ids are never reused)
    evicted: set[int] = set()
    dup_freed: set[int] = set()
    private_freed: set[int] = set()  # request pages never handed to the tree
    running: list[tuple[list[int], object, list[int]]] = []  # (prompt, locked node, matched pages)
    known_keys: list[list[int]] = []

    def fresh(n: int) -> list[int]:
        nonlocal next_page
        out = list(range(next_page, next_page + n))
        next_page += n
        return out

    def random_key() -> list[int]:
        if known_keys and rng.random() < 0.7:
            base = rng.choice(known_keys)
            cut = rng.randint(0, len(base) // ps) * ps
            key = base[:cut]
        else:
            key = []
        return key + toks(ps, *[rng.randint(0, 2) for _ in range(rng.randint(0, 4))])

    def check() -> None:
        cache.check_integrity()
        tree = cache.all_pages()
        tree_set = set(tree)
        assert len(tree) == len(tree_set)
        assert not tree_set & evicted and not tree_set & dup_freed and not tree_set & private_freed
        assert not evicted & dup_freed
        assert tree_set | evicted | dup_freed == handed_in
        assert cache.total_size() == len(tree)
        for prompt, _node, matched in running:  # locked prefixes are still cached, unchanged
            assert pages_of(cache.match_prefix(prompt))[: len(matched)] == matched

    for _ in range(300):
        op = rng.random()
        if op < 0.3:  # a request arrives: match + lock
            prompt = random_key()
            if ps > 1 and rng.random() < 0.5:
                prompt = prompt + [rng.randint(0, 2)] * rng.randint(1, ps - 1)  # unaligned tail
            m = cache.match_prefix(prompt)
            assert m.num_tokens == len(m.pages) * ps <= len(prompt)
            cache.lock(m.node)
            running.append((prompt, m.node, pages_of(m)))
        elif op < 0.55 and running:  # a request finishes: insert its full sequence, unlock
            prompt, node, matched = running.pop(rng.randrange(len(running)))
            full = prompt + [rng.randint(0, 2) for _ in range(rng.randint(0, 3 * ps))]
            n_pages = len(full) // ps
            own = fresh(max(0, len(full) - len(matched) * ps + ps - 1) // ps)
            # The request owns pages for everything it computed; partial tail page stays private.
            all_pages = matched + own
            key_pages = all_pages[:n_pages]
            tail = all_pages[n_pages:]
            res = cache.insert(full[: n_pages * ps], key_pages)
            handed_in.update(p for p in key_pages if p not in matched)
            assert res.num_cached_tokens >= len(matched) * ps
            assert not set(res.duplicate_pages) & set(matched)
            dup_freed.update(res.duplicate_pages)
            private_freed.update(tail)
            known_keys.append(full[: n_pages * ps])
            cache.unlock(node)
        elif op < 0.7:  # a plain insert with all-fresh pages
            key = random_key()
            pages = fresh(len(key) // ps)
            res = cache.insert(key, pages)
            handed_in.update(pages)
            assert len(res.duplicate_pages) == res.num_cached_tokens // ps
            dup_freed.update(res.duplicate_pages)
            known_keys.append(key)
        elif op < 0.85:  # memory pressure
            want = rng.randint(0, 8)
            before_evictable = cache.evictable_size()
            got = cache.evict(want)
            assert len(got) == len(set(got))
            assert len(got) >= min(want, before_evictable)
            assert cache.evictable_size() == before_evictable - len(got)
            assert not set(got) & evicted
            evicted.update(got)
        else:  # a lookup only
            m = cache.match_prefix(random_key())
            assert m.num_tokens == len(m.pages) * ps
        check()

    for _prompt, node, _matched in running:
        cache.unlock(node)
    running.clear()
    assert cache.protected_size() == 0
    evicted.update(cache.evict(cache.total_size() + 1))
    assert cache.total_size() == 0
    check()
    assert evicted | dup_freed == handed_in
