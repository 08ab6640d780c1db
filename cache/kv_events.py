"""A radix cache's page events, recorded for whoever publishes them (the worker's KV event feed).

``KvEventLog`` is attached to a ``RadixCache`` (``tree.events = KvEventLog(page_size)``); the tree
calls it whenever pages enter or leave it:

* ``stored``: a new edge was inserted: the chained hashes (``cache.page_hash``) of its pages;
* ``removed``: a leaf was evicted: the hashes of its pages;
* ``cleared``: ``reset()`` dropped everything.

Only the full pool is reported (``POOL``): an SWA tree's tombstones keep the node and its full KV,
so a prefix the index reports may still be matched shorter by the worker (its window gone); the
router's cost then overestimates the hit, never the reverse for full-attention models.

``take()`` hands over and forgets the recorded events, in order. ``tree_hashes(tree)`` lists the
hash of every page the tree holds (the snapshot a router re-syncs from). Hashing costs one BLAKE2b
per page on the path of each inserted or evicted edge; nothing here allocates KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from cache.page_hash import ROOT_HASH, page_hashes

POOL = "full"


class KvEventKind(str, Enum):
    """What happened to the pages of one event."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True)
class KvEvent:
    """Pages that entered (``STORED``) or left (``REMOVED``) the tree, by chained hash, in path
    order; ``CLEARED`` carries none (every page left)."""

    kind: KvEventKind
    hashes: tuple[int, ...] = ()


class KvEventLog:
    """Events of one tree since the last ``take()`` (see the module docstring). Not thread safe:
    the scheduler thread that owns the tree also takes the events."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._pending: list[KvEvent] = []

    def stored(self, path_tokens: tuple, first_new_page: int) -> None:
        """The pages of ``path_tokens`` (a root-to-leaf key) from ``first_new_page`` on are new."""
        hashes = page_hashes(path_tokens, self.page_size)[first_new_page:]
        if hashes:
            self._pending.append(KvEvent(KvEventKind.STORED, tuple(hashes)))

    def removed(self, path_tokens: tuple, n_pages: int) -> None:
        """The last ``n_pages`` pages of ``path_tokens`` (a root-to-leaf key) left the tree."""
        hashes = page_hashes(path_tokens, self.page_size)
        if n_pages:
            self._pending.append(KvEvent(KvEventKind.REMOVED, tuple(hashes[-n_pages:])))

    def cleared(self) -> None:
        """Every page left the tree (earlier pending events are moot)."""
        self._pending = [KvEvent(KvEventKind.CLEARED)]

    def take(self) -> list[KvEvent]:
        """The events recorded since the last call, oldest first; forgets them."""
        out, self._pending = self._pending, []
        return out


def path_key(node) -> tuple:
    """The token key from the root down to ``node`` (a ``TreeNode`` still attached to its tree)."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def tree_hashes(tree) -> list[int]:
    """The chained hash of every page ``tree`` (a ``RadixCache``) holds, parents before children."""
    out: list[int] = []
    stack = [(child, ROOT_HASH) for child in tree.root.children.values()]
    while stack:
        node, parent = stack.pop()
        hashes = page_hashes(node.key, tree.page_size, parent)
        out.extend(hashes)
        stack.extend((c, hashes[-1]) for c in node.children.values())
    return out
