"""A worker whose control connection closed with nothing listening at its address any more (the
``WorkerClient``'s monitor, ``transfer.link_watch``): its process is gone, so the registry marks it
dead at once instead of waiting for the heartbeat lease, and its requests fail over as after a
missed heartbeat or the launcher's exit notice. Functions over a ``Registry``, on its event loop."""

from __future__ import annotations

import functools
from typing import Protocol

from server.router.inflight import InflightTable
from server.router.migration import Migrations
from server.router.workers import DRAINING, READY, STARTING, WorkerHandle


class Registry(Protocol):
    """What of ``server.router.registry.Registry`` these functions use."""

    handles: dict[str, WorkerHandle]
    table: InflightTable
    migrations: Migrations

    def mark_dead(self, worker_id: str, reason: str, permanent: bool = False) -> list[str]: ...

    def mark_drained(self, worker_id: str, reason: str) -> None: ...


def attach(registry: Registry, h: WorkerHandle) -> None:
    """Route ``h``'s client events to ``registry``: migration messages, a continuation the worker
    prefills itself and a lost connection (clients without the hooks, test doubles, are left alone)."""
    registry.migrations.attach(h)
    if hasattr(h.client, "on_local"):
        h.client.on_local = registry.table.local
    if hasattr(h.client, "on_link_lost"):
        h.client.on_link_lost = functools.partial(on_link_lost, registry)


def on_link_lost(registry: Registry, worker_id: str, reason: str) -> None:
    """``worker_id``'s process is gone (``reason`` names the closed connection): dead now if it holds
    requests or was serving, under the state rules of ``Registry.check_liveness``. Left as they are:
    a worker the launcher already marked (dead, restarting), one not serving yet, one discovery
    dropped, and a draining one that holds nothing here (it exited after its drain: nothing to fail
    over, and the launcher's notice or the heartbeats say drained, with the exit's own reason). A new
    process at the address is taken back by its heartbeats."""
    h = registry.handles.get(worker_id)
    if h is None or h.permanent:
        return
    outstanding = registry.table.outstanding(worker_id)
    if h.state == READY or (h.state in (DRAINING, STARTING) and outstanding):
        registry.mark_dead(worker_id, reason)
