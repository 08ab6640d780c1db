"""Cache-aware routing's KV events and index: a worker's radix cache, its event log, the wire
messages and the router's ``KvIndex`` agree after any traffic (a hypothesis state machine over the
real ``KVManager``), and the index's sync rules (gaps, restarts, bound) hold."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from cache.kv_events import POOL, KvEventLog, tree_hashes
from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from cache.page_count import PageCount
from cache.page_hash import page_hashes
from cache.radix_cache import RadixCache
from server.router.kv_index import KvIndex
from transfer.wire.protocol import KvEvents, KvSnapshot, decode, encode, frame_hashes, hashes_frame

PAGE = 4
NUM_PAGES = 24
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=40)


class Feed:
    """A worker's feed without the socket: the tree's events as encoded ``KvEvents``/``KvSnapshot``."""

    def __init__(self, tree, instance: str = "i1") -> None:
        self.tree, self.instance, self.seq = tree, instance, 0
        tree.events = KvEventLog(tree.page_size)

    def flush(self) -> list[bytes] | None:
        events = self.tree.events.take()
        if not events:
            return None
        self.seq += 1
        msg = KvEvents(
            worker_id="w",
            instance=self.instance,
            seq=self.seq,
            pool=POOL,
            kinds=[e.kind.value for e in events],
            counts=[len(e.hashes) for e in events],
        )
        return encode(msg, hashes_frame([h for e in events for h in e.hashes]))

    def snapshot(self) -> list[bytes]:
        self.seq += 1
        return encode(
            KvSnapshot(worker_id="w", instance=self.instance, seq=self.seq, pool=POOL),
            hashes_frame(tree_hashes(self.tree)),
        )


def deliver(index: KvIndex, parts: list[bytes]) -> bool:
    """What ``KvSubscriber.on_message`` does with one feed message, keyed by worker "w"."""
    msg, frames = decode(parts)
    if isinstance(msg, KvSnapshot):
        index.apply_snapshot("w", msg.instance, msg.seq, frame_hashes(frames[0]))
        return True
    return index.apply_events("w", msg.instance, msg.seq, msg.unpack(frames[0]))


class FeedMachine(RuleBasedStateMachine):
    """Random admissions, finishes (into the cache), aborts, evictions under pressure and lost feed
    messages; after every step the router's index holds exactly the worker tree's pages."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVManager(PageAllocator(NUM_PAGES), PAGE, enable_radix_cache=True)
        self.feed = Feed(self.kv.tree)
        self.index = KvIndex()
        self.lose_next = False
        deliver(self.index, self.feed.snapshot())

    def _sync(self) -> None:
        parts = self.feed.flush()
        if parts is None:
            return
        if self.lose_next:  # a PUB/SUB drop: the next message shows the gap
            self.lose_next = False
            return
        if not deliver(self.index, parts):
            assert self.index.needs_snapshot("w")
            deliver(self.index, self.feed.snapshot())

    @rule(target=requests, tokens=TOKENS)
    def admit(self, tokens):
        got = self.kv.reserve_prompt(tokens, len(tokens), PageCount(0), budget=PageCount(NUM_PAGES))
        self._sync()
        return (got[0], tokens) if got is not None else None

    @rule(r=consumes(requests))
    def finish(self, r):
        if r is not None:
            self.kv.free_into_cache(r[0], r[1])
            self._sync()

    @rule(r=consumes(requests))
    def abort(self, r):
        if r is not None:
            self.kv.free(r[0])
            self._sync()

    @rule(n=st.integers(1, NUM_PAGES))
    def pressure(self, n):
        self.kv.evict(n)
        self._sync()

    @rule()
    def lose_a_message(self):
        self.lose_next = True

    @rule()
    def heartbeat(self):
        """The worker's stats report its feed's seq; the router, past its grace, finds it behind."""
        if self.index.seq("w") < self.feed.seq:
            self.index.mark_lost("w")
            deliver(self.index, self.feed.snapshot())

    def _current(self) -> bool:
        """The index saw every message the feed sent (else a heartbeat or the next message tells)."""
        return not self.index.needs_snapshot("w") and self.index.seq("w") == self.feed.seq

    @invariant()
    def index_equals_tree(self):
        if self._current():
            assert self.index.held("w") == frozenset(tree_hashes(self.kv.tree))

    @rule(tokens=TOKENS)
    def longest_prefix_agrees(self, tokens):
        if not self._current():
            return
        want = self.kv.tree.match_prefix(tokens).num_tokens // PAGE
        assert self.index.cached_pages("w", page_hashes(tokens, PAGE)) == want


FeedMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_index_matches_the_worker_radix_cache = FeedMachine.TestCase


def test_page_hashes_chain_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    c = page_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a == b  # the partial page has no hash
    assert c[0] != a[0] and c[1] != a[1]  # same second page, another prefix: another hash
    assert all(0 <= h < 1 << 63 for h in a)


def test_reset_clears_and_split_publishes_nothing_new():
    tree = RadixCache(4)
    feed = Feed(tree)
    tree.insert(list(range(8)), [0, 1])
    assert [e.kind.value for e in tree.events.take()] == ["stored"]
    tree.match_prefix(list(range(4)))  # splits the edge: same pages, same hashes
    assert tree.events.take() == []
    tree.reset()
    assert [(e.kind.value, e.hashes) for e in tree.events.take()] == [("cleared", ())]
    assert feed.flush() is None


def _index_with(hashes, seq=1, instance="i1", max_pages=100) -> KvIndex:
    index = KvIndex(max_pages)
    index.apply_snapshot("w", instance, seq, hashes)
    return index


def test_a_gap_drops_the_worker_until_a_snapshot():
    index = _index_with([11, 12])
    assert index.apply_events("w", "i1", 2, [("stored", [13])]) and index.cached_pages("w", [11, 12, 13]) == 3
    assert index.apply_events("w", "i1", 2, [("removed", [13])])  # a repeat of an applied seq: ignored
    assert index.cached_pages("w", [11, 12, 13]) == 3
    assert not index.apply_events("w", "i1", 4, [("removed", [13])])  # seq 3 went missing
    assert index.needs_snapshot("w") and index.cached_pages("w", [11]) == 0 and index.counters.gaps == 1
    assert not index.apply_events("w", "i1", 5, [("stored", [14])])  # still ignored until the snapshot
    index.apply_snapshot("w", "i1", 5, [11, 14])
    assert index.cached_pages("w", [11, 14]) == 2 and index.counters.snapshots == 2


def test_a_new_process_starts_over():
    index = _index_with([11, 12])
    assert not index.apply_events("w", "i2", 1, [("stored", [21])])
    assert index.needs_snapshot("w") and index.size("w") == 0 and index.workers["w"].instance == "i2"


def test_memory_is_bounded_and_only_shortens_matches():
    index = _index_with([1, 2, 3], max_pages=4)
    assert index.apply_events("w", "i1", 2, [("stored", [4, 5])])
    assert index.size("w") == 4 and index.counters.dropped == 1
    assert index.cached_pages("w", [1, 2, 3]) == 0  # the oldest went: an underestimate, never more


def test_snapshot_kinds_unpack_and_refuse_a_mismatch():
    msg = KvEvents(worker_id="w", instance="i", seq=1, pool=POOL, kinds=["stored", "removed"], counts=[2, 1])
    assert decode(encode(msg, hashes_frame([1, 2, 3])))[0].unpack(hashes_frame([1, 2, 3])) == [
        ("stored", [1, 2]),
        ("removed", [3]),
    ]
    with pytest.raises(ValueError, match="do not match"):
        msg.unpack(hashes_frame([1]))
