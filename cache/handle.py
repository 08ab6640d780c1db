"""Opaque per-request KV allocations handed out by ``KVManager`` (vLLM's ``KVCacheBlocks``,
mini-sglang's cache handle).

A scheduler keeps one ``KVHandle`` per request and reads ``pages`` (its block-table row); only
``KVManager`` creates, grows and empties handles. Each pool a model uses has its own
``PoolPages`` inside the handle: the full-attention pool (``full``) and, for sliding-window
hybrids, the SWA pool (``swa``). ``swa.pages`` is indexed like ``full.pages`` (entry ``j`` holds
tokens ``[j*P, (j+1)*P)`` of the SWA layers) and holds ``NO_PAGE`` where that KV is not resident
(outside every window this request can still read, or never needed). Both pools share one radix
node; the shared SWA entries that are not ``NO_PAGE`` are the ones the request holds SWA locks on.
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
        """Pages owned by the request alone (``NO_PAGE`` entries skipped)."""
        return [p for p in self.pages[self.num_shared :] if p >= 0]

    def clear(self) -> None:
        self.pages, self.num_shared, self.node = [], 0, None


@dataclass(eq=False)
class KVHandle:
    """One request's KV allocation. ``cached_tokens``: tokens its radix match gave it at admission
    (they needed no compute and no transfer). Empty (no pages, no lock) after ``KVManager.free``."""

    full: PoolPages = field(default_factory=PoolPages)
    swa: PoolPages | None = None
    cached_tokens: int = 0

    @property
    def pages(self) -> list[int]:
        """Full-pool page ids covering the request's tokens, in order."""
        return self.full.pages

    @property
    def swa_pages(self) -> list[int] | None:
        """SWA-pool page ids by logical page (``NO_PAGE`` where not resident), or None."""
        return self.swa.pages if self.swa is not None else None

    @property
    def empty(self) -> bool:
        return not self.full.pages and self.full.node is None and not (self.swa and self.swa.pages)
