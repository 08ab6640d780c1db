"""Radix-tree value types: the opaque node handle, match and insert results, input coercion.

See ``cache.radix_cache`` for the tree's contract (page ownership, locking, eviction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

EMPTY_PAGES = np.empty(0, dtype=np.int32)
EMPTY_PAGES.setflags(write=False)


class TreeNode:
    """One radix-tree node. Opaque to callers: pass it back to ``lock``/``unlock`` only.

    ``key`` is the token tuple on the edge from the parent, ``pages`` its page ids (int32, one per
    ``page_size`` tokens). The root has an empty key and no pages.
    """

    __slots__ = (
        "children",
        "parent",
        "key",
        "pages",
        "lock_ref",
        "last_access",
        "id",
        "epoch",
        "evicted",
        "swa",
        "swa_ref",
    )

    def __init__(
        self, key: tuple, pages: np.ndarray, parent: TreeNode | None, node_id: int, epoch: int, tick: int
    ) -> None:
        self.children: dict[tuple, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = tick
        self.id = node_id
        self.epoch = epoch
        self.evicted = False
        self.swa: np.ndarray | None = None  # SWA trees: SWA page per page, -1 = tombstone
        self.swa_ref: np.ndarray | None = None  # SWA trees: lock count per page

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, pages={len(self.pages)}, "
            f"lock_ref={self.lock_ref}, children={len(self.children)})"
        )


@dataclass(frozen=True)
class MatchResult:
    """Longest cached page-aligned prefix of a query.

    ``pages``: int32 array of the matched pages in order (owned by the tree).
    ``num_tokens``: ``len(pages) * page_size``.
    ``node``: deepest matched node (root when nothing matched); lock it to keep ``pages`` alive.
    """

    pages: np.ndarray
    num_tokens: int
    node: TreeNode
    swa: np.ndarray | None = None  # SWA trees: the SWA page of each matched page (-1 = tombstone)


@dataclass(frozen=True)
class InsertResult:
    """Outcome of ``insert``.

    ``num_cached_tokens``: length of the key's prefix that was already in the tree (the tree kept
    its own pages for it).
    ``node``: node whose root path spells exactly the inserted key (root for an empty key).
    ``duplicate_pages``: caller pages within that cached prefix that differ from the tree's pages;
    the caller still owns them and must free them.
    """

    num_cached_tokens: int
    node: TreeNode
    duplicate_pages: list[int] = field(default_factory=list)
    duplicate_swa_pages: list[int] = field(default_factory=list)  # SWA trees only


def as_tokens(token_ids: Sequence[int] | np.ndarray) -> tuple:
    if hasattr(token_ids, "tolist"):  # numpy array / torch tensor
        token_ids = token_ids.tolist()
    return tuple(token_ids)


def as_pages(pages: Sequence[int] | np.ndarray) -> np.ndarray:
    if hasattr(pages, "detach"):  # torch tensor
        pages = pages.detach().cpu().numpy()
    return np.array(pages, dtype=np.int32).reshape(-1)
