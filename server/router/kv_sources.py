"""Tells each PD decode worker which workers it may take KV from (``KVSources``): the prefill
workers of its model and its decode peers (migration sources), so that it handshakes them when
they join, not when their first transfer is already waiting (a handshake and, on NIXL, the
connection's setup each wait for a step of the other side)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from server.router.worker_client import WorkerUnavailable
from server.router.workers import READY, WorkerHandle
from transfer.wire.enums import Role
from transfer.wire.protocol import KVSources

log = logging.getLogger(__name__)


def kv_sources(handles: Iterable[WorkerHandle], h: WorkerHandle) -> KVSources | None:
    """The sources of decode worker ``h``: the ready prefill workers reporting its model, and the
    ready decode workers other than ``h`` reporting its model and page size (those a migration
    may come from, ``server.router.migration.pick_target``). None unless ``h`` is a ready decode
    worker that reported."""
    if h.spec.role != Role.DECODE or h.state != READY or h.stats is None:
        return None
    prefill, decode = [], []
    for o in handles:
        if o is h or o.state != READY or o.stats is None or o.stats.model != h.stats.model:
            continue
        if o.spec.role == Role.PREFILL:
            prefill.append(o.spec.addr)
        elif o.spec.role == Role.DECODE and o.stats.page_size == h.stats.page_size:
            decode.append(o.spec.addr)
    return KVSources(prefill=sorted(prefill), decode=sorted(decode))


def announce_sources(handles: Iterable[WorkerHandle], h: WorkerHandle) -> None:
    """Send ``h`` its ``kv_sources`` unless its current process (``h.instance``) was sent the same
    list already. Clients without ``kv_sources`` (test doubles) take no part."""
    msg = kv_sources(handles, h)
    send = getattr(h.client, "kv_sources", None)
    if msg is None or send is None or h.sources_sent == (h.instance, msg):
        return
    try:
        send(msg)
    except WorkerUnavailable as e:
        log.warning("KV sources not delivered to %s: %s", h.worker_id, e)
        return
    h.sources_sent = (h.instance, msg)
