"""Worker registry: roles, health (heartbeats), and routing by a policy function.

Each worker has a ``WorkerSpec`` (id, role, control address) and a client (``WorkerClient`` or a
test double with the same methods). The registry polls every worker with ``StatsRequest`` every
``interval_s``; any message from a worker counts as a sign of life. A ready worker silent for
``timeout_s`` is marked dead: its in-flight requests fail with 503 at once and ``health()``
reports it. A worker whose control connection closed with nothing listening at its address any
more (``server.router.link_lost``: its process is gone) is marked dead at once, without waiting
for the lease. A worker that answers again becomes ready again, unless it was marked dead for good
(its process exited).

Routing: ``route()`` hands the ready workers to a policy function (``ROUTING_POLICIES[mode]``)
that returns a ``Route``: the workers that receive the request and the one that streams tokens
back. Colocated mode sends to the least loaded colocated worker; PD mode picks the least loaded
prefill and decode workers (``least_outstanding``) and streams from the decode worker. Load is
``server.router.load.BlendedLoad``: this router's own requests in flight plus the other routers'
as the workers last reported them, and KV, so several routers in front of the same workers see
each other's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from server.router.inflight import InflightTable
from server.router.kv_sources import announce_sources
from server.router.link_lost import attach
from server.router.load import BlendedLoad, RoomAllocator
from server.router.migration import Migrations
from server.router.worker_client import WorkerUnavailable
from server.router.workers import (
    DEAD,
    DRAINED,
    DRAINING,
    OUT_OF_ROTATION,
    READY,
    RESTARTING,
    ROUTING_POLICIES,
    STARTING,
    SWITCHING,
    NoWorkerAvailable,
    Policy,
    Route,
    WorkerHandle,
    WorkerSpec,
    by_room,
    least_outstanding,
    route_colocated,
    route_pd,
    send_request,
)
from transfer.wire.enums import Role
from transfer.wire.protocol import TokenDelta, WorkerStats

__all__ = [
    "DEAD",
    "DRAINED",
    "DRAINING",
    "READY",
    "RESTARTING",
    "ROUTING_POLICIES",
    "STARTING",
    "NoWorkerAvailable",
    "Registry",
    "Route",
    "WorkerHandle",
    "WorkerSpec",
    "least_outstanding",
    "route_colocated",
    "route_pd",
    "send_request",
]

log = logging.getLogger(__name__)


def _reason(h: WorkerHandle) -> str:
    """Why ``h`` is not ready: a failed control handshake (another cluster key) when its client
    reports one, else the registry's own reason."""
    return getattr(h.client, "handshake_error", None) or h.reason


class Registry:
    """Workers by id, their health, and request routing. Use from the event loop thread only."""

    def __init__(
        self,
        specs: list[WorkerSpec],
        client_factory: Callable[..., Any],
        table: InflightTable,
        *,
        policy: Policy = route_colocated,
        interval_s: float = 1.0,
        timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        model_name: str | None = None,
        cluster_id: str | None = None,
        dynamic: bool = False,
    ) -> None:
        """``client_factory(spec, on_tokens, on_stats)`` builds each worker's client. A worker
        reporting another role than its spec's, another model than ``model_name`` or another cluster
        than ``cluster_id`` (each checked when given) is never routed to (``/health`` says why).
        ``dynamic``: membership comes from discovery (``add_worker``/``remove_worker``), so the
        registry may start empty."""
        self.model_name = model_name
        self.cluster_id = cluster_id
        if not specs and not dynamic:
            raise ValueError("a registry needs at least one worker")
        self.client_factory = client_factory
        self.started = False
        self.notes: dict[str, str] = {}  # extra /health lines by source (discovery status)
        self.table = table
        self.policy = policy
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.handles = {s.worker_id: WorkerHandle(s, client_factory(s, self.on_tokens, self.on_stats)) for s in specs}
        self._heartbeat_task: asyncio.Task | None = None
        self._nonce = 0
        self.rooms = RoomAllocator()  # rooms name KV transfers: unique across routers (tag) and requests
        self.load = BlendedLoad(table, self.handles)
        self.migrations = Migrations(self.handles, table, self.next_room)
        for h in self.handles.values():
            attach(self, h)

    def next_room(self) -> int:
        """A room number no other request of this router, nor of another router, has used."""
        return self.rooms.next()

    async def start(self) -> None:
        """Connect every client and start the heartbeat task."""
        for h in list(self.handles.values()):
            await h.client.start()
        self.started = True
        self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="heartbeat")

    async def close(self) -> None:
        """Stop heartbeats and close every client."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        for h in list(self.handles.values()):
            await h.client.close()

    async def sweep(self) -> None:
        """Drop the handles that are leaving (``WorkerHandle.leaving``: discovery lost them) and hold
        no request any more, or whose requests already failed (dead, drained); close their clients."""
        for h in [h for h in self.handles.values() if h.leaving]:
            if h.state in (DEAD, DRAINED) or not self.table.outstanding(h.worker_id):
                if self.handles.get(h.worker_id) is h:
                    del self.handles[h.worker_id]
                await h.client.close()
                log.info("worker %s removed: %s", h.worker_id, h.reason or "left discovery")

    # ---- routing and health ------------------------------------------------------------------
    def route(self, prompt_ids: Sequence[int] = (), max_new_tokens: int = 0) -> Route:
        """A route for a new request of ``prompt_ids`` (the policy may score them against the
        workers' caches); raises ``NoWorkerAvailable`` naming each worker's state. Where pools
        differ (``--worker-kv-pool-tokens``) the policy picks among the workers that can hold the
        request while they make a route (``by_room``); a request none holds is refused by the route's
        fit check."""
        ready = [h for h in self.handles.values() if h.state == READY]
        try:
            if not ready:
                raise NoWorkerAvailable("no worker is ready")
            for subset in by_room(ready, len(prompt_ids), max_new_tokens):
                with contextlib.suppress(NoWorkerAvailable):
                    return self.policy(subset, self.load, prompt_ids)
            return self.policy(ready, self.load, prompt_ids)
        except NoWorkerAvailable as e:
            raise NoWorkerAvailable(f"{e} ({self.describe()})") from None

    def reroute(self, failed: Route, prompt_ids: Sequence[int] = ()) -> Route | None:
        """A route for sending again a request that failed on ``failed`` because a worker of it died:
        the policy's pick among the ready workers outside ``failed`` (a fresh pair) when there is one,
        else among the ready workers but one of ``failed`` (the dead one is not ready; a peer that a
        worker reported dead may still look ready here), as long as the pick differs from ``failed``;
        None when no other route exists."""
        ready = [h for h in self.handles.values() if h.state == READY]
        old = {h.worker_id for h in failed.targets}
        for skip in (old, *({w} for w in sorted(old))):
            pool = [h for h in ready if h.worker_id not in skip]
            try:
                route = self.policy(pool, self.load, prompt_ids) if pool else None
            except NoWorkerAvailable:
                continue
            if route is not None and {h.worker_id for h in route.targets} != old:
                return route
        return None

    def health(self) -> tuple[bool, str]:
        """(every worker ready but those out of rotation on purpose (draining, drained) and a route
        exists, a one-line description of each worker's state and of ``notes``)."""
        ok = all(h.state == READY or h.state in OUT_OF_ROTATION for h in self.handles.values())
        return ok and self.can_route(), self.describe()

    def can_route(self) -> bool:
        """Whether a new request would find a route now."""
        try:
            self.route()
            return True
        except NoWorkerAvailable:
            return False

    def describe(self) -> str:
        """``id (role): state[: reason]`` for every worker (with none: that, and the discovery notes)."""
        lines = [
            f"{h.worker_id} ({h.spec.role}): {h.state}" + ("" if h.state == READY else f": {_reason(h)}")
            for h in self.handles.values()
        ]
        return "; ".join(lines) or "no worker registered" + "".join(f"; {n}" for n in self.notes.values())

    # ---- events from workers and the launcher ------------------------------------------------
    def on_stats(self, worker_id: str, stats: WorkerStats) -> None:
        """A ``WorkerStats`` arrived: record it; a ready report revives a (not permanently) dead worker."""
        h = self.handles.get(worker_id)
        if h is None:  # removed while its reply was on the way
            return
        h.stats, h.last_seen = stats, self.clock()
        h.own_at_stats = self.table.outstanding_requests(worker_id)  # what of the report is this router's
        h.stats_at = h.last_seen
        if h.state == SWITCHING:  # its new instance and role are taken from the switch's answer
            return
        if stats.instance != h.instance or h.up_since is None:
            restarted = h.up_since is not None
            h.restarts += 1 if restarted else 0
            h.instance, h.up_since, h.drain_asked = stats.instance, h.last_seen, False
            if restarted:  # back before the lease ran out (a worker the launcher does not watch)
                self._fail_requests(
                    worker_id,
                    f"worker {worker_id} restarted (a new process answers at "
                    f"{h.spec.addr}): the requests it held are lost",
                )
        if h.permanent:
            return
        if stats.draining or h.leaving or h.drain_asked:
            self._on_draining(h, stats)
            return
        if (why := mismatch(self, h, stats)) is not None:
            if h.reason != why:
                log.error("worker %s at %s: %s", worker_id, h.spec.addr, why)
            h.state, h.reason = STARTING, why
            return
        if h.state != READY:
            log.info("worker %s is ready (%s, capacity %d tokens)", worker_id, stats.model, stats.capacity_tokens)
            h.state, h.reason = READY, ""
        announce_sources(self.handles.values(), h)

    def _on_draining(self, h: WorkerHandle, stats: WorkerStats) -> None:
        """A report from a worker that is draining or left discovery: out of rotation, held count shown."""
        if h.state != DRAINING:
            log.warning(
                "worker %s is draining (%d request(s) held): routing nothing new to it", h.worker_id, stats.holding
            )
        why = "left discovery" if h.leaving else "draining"
        h.state, h.reason = DRAINING, f"{why}: {stats.holding} request(s) still held"

    def on_tokens(self, worker_id: str, delta: TokenDelta) -> None:
        """A token delta arrived: a sign of life, forwarded to the request's queue."""
        if (h := self.handles.get(worker_id)) is not None:
            h.last_seen = self.clock()
        self.table.dispatch(worker_id, delta)

    def mark_restarting(self, worker_id: str, reason: str) -> None:
        """The launcher started a new process for a dead worker: not routable until it reports."""
        h = self.handles.get(worker_id)  # discovery may have dropped it meanwhile; it registers again
        if h is not None and not h.permanent:
            h.state, h.reason = RESTARTING, reason

    def mark_drained(self, worker_id: str, reason: str) -> None:
        """The worker exited after a drain: out of rotation for good (until a new process reports);
        anything still in flight on it fails with 503."""
        h = self.handles[worker_id]
        h.state, h.reason = DRAINED, reason
        self._fail_requests(worker_id, f"worker {worker_id} left: {reason}")
        log.info("worker %s drained: %s", worker_id, reason)

    def mark_dead(self, worker_id: str, reason: str, permanent: bool = False) -> list[str]:
        """Mark a worker dead and fail its in-flight requests with 503; returns their rids (none for a
        worker discovery already dropped)."""
        h = self.handles.get(worker_id)
        if h is None:
            return []
        if h.state != DEAD:
            log.error("worker %s is dead: %s", worker_id, reason)
        h.state, h.reason, h.permanent = DEAD, reason, h.permanent or permanent
        return self._fail_requests(worker_id, f"worker {worker_id} is unavailable: {reason}")

    def _fail_requests(self, worker_id: str, message: str) -> list[str]:
        """Fail with 503 every request in flight that depends on ``worker_id``, undo the migrations
        headed to it (their sources resume them); returns the failed rids."""
        workers_of = {rid: self.table.workers_of(rid) for rid in self.table.rids()}
        rids = self.table.fail_worker(worker_id, 503, message)
        by_worker: dict[str, list[str]] = {}
        for rid in rids:  # abort on every worker of the request, the dead one included (best effort)
            for wid in workers_of.get(rid, (worker_id,)):
                by_worker.setdefault(wid, []).append(rid)
        for wid, wrids in by_worker.items():
            if wid in self.handles:
                self.handles[wid].client.abort(wrids, f"router gave up on the request: {message}")
        self.migrations.target_lost(worker_id, message, failed=rids)
        return rids

    def check_liveness(self) -> list[WorkerHandle]:
        """Mark dead every ready worker silent for more than ``timeout_s``; returns those handles. A
        draining one that went silent has exited: drained when it held nothing here, else dead. A
        starting one that holds requests here (it rejoined discovery, e.g. a container restarted at
        its old address, before answering again) is dead too: its requests fail instead of waiting."""
        now = self.clock()
        silent = []
        for h in list(self.handles.values()):
            gone = h.last_seen is not None and now - h.last_seen > self.timeout_s
            if gone and h.state == DRAINING and not self.table.outstanding(h.worker_id):
                self.mark_drained(h.worker_id, "stopped answering after its drain")
            elif gone and (
                h.state in (READY, DRAINING) or (h.state == STARTING and self.table.outstanding(h.worker_id))
            ):
                self.mark_dead(
                    h.worker_id, f"no heartbeat for {now - h.last_seen:.1f}s (worker_timeout_s={self.timeout_s:g})"
                )
                silent.append(h)
        return silent

    async def _reconnect(self, handles: list[WorkerHandle]) -> None:
        """A silent worker may be back elsewhere (a restarted container): connect anew, which
        resolves its host name again. Clients without ``reconnect`` (test doubles) are left as is."""
        for h in handles:
            if hasattr(h.client, "reconnect"):
                log.info("reconnecting to worker %s at %s", h.worker_id, h.spec.addr)
                await h.client.reconnect()

    async def _heartbeat(self) -> None:
        while True:
            self._nonce += 1
            for h in list(self.handles.values()):
                try:
                    h.client.request_stats(self._nonce)
                except WorkerUnavailable as e:
                    log.debug("heartbeat to %s not sent: %s", h.worker_id, e)
            await self._reconnect(self.check_liveness())
            await self.sweep()
            await asyncio.sleep(self.interval_s)


def mismatch(registry: Registry, h: WorkerHandle, stats: WorkerStats) -> str | None:
    """Why the process answering at ``h``'s address is not the worker the router expects, or None."""
    if registry.cluster_id is not None and stats.cluster_id != registry.cluster_id:
        return (
            f"the process at {h.spec.addr} is worker {stats.worker_id} ({stats.role}) of cluster "
            f"{stats.cluster_id!r}, but this router's cluster is {registry.cluster_id!r}: another deployment's "
            f"worker took the address (check --base-port / --cluster-id)"
        )
    if stats.role != h.spec.role:
        return f"answers as a {stats.role} worker ({stats.worker_id}), expected {h.spec.role}"
    if registry.model_name is not None and stats.model != registry.model_name:
        return f"serves model {stats.model!r} but the router serves {registry.model_name!r}"
    return page_size_conflict(registry, h, stats)


def page_size_conflict(registry: Registry, h: WorkerHandle, stats: WorkerStats) -> str | None:
    """PD: why a worker whose KV page size no live worker of the other role shares can never be
    paired (the KV handshake would refuse every request routed to it), or None."""
    other = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}.get(h.spec.role)
    sizes = {
        o.stats.page_size
        for o in registry.handles.values()
        if o.spec.role == other and o.stats is not None and o.state != DEAD
    }
    if not sizes or stats.page_size in sizes:
        return None
    return (
        f"its KV page size {stats.page_size} matches no {other} worker's "
        f"({', '.join(map(str, sorted(sizes)))}): no KV can move between them; start it with "
        f"--page-size {min(sizes)}"
    )
