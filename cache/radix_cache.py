"""Paged radix (prefix) cache: reuse KV pages across requests that share a token prefix.

The tree maps token-id sequences to the KV pages that hold their keys/values. It never
allocates or frees memory itself; it only records page ids handed to it and hands page ids back.

Granularity
    Everything is stored in whole pages of ``page_size`` tokens. An edge holds a token tuple whose
    length is a multiple of ``page_size`` and one page id per ``page_size`` tokens. Nodes are split
    only on page boundaries, and children are keyed by their first page of tokens, so two children
    of one node never start with the same page. ``match_prefix`` accepts any length and matches
    whole pages only (a trailing partial page is never matched).

Page ids
    Stored internally as ``numpy.int32`` arrays, one per edge. ``match_prefix`` returns a
    ``numpy.ndarray[int32]`` (cheap to turn into a tensor); ``evict``, ``all_pages``, ``reset`` and
    ``InsertResult.duplicate_pages`` return ``list[int]`` (handed to the allocator's free list).
    Inputs may be any int sequence (list, tuple, numpy array, tensor).

Page ownership
    * Pages passed to ``insert`` for the part of the key that was *not* yet cached become owned by
      the tree.
    * For the part that was already cached (``InsertResult.num_cached_tokens`` tokens) the tree
      keeps its own pages. Any caller page in that prefix that differs from the tree's page at the
      same position is a duplicate that the caller still owns and must free; they are listed in
      ``InsertResult.duplicate_pages``. Caller pages equal to the tree's page (the usual case: the
      caller got them from ``match_prefix`` and kept the match locked) are shared, not duplicates,
      and must not be freed.
    * Pages returned by ``evict`` (and by ``reset``) leave the tree; the caller must free them.
    * Pages returned by ``match_prefix`` stay owned by the tree. The caller may read them, but they
      are only guaranteed to survive while the returned node is locked.

Locking
    ``lock(node)`` adds one reference to ``node`` and every ancestor up to and including the root;
    ``unlock(node)`` removes it. A node with a non-zero reference count is never evicted (nor, as a
    consequence, is any of its ancestors). Every ``lock`` must be paired with exactly one
    ``unlock`` of the same node; unlocking below zero raises ``RuntimeError``. Node handles stay
    valid across splits (a split inserts a new parent above the handle's node, which inherits the
    handle's reference count). Locking an evicted node, or a node from before ``reset``, raises
    ``ValueError``. ``lock(root)`` is allowed and protects nothing (the root holds no pages).

Eviction order
    ``evict(n)`` removes unlocked leaves in least-recently-used order (last access = last
    ``match_prefix``/``insert`` whose path went through the node; ties broken by creation order).
    When a parent loses its last child it becomes a leaf candidate with its own access time. Whole
    leaves are evicted (no splitting), so it may free more than ``n`` pages; it frees fewer only
    when nothing evictable remains.

Sizes are counted in pages: ``protected_size()`` (pages in locked nodes) + ``evictable_size()``
(pages in unlocked nodes) == ``total_size()``.

Not thread safe: the scheduler owns the cache and calls it from one thread.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from cache.kv_events import KvEventLog, path_key
from cache.radix_node import EMPTY_PAGES, InsertResult, MatchResult, TreeNode, as_pages, as_tokens

__all__ = ["RadixCache", "TreeNode", "MatchResult", "InsertResult", "held_elsewhere"]


class RadixCache:
    """Radix tree over token ids whose edges carry KV page ids. See the module docstring."""

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._epoch = 0
        self._next_id = 0
        self._clock = 0
        self.events: KvEventLog | None = None  # set by a worker that publishes its cache (KV events)
        self._init_tree()

    # ------------------------------------------------------------------ internals
    def _init_tree(self) -> None:
        self._epoch += 1
        self.root = self._new_node((), EMPTY_PAGES, None)
        self._leaves: set[TreeNode] = set()  # non-root nodes without children
        self._total = 0
        self._protected = 0

    def _new_node(self, key: tuple, pages: np.ndarray, parent: TreeNode | None) -> TreeNode:
        node = TreeNode(key, pages, parent, self._next_id, self._epoch, self._clock)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _match_len(self, edge: tuple, key: tuple, start: int) -> int:
        """Page-aligned length of the common prefix of ``edge`` and ``key[start:]``."""
        n = min(len(edge), len(key) - start)
        i = 0
        while i < n and edge[i] == key[start + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: TreeNode, num_tokens: int) -> TreeNode:
        """Split ``child``'s edge after ``num_tokens`` tokens (page aligned, strictly inside).

        A new node takes the first part and becomes ``child``'s parent; ``child`` keeps the rest,
        so existing handles to ``child`` stay valid. The new node inherits the lock count and
        access time (sizes are unchanged: the pages just move between two nodes in the same state).
        """
        ps = self.page_size
        parent = child.parent
        split_pages = num_tokens // ps
        mid = self._new_node(child.key[:num_tokens], child.pages[:split_pages], parent)
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        parent.children[child.key[:ps]] = mid
        child.key = child.key[num_tokens:]
        child.pages = child.pages[split_pages:]
        child.parent = mid
        mid.children[child.key[:ps]] = child
        return mid

    def _walk(self, key: tuple, tick: int) -> tuple[TreeNode, int, list[np.ndarray]]:
        """Follow ``key`` (page-aligned length) as far as the tree goes, splitting a partially
        matched edge. Returns (deepest node, matched tokens, page arrays along the path)."""
        ps = self.page_size
        node = self.root
        node.last_access = tick
        pos = 0
        parts: list[np.ndarray] = []
        while pos < len(key):
            child = node.children.get(key[pos : pos + ps])
            if child is None:
                break
            m = self._match_len(child.key, key, pos)
            # m >= ps: the first page equals the dict key.
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = tick
            parts.append(child.pages)
            node = child
            pos += m
        return node, pos, parts

    def _check_handle(self, node: TreeNode) -> None:
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a TreeNode handle, got {type(node).__name__}")
        if node.epoch != self._epoch:
            raise ValueError("node handle is from before reset()")
        if node.evicted:
            raise ValueError("node handle refers to an evicted node")

    def _remove_leaf(self, node: TreeNode) -> None:
        if self.events is not None:
            self.events.removed(path_key(node), len(node.pages))
        parent = node.parent
        del parent.children[node.key[: self.page_size]]
        self._leaves.discard(node)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        self._total -= len(node.pages)
        node.parent = None
        node.evicted = True

    # ------------------------------------------------------------------ public API
    def match_prefix(self, token_ids: Sequence[int] | np.ndarray) -> MatchResult:
        """Find the longest cached prefix of ``token_ids`` made of whole pages.

        Any length is accepted; a trailing partial page is ignored. If the match ends inside an
        edge, that edge is split so ``node`` covers exactly the matched prefix. The matched path's
        access time is refreshed (LRU). The returned pages stay owned by the tree; lock ``node``
        to keep them from being evicted.
        """
        key = as_tokens(token_ids)
        key = key[: len(key) - len(key) % self.page_size]
        node, num_tokens, parts = self._walk(key, self._tick())
        if not parts:
            pages = EMPTY_PAGES
        elif len(parts) == 1:
            pages = parts[0]
        else:
            pages = np.concatenate(parts)
        return MatchResult(pages=pages, num_tokens=num_tokens, node=node)

    def insert(self, token_ids: Sequence[int] | np.ndarray, pages: Sequence[int] | np.ndarray) -> InsertResult:
        """Insert a page-aligned key with its pages (``len(token_ids) == len(pages) * page_size``,
        else ``ValueError``).

        The tree takes ownership of the pages for the part of the key that was not cached yet.
        For the already-cached prefix (``num_cached_tokens`` tokens) it keeps its own pages; the
        caller's pages there that differ from the tree's are returned in ``duplicate_pages`` and
        must be freed by the caller. ``node`` spells exactly the whole key (lock it to protect the
        inserted pages). The path's access time is refreshed.
        """
        key = as_tokens(token_ids)
        page_arr = as_pages(pages)
        ps = self.page_size
        if len(key) != len(page_arr) * ps:
            raise ValueError(
                f"insert needs len(token_ids) == len(pages) * page_size, got {len(key)} tokens, "
                f"{len(page_arr)} pages, page_size {ps}"
            )
        node, num_cached, parts = self._walk(key, self._tick())
        cached_pages = num_cached // ps
        duplicates: list[int] = []
        if cached_pages:
            tree_pages = parts[0] if len(parts) == 1 else np.concatenate(parts)
            mine = page_arr[:cached_pages]
            duplicates = mine[mine != tree_pages].tolist()
        if num_cached < len(key):
            new_pages = page_arr[cached_pages:].copy()
            new_pages.setflags(write=False)  # match_prefix hands out views of it
            new = self._new_node(key[num_cached:], new_pages, node)
            node.children[new.key[:ps]] = new
            self._leaves.discard(node)
            self._leaves.add(new)
            self._total += len(new.pages)
            if self.events is not None:
                self.events.stored(key, cached_pages)
            # A new leaf under a locked node is itself unlocked: it counts as evictable.
            node = new
        return InsertResult(num_cached_tokens=num_cached, node=node, duplicate_pages=duplicates)

    def lock(self, node: TreeNode) -> None:
        """Add one reference to ``node`` and all its ancestors (root included); locked nodes are
        never evicted. Pair every call with one ``unlock(node)``."""
        self._check_handle(node)
        while node is not None:
            if node.lock_ref == 0:
                self._protected += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Remove one reference from ``node`` and all its ancestors. Raises ``RuntimeError`` if
        ``node`` is not locked (double unlock); nothing is changed in that case."""
        self._check_handle(node)
        if node.lock_ref <= 0:
            raise RuntimeError(f"unlock of a node that is not locked: {node!r}")
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Evict least-recently-used unlocked leaves until at least ``num_pages`` pages are freed
        or nothing evictable remains. Whole leaves are evicted, so more than ``num_pages`` may be
        returned. Returns the freed page ids; the caller must free them to the allocator."""
        freed: list[int] = []
        if num_pages <= 0:
            return freed
        heap = [(n.last_access, n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        root = self.root
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            freed.extend(node.pages.tolist())
            parent = node.parent
            self._remove_leaf(node)
            if parent is not root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def protected_size(self) -> int:
        """Pages held by locked nodes."""
        return self._protected

    def evictable_size(self) -> int:
        """Pages held by unlocked nodes (all of them can be freed by ``evict``)."""
        return self._total - self._protected

    def total_size(self) -> int:
        """Pages held by the tree."""
        return self._total

    def all_pages(self) -> list[int]:
        """Every page id held by the tree (for the "free + in use + cached == total" check)."""
        out: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            out.extend(node.pages.tolist())
            stack.extend(node.children.values())
        return out

    def reset(self) -> list[int]:
        """Drop the whole tree and return the page ids it held (the caller must free them).

        Raises ``RuntimeError`` while any node is locked (a running request still uses cached
        pages). Node handles from before the reset become invalid.
        """
        if self.root.lock_ref:
            raise RuntimeError(f"reset() with {self.root.lock_ref} outstanding lock(s)")
        pages = self.all_pages()
        self._init_tree()
        if self.events is not None:
            self.events.cleared()
        return pages

    def check_integrity(self) -> None:
        """Assert the internal invariants (O(nodes + pages)); raises ``AssertionError``."""
        ps = self.page_size
        root = self.root
        assert root.parent is None and root.key == () and len(root.pages) == 0
        assert root.lock_ref >= 0
        total = protected = 0
        leaves: set[TreeNode] = set()
        seen_pages: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            assert node.epoch == self._epoch and not node.evicted, node
            assert node.lock_ref >= 0, node
            child_refs = 0
            for first, child in node.children.items():
                assert child.parent is node, child
                assert len(first) == ps and child.key[:ps] == first, (first, child)
                assert child.last_access <= node.last_access, (node, child)
                child_refs += child.lock_ref
                stack.append(child)
            assert node.lock_ref >= child_refs, (node, child_refs)
            if node is root:
                continue
            assert len(node.key) > 0 and len(node.key) % ps == 0, node
            assert isinstance(node.pages, np.ndarray) and node.pages.dtype == np.int32, node
            assert len(node.key) == len(node.pages) * ps, node
            n = len(node.pages)
            total += n
            if node.lock_ref > 0:
                protected += n
            if not node.children:
                leaves.add(node)
            for p in node.pages.tolist():
                assert p not in seen_pages, f"page {p} held twice"
                seen_pages.add(p)
        assert total == self._total, (total, self._total)
        assert protected == self._protected, (protected, self._protected)
        assert self.protected_size() + self.evictable_size() == self.total_size()
        assert self.evictable_size() >= 0
        assert leaves == self._leaves, "leaf set out of sync"


def held_elsewhere(tree: RadixCache, node: TreeNode) -> tuple[TreeNode, int]:
    """For a caller holding one lock on ``node`` of ``tree``: the deepest node of its root path
    (``node`` included) that someone else also keeps locked, and the pages from the root through
    it. Those pages stay in the tree whatever the caller does with its own lock. ``(root, 0)`` when
    nobody else holds any of the path. Changes nothing (not even access times)."""
    tree._check_handle(node)
    if node.lock_ref <= 0:
        raise RuntimeError(f"held_elsewhere of a node the caller does not lock: {node!r}")
    while node.parent is not None and node.lock_ref < 2:
        node = node.parent
    held, top = node, 0
    while node is not None:
        top += len(node.pages)
        node = node.parent
    return held, top
