"""Insert on prefill: a request's computed prefix goes to the radix cache while the request runs.

``share_prefix(kv, handle, token_ids)``: the full pages of ``token_ids`` (tokens whose KV is
computed in ``handle``, in order) are inserted into ``kv``'s radix cache while the request keeps
reading them, so a request with the same prefix (a sibling choice of an ``n`` > 1 request) matches
them instead of computing them again. They become ``handle``'s shared prefix, locked by it (copy on
write: the pages after them, the last partial one included, stay the request's own and every
sibling writes its own). Where the tree already held a page for the same tokens (another request
inserted them first) the handle switches to the tree's page and its duplicate is freed, so call it
only between forwards, when no kernel reads the handle. Returns the pages newly shared; 0, with
nothing changed, without a radix cache, with an SWA pool (whose tree tracks windows per node) or
when nothing beyond the handle's shared prefix is a full page. The pool invariant (free + used +
cached == total) holds before and after: pages move from the request's own to the cache.
"""
from __future__ import annotations

from collections.abc import Sequence

from cache.handle import KVHandle
from cache.kv_manager import KVManager


def share_prefix(kv: KVManager, handle: KVHandle, token_ids: Sequence[int]) -> int:
    """See the module docstring."""
    if kv.tree is None or kv.has_swa:
        return 0
    n_full = len(token_ids) // kv.page_size
    full = handle.full
    if n_full <= full.num_shared:
        return 0
    key = token_ids[: n_full * kv.page_size]
    res = kv.tree.insert(key, full.pages[:n_full])
    kv.tree.lock(res.node)
    if res.duplicate_pages:
        full.pages[:n_full] = [int(p) for p in kv.tree.match_prefix(key).pages]
        kv.allocator.free(res.duplicate_pages)
    if full.node is not None:
        kv.tree.unlock(full.node)
    shared, full.node, full.num_shared = n_full - full.num_shared, res.node, n_full
    return shared
