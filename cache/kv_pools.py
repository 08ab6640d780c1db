"""A worker's KV memory: the full-attention pool and, for sliding-window hybrids, the SWA pool,
carved out of one device allocation.

Full layers keep KV for every token in ``full`` (pages shareable through the radix cache); SWA
layers keep only their window in ``swa``, a pool with its own page count (and allocator, owned
by the KV manager). Without an SWA pool every layer lives in ``full``.

Transfers and CPU offload see the allocation as ``units``: rows of ``unit_layers`` layers of one
page (``gcd`` of the two pools' layer counts), so a full page is ``full_units`` consecutive rows
and an SWA page ``swa_units`` rows after the full region. One registered buffer and one page
size per transport stay true for hybrids; without an SWA pool a unit is a full page, so nothing
changes for other models. ``units()`` maps pool pages to rows; every mapper of KV bytes uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from cache.kv_pool import KVPool
from cache.pool_memory import zeroed

FULL, SWA = "full", "swa"


@dataclass(frozen=True)
class PoolGeometry:
    """Where a peer's pools sit in its unit rows (travels in the KV handshake)."""

    full_pages: int
    full_units: int
    swa_units: int

    def units(self, pool: str, pages) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int64).reshape(-1, 1)
        if pool == FULL:
            rows = pages * self.full_units + np.arange(self.full_units)
        else:
            rows = self.full_pages * self.full_units + pages * self.swa_units + np.arange(self.swa_units)
        return rows.reshape(-1).astype(np.int32)


class KVPools:
    def __init__(
        self,
        full_pages: int,
        swa_pages: int,
        layer_types: tuple[str, ...],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
    ) -> None:
        """``swa_pages > 0`` puts the ``sliding_attention`` layers into an SWA pool of that many
        pages; ``0`` keeps every layer in the full pool."""
        swa_layers = [i for i, t in enumerate(layer_types) if t == "sliding_attention"] if swa_pages else []
        full_layers = [i for i in range(len(layer_types)) if i not in set(swa_layers)]
        n_full, n_swa = len(full_layers), len(swa_layers)
        self.unit_layers = math.gcd(n_full, n_swa)
        full_units, swa_units = n_full // self.unit_layers, n_swa // self.unit_layers
        self.geometry = PoolGeometry(full_pages, full_units, swa_units)
        rows = full_pages * full_units + swa_pages * swa_units
        self.units = zeroed((rows, self.unit_layers, 2, page_size, num_kv_heads, head_dim), dtype, device)
        split = full_pages * full_units
        self.full = _carve(self.units[:split], full_pages, n_full, dtype, device)
        self.swa = _carve(self.units[split:], swa_pages, n_swa, dtype, device) if n_swa else None
        self.layer_pool: list[tuple[str, int]] = [None] * len(layer_types)  # type: ignore[list-item]
        for local, layer in enumerate(full_layers):
            self.layer_pool[layer] = (FULL, local)
        for local, layer in enumerate(swa_layers):
            self.layer_pool[layer] = (SWA, local)

    @property
    def unit_bytes(self) -> int:
        return self.units[0].numel() * self.units.element_size()

    @property
    def nbytes(self) -> int:
        return self.units.numel() * self.units.element_size()

    def pool(self, name: str) -> KVPool:
        return self.full if name == FULL else self.swa

    def unit_rows(self, full_pages, swa_pages=()) -> np.ndarray:
        """Unit rows of ``full_pages`` (full pool) followed by those of ``swa_pages`` (SWA pool)."""
        parts = [self.geometry.units(FULL, full_pages)]
        if len(swa_pages):
            parts.append(self.geometry.units(SWA, swa_pages))
        return np.concatenate(parts)

    def layout_descriptor(self) -> dict:
        """What two workers must agree on to exchange KV: the full pool's layout plus the SWA
        layers and the unit size (pool sizes may differ; they travel as ``geometry``)."""
        d = self.full.layout_descriptor()
        d["num_layers"] = len(self.layer_pool)
        d["swa_layers"] = [i for i, (p, _) in enumerate(self.layer_pool) if p == SWA]
        d["unit_layers"] = self.unit_layers
        return d


def _carve(units: torch.Tensor, pages: int, layers: int, dtype: torch.dtype, device) -> KVPool:
    """A ``KVPool`` of ``pages`` pages of ``layers`` layers over these unit rows (a view, no copy)."""
    _, _, _, page_size, num_kv_heads, head_dim = units.shape
    buffer = units.view(pages, layers, 2, page_size, num_kv_heads, head_dim)
    return KVPool(pages, layers, page_size, num_kv_heads, head_dim, dtype, device, buffer=buffer)
