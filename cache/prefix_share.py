"""A request's prefix shared through the radix cache while the request lives.

Insert on prefill (and on landing, PD decode): a request's computed prefix goes to the radix cache
while the request runs.

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

Park (a retract to the host): ``shared_elsewhere(kv, handle)`` counts the leading pages of the
handle's radix prefix that another holder locks too; ``park(kv, handle)`` gives back everything
else, as ``KVManager.free`` would, and keeps those pages in the handle, locked, so they are neither
copied out nor back (``KVManager.restore`` grows the handle from them).
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.handle import KVHandle
from cache.kv_manager import KVManager
from cache.radix_cache import held_elsewhere


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


def shared_elsewhere(kv: KVManager, handle: KVHandle) -> int:
    """Leading pages of ``handle``'s radix prefix that another holder locks too: they stay on the
    device whatever this handle does. 0 without a radix cache, with an SWA pool, or when the
    handle holds no cached prefix. Changes nothing."""
    if kv.tree is None or kv.has_swa or handle.full.node is None:
        return 0
    return held_elsewhere(kv.tree, handle.full.node)[1]


def park(kv: KVManager, handle: KVHandle) -> int:
    """Retract to the host: give back every page of ``handle`` except its ``shared_elsewhere``
    prefix, which stays in the handle, read-only and locked (now on the deepest node another holder
    locks too), so parking frees exactly what ``KVManager.free`` would. Returns the pages kept (0:
    the handle is empty, as after ``free``)."""
    kept = shared_elsewhere(kv, handle)
    if kept == 0:
        kv.free(handle)
        return 0
    node, _ = held_elsewhere(kv.tree, handle.full.node)
    pages = handle.full.pages[:kept]
    kv.tree.lock(node)
    kv.free(handle)
    handle.full.pages, handle.full.num_shared, handle.full.node = pages, kept, node
    return kept
