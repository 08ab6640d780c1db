"""Page allocator for one paged KV pool.

Contract: every page id in ``[0, num_pages)`` is at any time either free (in this allocator) or
allocated (owned by exactly one holder: a request or the radix cache). ``alloc`` hands out the
lowest free ids first so a request's pages tend to form contiguous runs (a transfer backend merges
adjacent pages into one descriptor). Double free and freeing an unknown id raise: they are bugs.
"""

from __future__ import annotations

import numpy as np


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (pages for ``a`` tokens at ``b`` tokens a page)."""
    return -(-a // b)


class OutOfPages(RuntimeError):
    """Raised by ``alloc`` when fewer pages are free than requested (nothing is allocated)."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._allocated = np.zeros(num_pages, dtype=bool)
        self._free: list[int] = list(range(num_pages))
        self._sorted = True

    def num_free(self) -> int:
        return len(self._free)

    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Return ``n`` page ids (lowest free first). Raises ``OutOfPages`` without side effects."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        if not self._sorted:
            self._free.sort()
            self._sorted = True
        pages, self._free = self._free[:n], self._free[n:]
        self._allocated[pages] = True
        return pages

    def free(self, pages) -> None:
        """Return pages to the pool. Every id must currently be allocated (else ValueError)."""
        pages = [int(p) for p in pages]
        if not pages:
            return
        idx = np.asarray(pages, dtype=np.int64)
        if idx.min() < 0 or idx.max() >= self.num_pages:
            raise ValueError(f"page id out of range [0, {self.num_pages}): {pages}")
        if not self._allocated[idx].all() or len(set(pages)) != len(pages):
            raise ValueError(f"double free of pages {[p for p in pages if not self._allocated[p]]}")
        self._allocated[idx] = False
        self._free.extend(pages)
        self._sorted = False

    def check_integrity(self) -> None:
        """Assert free + used == total with no page both free and allocated."""
        free = np.asarray(self._free, dtype=np.int64)
        assert len(set(self._free)) == len(self._free), "duplicate page in free list"
        assert not self._allocated[free].any(), "page is both free and allocated"
        assert len(self._free) + int(self._allocated.sum()) == self.num_pages, "pages lost"
