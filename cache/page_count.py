"""Page demands and budgets over the KV pools: full-attention pages and SWA pages, counted apart."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageCount:
    """A number of pages per pool (``swa`` is 0 for models without an SWA pool)."""

    full: int = 0
    swa: int = 0

    def __add__(self, other: PageCount) -> PageCount:
        return PageCount(self.full + other.full, self.swa + other.swa)

    def __sub__(self, other: PageCount) -> PageCount:
        return PageCount(self.full - other.full, self.swa - other.swa)

    def covers(self, need: PageCount) -> bool:
        """True iff this budget holds ``need`` in both pools."""
        return need.full <= self.full and need.swa <= self.swa

    def clamp(self) -> PageCount:
        return PageCount(max(0, self.full), max(0, self.swa))
