"""A router's membership from discovery (``cluster.discovery``): etcd watches and DNS polls that
add and remove workers of the ``Registry`` at runtime (``server.router.membership``).

etcd (``EtcdWatch``): read every record under the prefix, make the membership match it, then watch
from the next revision: a PUT adds the worker (routed to once its first heartbeat says ready), a
DELETE (the worker left, or its lease ran out) takes it out of rotation at once. When etcd is
unreachable the router keeps the last membership, says so in ``/health`` (``discovery``), and
tries again with back-off; when etcd answers it reads everything again and reconciles.

DNS (``DnsWatch``): every ``interval_s`` resolve each name; every A/AAAA record is a worker of the
target's role at the target's port, named ``ROLE@IP``. A record that disappears takes its worker
out of rotation; a name that does not resolve keeps the last membership (``/health`` says so).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import httpx
from pydantic import ValidationError

from server.discovery.etcd import EtcdError, call_async, create_if_absent, get_prefix_async, watch_prefix
from server.discovery.target import DnsTarget, EtcdTarget, WorkerRecord, parse_targets
from server.router.load import ROUTER_TAG_BITS, RoomAllocator
from server.router.membership import add_worker, remove_worker
from server.router.registry import Registry
from server.router.workers import WorkerSpec

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


class _Watch:
    """The membership one source owns (``known``: worker ids it added) and its ``/health`` note."""

    def __init__(self, registry: Registry, source: str) -> None:
        self.registry, self.source = registry, source
        self.known: set[str] = set()
        self.down_since: float | None = None

    async def reconcile(self, specs: dict[str, WorkerSpec], gone: str) -> None:
        """Make this source's workers exactly ``specs`` (by id); ``gone``: why the others leave."""
        for wid in sorted(self.known - set(specs)):
            await remove_worker(self.registry, wid, gone)
        for spec in specs.values():
            await add_worker(self.registry, spec)
        self.known = set(specs)

    def up(self, what: str) -> None:
        if self.down_since is not None:
            log.warning("discovery %s is back (%s)", self.source, what)
        self.down_since = None
        self.registry.notes[self.source] = f"discovery {self.source}: {what}"

    def down(self, error: Exception) -> None:
        if self.down_since is None:
            log.error("discovery %s failed: %s; keeping the last membership", self.source, error)
            self.down_since = time.time()
        since = time.strftime("%H:%M:%S", time.gmtime(self.down_since))
        self.registry.notes[self.source] = (
            f"discovery {self.source}: unavailable since {since} UTC, keeping the "
            f"last membership ({len(self.known)} worker(s)): {error}"
        )


class EtcdWatch(_Watch):
    """The workers registered under an etcd prefix (see the module docstring)."""

    def __init__(self, target: EtcdTarget, registry: Registry, retry_s: float = 1.0, lease_s: float = 10.0) -> None:
        super().__init__(registry, str(target))
        self.target, self.retry_s = target, retry_s
        self.tag = RouterTag(target, registry, lease_s)

    async def prepare(self) -> None:
        """Before the router serves: claim its room tag (etcd unreachable: a random tag for now, and
        :meth:`run` claims one once etcd answers)."""
        async with httpx.AsyncClient(base_url=self.target.base_url, timeout=3.0, trust_env=False) as http:
            try:
                await self.tag.claim(http)
            except EtcdError as e:
                log.warning("router room tag not claimed yet (random tag %d meanwhile): %s", self.registry.rooms.tag, e)

    def spec(self, key: str, value: str) -> WorkerSpec | None:
        """The worker a key's record names, or None (logged) when it is not a valid record of ours."""
        try:
            rec = WorkerRecord.model_validate_json(value)
        except ValidationError as e:
            log.error("discovery %s: key %s is not a worker record: %s", self.source, key, e)
            return None
        cluster = self.registry.cluster_id
        if cluster and rec.cluster_id != cluster:
            log.error(
                "discovery %s: %s belongs to cluster %r, this router to %r: ignored (give each cluster its own prefix)",
                self.source,
                rec.worker_id,
                rec.cluster_id,
                cluster,
            )
            return None
        return WorkerSpec(rec.worker_id, rec.role, rec.addr)

    async def run(self) -> None:
        """Watch until cancelled."""
        prefix = self.target.workers_prefix
        async with httpx.AsyncClient(base_url=self.target.base_url, timeout=5.0, trust_env=False) as http:
            tag_task = asyncio.create_task(self.tag.run(http), name="router tag")
            try:
                await self._watch(http, prefix)
            finally:
                tag_task.cancel()
                await asyncio.gather(tag_task, return_exceptions=True)

    async def _watch(self, http: httpx.AsyncClient, prefix: str) -> None:
        """Read the prefix, reconcile, watch from the next revision; again after every failure."""
        while True:
            try:
                revision, kvs = await get_prefix_async(http, prefix)
                specs = {s.worker_id: s for k, v in kvs.items() if (s := self.spec(k, v)) is not None}
                await self.reconcile(specs, f"its key is gone from {self.source}")
                self.up(f"watching, {len(specs)} worker(s) registered")
                async for ev in watch_prefix(http, prefix, revision + 1):
                    await self.apply(ev.kind, ev.key, ev.value)
            except EtcdError as e:
                self.down(e)
                await asyncio.sleep(self.retry_s)

    async def apply(self, kind: str, key: str, value: str) -> None:
        """One watch event."""
        if kind == "DELETE":
            wid = key.removeprefix(self.target.workers_prefix)
            if wid in self.known:
                self.known.discard(wid)
                await remove_worker(self.registry, wid, f"its key is gone from {self.source}")
        elif (spec := self.spec(key, value)) is not None:
            self.known.add(spec.worker_id)
            await add_worker(self.registry, spec)
        self.up(f"watching, {len(self.known)} worker(s) registered")


class RouterTag:
    """This router's room tag, claimed in etcd (``{prefix}routers/{tag}`` under a lease it renews) so
    no two live routers of the prefix share one (``server.router.load.RoomAllocator``). Lost while
    etcd was away: claimed again (the same tag when still free, else a new one)."""

    def __init__(self, target: EtcdTarget, registry: Registry, lease_s: float) -> None:
        self.target, self.registry, self.ttl = target, registry, max(2, round(lease_s))
        self.lease: int | None = None

    async def claim(self, http: httpx.AsyncClient) -> int:
        """Claim a free tag (the current one first) and switch the registry's rooms to it."""
        self.lease = int((await call_async(http, "/v3/lease/grant", {"TTL": self.ttl}))["ID"])
        tag = self.registry.rooms.tag
        for _ in range(64):
            if await create_if_absent(http, f"{self.target.prefix}routers/{tag}", "router", self.lease):
                if tag != self.registry.rooms.tag:
                    self.registry.rooms = RoomAllocator(tag)
                log.info("router room tag %d claimed in %s", tag, self.target)
                return tag
            tag = RoomAllocator().tag
        raise EtcdError(f"no free router tag in {self.target} after 64 tries (2**{ROUTER_TAG_BITS} exist)")

    async def run(self, http: httpx.AsyncClient) -> None:
        """Keep the claim until cancelled."""
        while True:
            try:
                if self.lease is None:
                    await self.claim(http)
                ttl = int(
                    (await call_async(http, "/v3/lease/keepalive", {"ID": self.lease})).get("result", {}).get("TTL", 0)
                )
                if ttl <= 0:
                    self.lease = None
                    continue
            except EtcdError as e:
                log.warning("router tag in %s not renewed: %s", self.target, e)
                self.lease = None
            await asyncio.sleep(self.ttl / 3)


async def resolve_all(name: str, port: int) -> list[str]:
    """Every A/AAAA address of ``name`` (``socket.gaierror`` when it does not resolve)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class DnsWatch(_Watch):
    """The workers behind one DNS name (see the module docstring)."""

    def __init__(
        self, target: DnsTarget, registry: Registry, interval_s: float, resolve: Resolver = resolve_all
    ) -> None:
        super().__init__(registry, str(target))
        self.target, self.interval_s, self.resolve = target, interval_s, resolve

    async def poll(self) -> None:
        """Resolve once and reconcile (or keep the membership and note why)."""
        t = self.target
        try:
            addrs = await self.resolve(t.name, t.port)
        except OSError as e:
            self.down(e)
            return
        specs = {}
        for ip in addrs:
            addr = f"tcp://[{ip}]:{t.port}" if ":" in ip else f"tcp://{ip}:{t.port}"
            specs[f"{t.role}@{ip}"] = WorkerSpec(f"{t.role}@{ip}", t.role, addr)
        await self.reconcile(specs, f"{t.name} no longer resolves to it")
        self.up(f"{len(specs)} address(es)")

    async def prepare(self) -> None:
        """Before the router serves: resolve once, so the workers are known from the start."""
        await self.poll()

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)


def watches(
    discovery: str | None, registry: Registry, interval_s: float, lease_s: float = 10.0
) -> list[EtcdWatch | DnsWatch]:
    """One watch per target of a ``--discovery`` value (none without one). Call ``prepare()`` on
    each before serving, then run ``run()`` as a task."""
    if not discovery:
        return []
    return [
        EtcdWatch(t, registry, lease_s=lease_s) if isinstance(t, EtcdTarget) else DnsWatch(t, registry, interval_s)
        for t in parse_targets(discovery)
    ]
