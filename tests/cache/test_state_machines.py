"""Hypothesis state machines over the KV manager (page allocator + radix cache) and the host pool.

After every operation: free + used + cached == total, no page owned twice, and (the part a
unit test rarely reaches) every page the radix cache hands out holds exactly the tokens it was
matched for: a shadow of the pool records which tokens each page's KV was written for.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from cache.host_pool import HostKV, HostKVPool
from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from cache.page_count import PageCount
from cache.swa_window import SWAWindow

PAGE = 4
NUM_PAGES = 24
# a small vocabulary over short prompts makes shared prefixes (and so cache hits) common
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=40)
SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)


class Live:
    """One request: its handle and the tokens its KV covers so far (``kv_tokens``)."""

    def __init__(self, handle, tokens: list[int]) -> None:
        self.handle, self.tokens = handle, tokens


class KVManagerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(PageAllocator(NUM_PAGES), PAGE, enable_radix_cache=True)
        self.live: list[Live] = []
        self.shadow: dict[int, tuple[int, ...]] = {}  # page -> tokens its KV was computed for

    def _write(self, r: Live, start_token: int) -> None:
        """The forward pass: pages from ``start_token``'s page on get ``r``'s tokens."""
        for i in range(start_token // PAGE, self.kv.pages_for(len(r.tokens))):
            self.shadow[r.handle.pages[i]] = tuple(r.tokens[i * PAGE : (i + 1) * PAGE])

    @rule(target=requests, tokens=TOKENS, extra=st.integers(0, 4))
    def admit(self, tokens, extra):
        return self._admit(tokens, extra)

    @rule(target=requests, r=requests)
    def admit_the_same_prompt_again(self, r):
        # the same prompt while the first copy still runs: both own their pages, and the second to
        # finish brings duplicates of cached pages that must go back to the allocator
        return self._admit(list(r.tokens), 0) if r in self.live else None

    def _admit(self, tokens, extra):
        got = self.kv.reserve_prompt(tokens, len(tokens), PageCount(extra), budget=PageCount(NUM_PAGES))
        if got is None:
            return None
        handle, charged = got
        assert handle.cached_tokens % PAGE == 0 and handle.cached_tokens < len(tokens)
        for i, p in enumerate(handle.pages[: handle.cached_tokens // PAGE]):
            assert self.shadow[p] == tuple(tokens[i * PAGE : (i + 1) * PAGE]), "the cache gave a page of other tokens"
        assert charged == PageCount(self.kv.pages_for(len(tokens)) - handle.cached_tokens // PAGE + extra)
        r = Live(handle, list(tokens))
        self._write(r, handle.cached_tokens)
        self.live.append(r)
        return r

    @rule(r=requests, new=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def decode(self, r, new):
        if r not in self.live:
            return
        start = len(r.tokens)
        if self.kv.ensure_pages(r.handle, start + len(new)):
            r.tokens += new
            self._write(r, start)

    @rule(r=consumes(requests))
    def finish(self, r):
        if r in self.live:
            self.live.remove(r)
            self.kv.free_into_cache(r.handle, r.tokens)
            assert r.handle.empty

    @rule(r=consumes(requests))
    def abort(self, r):
        if r in self.live:
            self.live.remove(r)
            self.kv.free(r.handle)
            assert r.handle.empty

    @rule(n=st.integers(1, NUM_PAGES))
    def evict(self, n):
        before = self.kv.allocator.num_free()
        self.kv.evict(n)
        u = self.kv.usage([r.handle for r in self.live])
        assert u.free >= min(n, before + u.evictable) or u.evictable == 0

    @invariant()
    def pool_accounting(self):
        self.kv.check_integrity([r.handle for r in self.live])

    def teardown(self):
        for r in self.live:
            self.kv.free(r.handle)
        self.kv.check_integrity([])
        self.kv.evict(NUM_PAGES)
        assert self.kv.allocator.num_free() == NUM_PAGES


class HostPoolMachine(RuleBasedStateMachine):
    """Offload device pages to the host pool and load them back into other pages: bytes survive."""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.zeros(NUM_PAGES, 2, 3)
        self.host = HostKVPool(10, (2, 3), torch.float32, pinned=False)
        self.kept: dict[int, tuple[HostKV, torch.Tensor]] = {}
        self.stamp = 0.0

    @precondition(lambda self: self.host.num_free() > 0)
    @rule(target=held, pages=st.lists(st.integers(0, NUM_PAGES - 1), min_size=1, max_size=6, unique=True))
    def offload(self, pages):
        if not self.host.can_hold(len(pages)):
            return None
        self.stamp += 1
        self.device[pages] = torch.arange(len(pages) * 6, dtype=torch.float32).view(-1, 2, 3) + 100 * self.stamp
        kv = self.host.offload(self.device, pages, len(pages) * PAGE)
        self.kept[id(kv)] = (kv, self.device[pages].clone())
        self.device[pages] = -1.0  # the device pages are reused by someone else
        return kv

    @rule(kv=consumes(held), pages=st.permutations(list(range(NUM_PAGES))))
    def load(self, kv, pages):
        if kv is None or id(kv) not in self.kept:
            return
        kv, expect = self.kept.pop(id(kv))
        dst = pages[: len(kv.pages)]
        self.host.load(self.device, kv, dst)
        assert torch.equal(self.device[dst], expect) and kv.pages == []

    @rule(kv=consumes(held))
    def drop(self, kv):
        if kv is not None and id(kv) in self.kept:
            self.host.free(self.kept.pop(id(kv))[0])

    @invariant()
    def host_accounting(self):
        self.host.check_integrity([kv for kv, _ in self.kept.values()])


TestKVManager = KVManagerMachine.TestCase
TestKVManager.settings = SETTINGS
TestHostPool = HostPoolMachine.TestCase
TestHostPool.settings = SETTINGS


WINDOW = 6  # a window of 6 tokens over pages of 4: matches need 2 pages of SWA KV before them


class SWAKVManagerMachine(KVManagerMachine):
    """The same rules over a sliding-window hybrid's two pools, plus window releases and SWA
    evictions: per-pool accounting, per-pool lock balance (``check_integrity`` of the SWA tree),
    and every SWA page the cache hands out holds the tokens it was matched for."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(PageAllocator(NUM_PAGES), PAGE, True, PageAllocator(NUM_PAGES), SWAWindow(WINDOW, PAGE))
        self.swa_shadow: dict[int, tuple[int, ...]] = {}

    def _write(self, r: Live, start_token: int) -> None:
        super()._write(r, start_token)
        swa = r.handle.swa.pages
        for i in range(start_token // PAGE, self.kv.pages_for(len(r.tokens))):
            assert swa[i] >= 0, "a page being computed has no SWA page"
            self.swa_shadow[swa[i]] = tuple(r.tokens[i * PAGE : (i + 1) * PAGE])

    def _admit(self, tokens, extra):
        got = self.kv.reserve_prompt(tokens, len(tokens), PageCount(extra), budget=self.kv.available())
        if got is None:
            return None
        handle, _ = got
        swa = handle.swa
        needed = self.kv.window.needed_from(handle.cached_tokens) // PAGE
        for i in range(needed, swa.num_shared):  # the window of the match is resident and right
            assert swa.pages[i] >= 0 and self.swa_shadow[swa.pages[i]] == tuple(tokens[i * PAGE : (i + 1) * PAGE])
        r = Live(handle, list(tokens))
        self._write(r, handle.cached_tokens)
        self.live.append(r)
        return r

    @rule(r=KVManagerMachine.requests)
    def slide_window(self, r):
        if r in self.live:
            self.kv.release_window(r.handle, len(r.tokens))

    @rule(n=st.integers(1, NUM_PAGES))
    def evict_swa(self, n):
        self.kv.evict_swa(n)

    def teardown(self):
        super().teardown()
        assert self.kv.swa_allocator.num_free() == NUM_PAGES


TestSWAKVManager = SWAKVManagerMachine.TestCase
TestSWAKVManager.settings = SETTINGS
