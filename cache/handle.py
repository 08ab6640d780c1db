"""Opaque per-request KV allocations handed out by ``KVManager`` (vLLM's ``KVCacheBlocks``,
mini-sglang's cache handle).

A scheduler keeps one ``KVHandle`` per request and reads ``pages`` (its block-table row); only
``KVManager`` creates, grows and empties handles. Each pool a model uses has its own
``PoolPages`` inside the handle: today the full-attention pool (``full``); a sliding-window pool
adds a second ``PoolPages`` with its own allocator and radix lock, and the per-pool invariant
checks iterate over the handles' pools the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class PoolPages:
    """A request's pages in one pool: page ``j`` holds tokens ``[j*P, (j+1)*P)``.

    The first ``num_shared`` pages belong to the radix cache (read-only for this request, kept
    alive by the lock on ``node``); the rest (``own``) are owned by the request alone.
    """

    pages: list[int] = field(default_factory=list)
    num_shared: int = 0
    node: object | None = None

    @property
    def own(self) -> list[int]:
        return self.pages[self.num_shared:]

    def clear(self) -> None:
        self.pages, self.num_shared, self.node = [], 0, None


@dataclass(eq=False)
class KVHandle:
    """One request's KV allocation. ``cached_tokens``: tokens its radix match gave it at admission
    (they needed no compute and no transfer). Empty (no pages, no lock) after ``KVManager.free``."""

    full: PoolPages = field(default_factory=PoolPages)
    cached_tokens: int = 0

    @property
    def pages(self) -> list[int]:
        """Full-pool page ids covering the request's tokens, in order."""
        return self.full.pages

    @property
    def empty(self) -> bool:
        return not self.full.pages and self.full.node is None
