"""Chained hashes of KV pages: the names a worker's cache events and the router's index share.

``page_hashes(tokens, page_size)`` returns one 63-bit hash per whole page of ``tokens`` (a trailing
partial page has none). Page ``i``'s hash covers the hash of page ``i - 1`` and page ``i``'s token
ids (little-endian int32), so equal hashes mean equal whole prefixes, not just equal pages: a
worker's set of page hashes answers "how many leading pages of this prompt do you hold" by looking
the prompt's hashes up one by one. BLAKE2b (8-byte digest, top bit cleared so every hash fits a
signed int64 anywhere it travels); ``ROOT_HASH`` is the parent of the first page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0
_MASK = (1 << 63) - 1


def page_hashes(tokens: Sequence[int] | np.ndarray, page_size: int, parent: int = ROOT_HASH) -> list[int]:
    """One chained hash per whole page of ``tokens``, the first one chained to ``parent``."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    arr = np.asarray(tokens, dtype="<i4")
    n = len(arr) // page_size
    out: list[int] = []
    h = parent
    for i in range(n):
        d = hashlib.blake2b(h.to_bytes(8, "little"), digest_size=8)
        d.update(arr[i * page_size : (i + 1) * page_size].tobytes())
        h = int.from_bytes(d.digest(), "little") & _MASK
        out.append(h)
    return out
