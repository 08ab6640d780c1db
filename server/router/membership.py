"""Changing a running router's workers: join (discovery found one), leave (discovery lost one),
drain (an operator's ``POST /admin/drain``). Functions over a ``Registry``, on its event loop.

A worker that joins is routed to once its first heartbeat says ready. One that leaves is out of
rotation at once; its requests in flight go on and its handle is dropped once none is left
(``Registry.sweep``, every heartbeat) or when it goes silent (they fail with 503, as for any
dead worker). Room numbers stay unique: they come from the registry's counter, never from a
worker's slot.
"""

from __future__ import annotations

import logging

from server.router.link_lost import attach
from server.router.registry import Registry
from server.router.workers import DRAINING, READY, RESTARTING, STARTING, WorkerHandle, WorkerSpec

log = logging.getLogger(__name__)


async def add_worker(registry: Registry, spec: WorkerSpec) -> WorkerHandle:
    """Start tracking ``spec``. The same id at another address or role replaces the old handle (its
    requests fail with 503); the same spec again is a no-op that cancels a pending leave."""
    old = registry.handles.get(spec.worker_id)
    if old is not None and old.spec == spec:
        if old.leaving and old.state == DRAINING and not old.drain_asked:  # back (e.g. after an etcd outage)
            old.state, old.reason = STARTING, "rejoined discovery; waiting for its next heartbeat"
        old.leaving = False
        return old
    if old is not None:
        registry.mark_dead(spec.worker_id, f"re-registered at {spec.addr} as {spec.role}")
        old.leaving = True
        await registry.sweep()
    h = WorkerHandle(spec, registry.client_factory(spec, registry.on_tokens, registry.on_stats))
    registry.handles[spec.worker_id] = h
    attach(registry, h)
    log.info("worker %s (%s) at %s joined", spec.worker_id, spec.role, spec.addr)
    if registry.started:
        await h.client.start()
        h.client.request_stats(0)  # first heartbeat now, not at the next period
    return h


async def remove_worker(registry: Registry, worker_id: str, reason: str) -> None:
    """Route nothing new to ``worker_id`` from now on; drop it once it holds no request."""
    h = registry.handles.get(worker_id)
    if h is None:
        return
    h.leaving = True
    if h.state in (READY, STARTING, RESTARTING):
        h.state, h.reason = DRAINING, reason
    await registry.sweep()


def drain_worker(registry: Registry, worker_id: str, reason: str) -> WorkerHandle:
    """Take ``worker_id`` out of rotation now and send it ``Drain``. ``KeyError`` for an unknown
    id, ``ValueError`` naming its state when it is not serving."""
    h = registry.handles[worker_id]
    if h.state not in (READY, DRAINING, STARTING):
        raise ValueError(f"worker {worker_id} is {h.state}" + (f": {h.reason}" if h.reason else ""))
    h.state, h.reason, h.drain_asked = DRAINING, reason, True
    h.client.drain(reason)
    return h
