"""Worker registry: roles, health (heartbeats), and routing by a policy function.

Each worker has a ``WorkerSpec`` (id, role, control address) and a client (``WorkerClient`` or a
test double with the same methods). The registry polls every worker with ``StatsRequest`` every
``interval_s``; any message from a worker counts as a sign of life. A ready worker silent for
``timeout_s`` is marked dead: its in-flight requests fail with 503 at once and ``health()``
reports it. A worker that answers again becomes ready again, unless it was marked dead for good
(its process exited).

Routing: ``route()`` hands the ready workers to a policy function (``ROUTING_POLICIES[mode]``)
that returns a ``Route``: the workers that receive the request and the one that streams tokens
back. Colocated mode sends to the least loaded colocated worker (reported load blended with the
router's in-flight count, ``route_colocated``); PD mode picks the least loaded
prefill and decode workers (``least_outstanding``) and streams from the decode worker.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.router.inflight import InflightTable
from server.router.worker_client import WorkerUnavailable
from transfer.wire.enums import Role
from transfer.wire.protocol import TokenDelta, WorkerStats

log = logging.getLogger(__name__)

STARTING, READY, DEAD, RESTARTING = "starting", "ready", "dead", "restarting"


@dataclass(frozen=True)
class WorkerSpec:
    """Where a worker listens and what it does (``role``: colocated, prefill or decode)."""

    worker_id: str
    role: Role
    addr: str


@dataclass
class WorkerHandle:
    """A worker as the router sees it: state, latest stats, last sign of life (monotonic s), and
    since when the router has heard from the current process instance (``up_since``, ``restarts``)."""

    spec: WorkerSpec
    client: Any
    state: str = STARTING
    reason: str = "waiting for its first heartbeat"
    stats: WorkerStats | None = None
    last_seen: float | None = None
    stats_at: float | None = None
    permanent: bool = False
    instance: str = ""  # the worker process's instance id (from its stats); a new one means a restart
    up_since: float | None = None  # when the router first heard from ``instance`` (monotonic s)
    restarts: int = 0  # how many times ``instance`` changed

    @property
    def worker_id(self) -> str:
        """The worker's id (from its spec)."""
        return self.spec.worker_id


@dataclass(frozen=True)
class Route:
    """Workers that receive one request (``targets``) and the one whose tokens are streamed."""

    targets: tuple[WorkerHandle, ...]
    stream_from: WorkerHandle

    @property
    def capacity_tokens(self) -> int:
        """Smallest KV pool capacity among the targets (tokens)."""
        return min(h.stats.capacity_tokens for h in self.targets)

    @property
    def max_model_len(self) -> int:
        """Smallest context limit among the targets (tokens)."""
        return min(h.stats.max_model_len for h in self.targets)


class NoWorkerAvailable(RuntimeError):
    """No ready worker can take the request (the message says why)."""


Load = Callable[[str], int]
Policy = Callable[[list[WorkerHandle], Load], Route]


def least_outstanding(handles: list[WorkerHandle], load: Load) -> WorkerHandle:
    """The handle with the least outstanding work (ties: lowest worker id)."""
    return min(handles, key=lambda h: (load(h.worker_id), h.worker_id))


def route_colocated(ready: list[WorkerHandle], load: Load) -> Route:
    """Colocated mode: the least loaded ready colocated worker (a replica) does everything.

    A replica's load blends what it reports and what this router knows now: its requests are the
    larger of its latest stats' running + waiting (which count other routers' requests, but lag a
    heartbeat) and this router's in-flight count to it (current, but only this router's), plus the
    used fraction of its KV pool (a tie-break below one request: of two equally busy replicas the
    one nearer to retracting gets less). Ties: lowest worker id."""
    workers = [h for h in ready if h.spec.role == Role.COLOCATED]
    if not workers:
        raise NoWorkerAvailable("no ready colocated worker")

    def score(h: WorkerHandle) -> tuple[float, str]:
        g = h.stats.gauges if h.stats is not None else {}
        reported = g.get("queue_running", 0.0) + g.get("queue_waiting", 0.0)
        kv = g.get("kv_pages_used", 0.0) / g["kv_pages_total"] if g.get("kv_pages_total") else 0.0
        return max(reported, float(load(h.worker_id))) + min(kv, 0.99), h.worker_id

    w = min(workers, key=score)
    return Route((w,), w)


def route_pd(ready: list[WorkerHandle], load: Load) -> Route:
    """PD mode: the least loaded ready prefill and decode workers; tokens stream from decode."""
    prefill = [h for h in ready if h.spec.role == Role.PREFILL]
    decode = [h for h in ready if h.spec.role == Role.DECODE]
    if not prefill or not decode:
        missing = Role.PREFILL if not prefill else Role.DECODE
        raise NoWorkerAvailable(f"no ready {missing} worker")
    d = least_outstanding(decode, load)
    return Route((least_outstanding(prefill, load), d), d)


ROUTING_POLICIES: dict[str, Policy] = {"colocated": route_colocated, "pd": route_pd}


def send_request(route: Route, rid: str, room: int, prompt_ids: list[int], params) -> None:
    """Send one request to every worker of ``route`` in the message its role takes.

    Colocated: ``GenerateRequest``. PD: the prefill worker gets a ``PrefillRequest`` naming the
    decode worker; the decode worker gets a ``GenerateRequest`` with ``room`` and the prefill
    worker's control address (it asks that worker for the KV). Raises ``WorkerUnavailable``.
    """
    prefill = next((h for h in route.targets if h.spec.role == Role.PREFILL), None)
    for h in route.targets:
        if h.spec.role == Role.PREFILL:
            h.client.prefill(rid, room, prompt_ids, params, route.stream_from.worker_id)
        elif h.spec.role == Role.DECODE:
            h.client.generate(rid, prompt_ids, params, room=room, prefill_addr=prefill.spec.addr)
        else:
            h.client.generate(rid, prompt_ids, params)


class Registry:
    """Workers by id, their health, and request routing. Use from the event loop thread only."""

    def __init__(self, specs: list[WorkerSpec], client_factory: Callable[..., Any], table: InflightTable, *,
                 policy: Policy = route_colocated, interval_s: float = 1.0, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, model_name: str | None = None,
                 cluster_id: str | None = None) -> None:
        """``client_factory(spec, on_tokens, on_stats)`` builds each worker's client. A worker
        reporting another role than its spec's, another model than ``model_name`` or another cluster
        than ``cluster_id`` (each checked when given) is never routed to (``/health`` says why)."""
        self.model_name = model_name
        self.cluster_id = cluster_id
        if not specs:
            raise ValueError("a registry needs at least one worker")
        self.table = table
        self.policy = policy
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.handles = {s.worker_id: WorkerHandle(s, client_factory(s, self.on_tokens, self.on_stats)) for s in specs}
        self._heartbeat_task: asyncio.Task | None = None
        self._nonce = 0
        # rooms name KV transfers; start from a random base so a restarted router never reuses one
        self._rooms = itertools.count(random.randrange(1 << 40))

    def next_room(self) -> int:
        """A room number no other request of this router has used."""
        return next(self._rooms)

    async def start(self) -> None:
        """Connect every client and start the heartbeat task."""
        for h in self.handles.values():
            await h.client.start()
        self._heartbeat_task = asyncio.create_task(self._heartbeat(), name="heartbeat")

    async def close(self) -> None:
        """Stop heartbeats and close every client."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        for h in self.handles.values():
            await h.client.close()

    # ---- routing and health ------------------------------------------------------------------
    def route(self) -> Route:
        """A route for a new request; raises ``NoWorkerAvailable`` naming each worker's state."""
        ready = [h for h in self.handles.values() if h.state == READY]
        try:
            if ready:
                return self.policy(ready, self.table.outstanding)
            raise NoWorkerAvailable("no worker is ready")
        except NoWorkerAvailable as e:
            raise NoWorkerAvailable(f"{e} ({self.describe()})") from None

    def reroute(self, failed: Route) -> Route | None:
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
                route = self.policy(pool, self.table.outstanding) if pool else None
            except NoWorkerAvailable:
                continue
            if route is not None and {h.worker_id for h in route.targets} != old:
                return route
        return None

    def health(self) -> tuple[bool, str]:
        """(every worker ready, a one-line description of each worker's state)."""
        ok = all(h.state == READY for h in self.handles.values())
        return ok, self.describe()

    def can_route(self) -> bool:
        """Whether a new request would find a route now."""
        try:
            self.route()
            return True
        except NoWorkerAvailable:
            return False

    def describe(self) -> str:
        """``id (role): state[: reason]`` for every worker."""
        return "; ".join(f"{h.worker_id} ({h.spec.role}): {h.state}" + ("" if h.state == READY else f": {h.reason}")
                         for h in self.handles.values())

    # ---- events from workers and the launcher ------------------------------------------------
    def on_stats(self, worker_id: str, stats: WorkerStats) -> None:
        """A ``WorkerStats`` arrived: record it; a ready report revives a (not permanently) dead worker."""
        h = self.handles[worker_id]
        h.stats, h.last_seen = stats, self.clock()
        h.stats_at = h.last_seen
        if stats.instance != h.instance or h.up_since is None:
            restarted = h.up_since is not None
            h.restarts += 1 if restarted else 0
            h.instance, h.up_since = stats.instance, h.last_seen
            if restarted:  # back before the lease ran out (a worker the launcher does not watch)
                self._fail_requests(worker_id, f"worker {worker_id} restarted (a new process answers at "
                                               f"{h.spec.addr}): the requests it held are lost")
        if h.permanent:
            return
        if (mismatch := self._mismatch(h, stats)) is not None:
            if h.reason != mismatch:
                log.error("worker %s at %s: %s", worker_id, h.spec.addr, mismatch)
            h.state, h.reason = STARTING, mismatch
            return
        if h.state != READY:
            log.info("worker %s is ready (%s, capacity %d tokens)", worker_id, stats.model, stats.capacity_tokens)
            h.state, h.reason = READY, ""

    def _mismatch(self, h: WorkerHandle, stats: WorkerStats) -> str | None:
        """Why the process answering at ``h``'s address is not the worker the router expects, or None."""
        if self.cluster_id is not None and stats.cluster_id != self.cluster_id:
            return (f"the process at {h.spec.addr} is worker {stats.worker_id} ({stats.role}) of cluster "
                    f"{stats.cluster_id!r}, but this router's cluster is {self.cluster_id!r}: another deployment's "
                    f"worker took the address (check --base-port / --cluster-id)")
        if stats.role != h.spec.role:
            return f"answers as a {stats.role} worker ({stats.worker_id}), expected {h.spec.role}"
        if self.model_name is not None and stats.model != self.model_name:
            return f"serves model {stats.model!r} but the router serves {self.model_name!r}"
        return self._page_size_conflict(h, stats)

    def _page_size_conflict(self, h: WorkerHandle, stats: WorkerStats) -> str | None:
        """PD: why a worker whose KV page size no live worker of the other role shares can never be
        paired (the KV handshake would refuse every request routed to it), or None."""
        other = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}.get(h.spec.role)
        sizes = {o.stats.page_size for o in self.handles.values()
                 if o.spec.role == other and o.stats is not None and o.state != DEAD}
        if not sizes or stats.page_size in sizes:
            return None
        return (f"its KV page size {stats.page_size} matches no {other} worker's "
                f"({', '.join(map(str, sorted(sizes)))}): no KV can move between them; start it with "
                f"--page-size {min(sizes)}")

    def on_tokens(self, worker_id: str, delta: TokenDelta) -> None:
        """A token delta arrived: a sign of life, forwarded to the request's queue."""
        self.handles[worker_id].last_seen = self.clock()
        self.table.dispatch(worker_id, delta)

    def mark_restarting(self, worker_id: str, reason: str) -> None:
        """The launcher started a new process for a dead worker: not routable until it reports."""
        h = self.handles[worker_id]
        if not h.permanent:
            h.state, h.reason = RESTARTING, reason

    def mark_dead(self, worker_id: str, reason: str, permanent: bool = False) -> list[str]:
        """Mark a worker dead and fail its in-flight requests with 503; returns their rids."""
        h = self.handles[worker_id]
        if h.state != DEAD:
            log.error("worker %s is dead: %s", worker_id, reason)
        h.state, h.reason, h.permanent = DEAD, reason, h.permanent or permanent
        return self._fail_requests(worker_id, f"worker {worker_id} is unavailable: {reason}")

    def _fail_requests(self, worker_id: str, message: str) -> list[str]:
        """Fail with 503 every request in flight that depends on ``worker_id``; returns their rids."""
        workers_of = {rid: self.table.workers_of(rid) for rid in self.table.rids()}
        rids = self.table.fail_worker(worker_id, 503, message)
        by_worker: dict[str, list[str]] = {}
        for rid in rids:  # abort on every worker of the request, the dead one included (best effort)
            for wid in workers_of.get(rid, (worker_id,)):
                by_worker.setdefault(wid, []).append(rid)
        for wid, wrids in by_worker.items():
            self.handles[wid].client.abort(wrids, f"router gave up on the request: {message}")
        return rids

    def check_liveness(self) -> list[WorkerHandle]:
        """Mark dead every ready worker silent for more than ``timeout_s``; returns those handles."""
        now = self.clock()
        silent = []
        for h in self.handles.values():
            if h.state == READY and h.last_seen is not None and now - h.last_seen > self.timeout_s:
                self.mark_dead(h.worker_id, f"no heartbeat for {now - h.last_seen:.1f}s "
                                            f"(worker_timeout_s={self.timeout_s:g})")
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
            for h in self.handles.values():
                try:
                    h.client.request_stats(self._nonce)
                except WorkerUnavailable as e:
                    log.debug("heartbeat to %s not sent: %s", h.worker_id, e)
            await self._reconnect(self.check_liveness())
            await asyncio.sleep(self.interval_s)
