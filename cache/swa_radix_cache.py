"""Radix cache for sliding-window hybrids: full KV shared across requests, SWA KV with a shorter life.

Each page of an edge carries a full-pool page (as in ``RadixCache``) and an SWA-pool page, or a
tombstone (``-1``) where that SWA KV is gone. Full KV lives as long as the node; SWA KV only as
long as it can still be inside someone's window: requests insert tombstones for the pages they
freed while decoding, and ``evict_swa`` turns the least recently used unlocked SWA pages into
tombstones when the SWA pool runs short (the node and its full KV stay).

Matching: ``match_prefix`` returns the longest page-aligned prefix whose *window* is resident
(``SWAWindow.window_resident``): a request can only start after a prefix if the keys its first
query reads are there. Inserting a request's resident SWA page where the tree holds a
tombstone revives it (the tree takes the page).

Locking, per pool: ``lock(node, swa_from)`` takes the full lock on the whole path (as
``RadixCache.lock``) and one SWA reference on every resident SWA page of the path at page index
``>= swa_from``, and returns those pages; ``unlock(node, them)`` gives exactly those back
(resident pages with a reference cannot become tombstones, a revived tombstone was not among
them, and splits slice the per-page counts). Pages with SWA references are never tombstoned; SWA
references only exist under a full lock. Sizes: ``swa_total_size() == swa_protected_size() +
swa_evictable_size()``, counted in SWA pages.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from cache.radix_cache import RadixCache
from cache.radix_node import EMPTY_PAGES, InsertResult, MatchResult, TreeNode, as_pages, as_tokens
from cache.swa_window import SWAWindow


class SWARadixCache(RadixCache):
    def __init__(self, page_size: int, window: SWAWindow) -> None:
        self.window = window
        self._swa_total = 0
        self._swa_protected = 0
        self._swa_evicted: list[int] = []
        super().__init__(page_size)

    # ---- node bookkeeping ------------------------------------------------------------------
    def _new_node(self, key: tuple, pages: np.ndarray, parent: TreeNode | None) -> TreeNode:
        node = super()._new_node(key, pages, parent)
        node.swa = np.full(len(pages), -1, dtype=np.int32)
        node.swa_ref = np.zeros(len(pages), dtype=np.int32)
        return node

    def _split(self, child: TreeNode, num_tokens: int) -> TreeNode:
        k = num_tokens // self.page_size
        swa, ref = child.swa, child.swa_ref
        mid = super()._split(child, num_tokens)
        mid.swa, child.swa = swa[:k].copy(), swa[k:].copy()
        mid.swa_ref, child.swa_ref = ref[:k].copy(), ref[k:].copy()
        return mid

    def _remove_leaf(self, node: TreeNode) -> None:
        resident = node.swa[node.swa >= 0]
        self._swa_evicted.extend(resident.tolist())
        self._swa_total -= len(resident)
        super()._remove_leaf(node)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """Root-first list of the nodes from the root's child down to ``node``."""
        path = []
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    # ---- matching and inserting --------------------------------------------------------------
    def match_prefix(self, token_ids) -> MatchResult:
        """Longest cached page-aligned prefix whose window is resident; see the module docstring."""
        m = super().match_prefix(token_ids)
        swa = _concat_swa(self._path(m.node))
        k = self.window.longest_resident_match((swa >= 0).tolist())
        if k < len(m.pages):
            key = as_tokens(token_ids)[: k * self.page_size]
            m = super().match_prefix(key)  # splits at the shorter boundary
            swa = swa[:k]
        return MatchResult(pages=m.pages, num_tokens=m.num_tokens, node=m.node, swa=swa)

    def insert(self, token_ids, pages, swa_pages: Sequence[int] | np.ndarray = ()) -> InsertResult:
        """``RadixCache.insert`` plus one SWA entry per page (-1 where the caller freed it). The
        tree takes the caller's resident SWA pages of the new part; in the cached part, caller
        SWA pages that are not the tree's own are listed in ``duplicate_swa_pages`` to free."""
        swa_arr = as_pages(swa_pages)
        if len(swa_arr) != len(as_pages(pages)):
            raise ValueError(f"insert needs one SWA entry per page, got {len(swa_arr)} for {len(as_pages(pages))}")
        res = super().insert(token_ids, pages)
        cached = res.num_cached_tokens // self.page_size
        path = self._path(res.node)
        if cached < len(swa_arr):  # res.node is the new leaf holding pages [cached, n)
            res.node.swa = swa_arr[cached:].copy()
            self._swa_total += int((res.node.swa >= 0).sum())
            path = path[:-1]
        self._revive(path, swa_arr[:cached])
        tree_swa = _concat_swa(path)[:cached]
        mine = swa_arr[:cached]
        dup = mine[(mine >= 0) & (mine != tree_swa)].tolist()
        return dataclasses.replace(res, duplicate_swa_pages=dup)

    def _revive(self, path: list[TreeNode], mine: np.ndarray) -> None:
        """The tree takes the caller's resident SWA pages where it holds tombstones (nobody has an
        SWA reference on a tombstone, and unlocks only touch the pages that were locked)."""
        start = 0
        for n in path:
            w = mine[start : start + len(n.swa)]
            take = np.nonzero((n.swa[: len(w)] < 0) & (w >= 0))[0]
            n.swa[take] = w[take]
            self._swa_total += len(take)
            start += len(n.swa)

    # ---- locking ---------------------------------------------------------------------------
    def _swa_refs(self, node: TreeNode, wanted: np.ndarray, delta: int) -> None:
        """Add ``delta`` to the SWA references of the path's pages ``j`` with ``wanted[j] >= 0``
        (each must be the tree's page there)."""
        start = 0
        for n in self._path(node):
            w = wanted[start : start + len(n.swa)]
            sel = np.nonzero(w >= 0)[0]
            if len(sel):
                if (n.swa[sel] != w[sel]).any():
                    raise RuntimeError(f"SWA (un)lock of pages the tree does not hold there: {n!r}")
                if delta < 0 and (n.swa_ref[sel] <= 0).any():
                    raise RuntimeError(f"SWA unlock of pages that are not locked: {n!r}")
                before = n.swa_ref[sel] > 0
                n.swa_ref[sel] += delta
                self._swa_protected += int((n.swa_ref[sel] > 0).sum()) - int(before.sum())
            start += len(n.swa)

    def lock(self, node: TreeNode, swa_from: int | None = None) -> np.ndarray | None:
        """Full lock on the path; with ``swa_from``, one SWA reference on each resident page from
        that page index on. Returns those SWA pages by page index (-1 where none was locked):
        pass them back to ``unlock``."""
        super().lock(node)
        if swa_from is None:
            return None
        wanted = _concat_swa(self._path(node)).copy()
        wanted[:swa_from] = -1
        self._swa_refs(node, wanted, +1)
        return wanted

    def unlock(self, node: TreeNode, swa_locked: Sequence[int] | np.ndarray | None = None) -> None:
        """Exactly undo ``lock``: ``swa_locked`` is what it returned."""
        if swa_locked is not None:
            self._check_handle(node)
            self._swa_refs(node, as_pages(swa_locked), -1)
        super().unlock(node)

    # ---- eviction --------------------------------------------------------------------------
    def evict_full(self, num_pages: int) -> tuple[list[int], list[int]]:
        """``RadixCache.evict`` of whole leaves; returns ``(full pages, SWA pages)`` they held."""
        full = super().evict(num_pages)
        swa, self._swa_evicted = self._swa_evicted, []
        return full, swa

    def evict(self, num_pages: int) -> list[int]:
        raise TypeError("an SWA radix cache frees two pools: use evict_full() or evict_swa()")

    def evict_swa(self, num_pages: int) -> list[int]:
        """Tombstone unlocked SWA pages, least recently used nodes first, until ``num_pages``
        are freed or none is left; returns them (the caller frees them to the SWA allocator)."""
        heap = [(n.last_access, n.id, n) for n in _descendants(self.root) if ((n.swa >= 0) & (n.swa_ref == 0)).any()]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, n = heapq.heappop(heap)
            sel = (n.swa >= 0) & (n.swa_ref == 0)
            freed.extend(n.swa[sel].tolist())
            n.swa[sel] = -1
        self._swa_total -= len(freed)
        return freed

    # ---- sizes and checks ---------------------------------------------------------------------
    def swa_total_size(self) -> int:
        return self._swa_total

    def swa_protected_size(self) -> int:
        return self._swa_protected

    def swa_evictable_size(self) -> int:
        return self._swa_total - self._swa_protected

    def all_swa_pages(self) -> list[int]:
        return [p for n in _descendants(self.root) for p in n.swa.tolist() if p >= 0]

    def reset(self) -> list[int]:
        raise TypeError("an SWA radix cache frees two pools: evict_full(total_size()) instead")

    def check_integrity(self) -> None:
        super().check_integrity()
        total = protected = 0
        for n in _descendants(self.root):
            assert len(n.swa) == len(n.pages) == len(n.swa_ref), n
            assert (n.swa_ref >= 0).all() and not (n.swa_ref[n.swa < 0] > 0).any(), n
            assert n.lock_ref > 0 or not n.swa_ref.any(), f"SWA reference without a full lock: {n!r}"
            total += int((n.swa >= 0).sum())
            protected += int(((n.swa >= 0) & (n.swa_ref > 0)).sum())
        pages = self.all_swa_pages()
        assert len(set(pages)) == len(pages), "an SWA page is held twice by the tree"
        assert (total, protected) == (self._swa_total, self._swa_protected), (total, protected)


def _concat_swa(path: list[TreeNode]) -> np.ndarray:
    return np.concatenate([n.swa for n in path]) if path else EMPTY_PAGES


def _descendants(root: TreeNode) -> list[TreeNode]:
    out, stack = [], list(root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out
