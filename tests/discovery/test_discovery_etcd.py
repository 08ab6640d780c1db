"""etcd discovery against a real etcd the test starts (``tests/support/etcd_server.py``): the gateway
client, a worker's registration under a lease (renewed, deleted when it leaves, back after an etcd
restart), and a router's ``EtcdWatch`` adding and removing workers of a real ``Registry`` (fake
worker clients), keeping the membership while etcd is down and saying so in ``/health``'s text.
Skipped, naming the package, without the etcd binary."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.discovery.etcd import EtcdClient, EtcdError
from server.discovery.target import DiscoveryError, EtcdTarget, WorkerRecord, parse_discovery, parse_targets
from server.router.discovery_watch import EtcdWatch
from server.router.inflight import InflightTable
from server.router.registry import READY, Registry, route_pd
from server.worker.registration import EtcdRegistration
from tests.support.etcd_server import INSTALL_HINT, EtcdServer, etcd_binary
from tests.worker.test_drain_unit import FakeClient

pytestmark = [pytest.mark.process, pytest.mark.skipif(etcd_binary() is None, reason=INSTALL_HINT)]


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    yield server
    server.kill()


def _record(wid: str, role: str, port: int, cluster: str = "c1") -> WorkerRecord:
    return WorkerRecord(worker_id=wid, role=role, model="m", cluster_id=cluster, addr=f"tcp://127.0.0.1:{port}")


def _wait(cond, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise TimeoutError(what)


def test_parse_discovery_targets():
    assert parse_discovery("etcd://127.0.0.1:2379") == EtcdTarget("http://127.0.0.1:2379", "/pdserve/")
    assert parse_discovery("etcd://h:1/team/a").key("decode-0") == "/team/a/workers/decode-0"
    d = parse_discovery("dns://decode.ns.svc:29500")
    assert (d.name, d.port, d.role) == ("decode.ns.svc", 29500, "decode")
    assert parse_discovery("dns://workers.ns.svc:1?role=prefill").role == "prefill"
    assert len(parse_targets("dns://prefill.x:1, dns://decode.x:1")) == 2
    for bad in ("http://h:1", "etcd://h", "dns://h:1", "dns://stuff.ns:1?role=router"):
        with pytest.raises(DiscoveryError, match="etcd://HOST:PORT|role"):
            parse_discovery(bad)


def test_registration_lives_with_its_lease_and_leaves(etcd):
    target = EtcdTarget(etcd.url, "/t1/")
    reg = EtcdRegistration(target, _record("decode-0", "decode", 1), lease_s=2)
    reg.start()
    assert reg.registered.wait(10)
    client = EtcdClient(etcd.url)
    _, kvs = client.get_prefix(target.workers_prefix)
    assert WorkerRecord.model_validate_json(kvs["/t1/workers/decode-0"]).addr == "tcp://127.0.0.1:1"
    time.sleep(3)  # longer than the TTL: renewed
    assert "/t1/workers/decode-0" in client.get_prefix(target.workers_prefix)[1]
    reg.close()  # leave: deleted at once, not at the end of the lease
    assert client.get_prefix(target.workers_prefix)[1] == {}
    with pytest.raises(EtcdError, match="unreachable"):
        EtcdClient("http://127.0.0.1:1").grant(5)


def test_router_watch_follows_registrations_and_survives_an_etcd_restart(etcd):
    target = EtcdTarget(etcd.url, "/t2/")

    async def go():
        registry = Registry(
            [], FakeClient, InflightTable(), policy=route_pd, model_name="m", cluster_id="c1", dynamic=True
        )
        await registry.start()
        watch = EtcdWatch(target, registry, retry_s=0.2)
        task = asyncio.create_task(watch.run())
        regs = {
            wid: EtcdRegistration(target, _record(wid, role, port), lease_s=2)
            for wid, role, port in (("prefill-0", "prefill", 1), ("decode-0", "decode", 2))
        }
        for r in regs.values():
            r.start()

        async def until(cond, what):
            for _ in range(200):
                if cond():
                    return
                await asyncio.sleep(0.05)
            raise TimeoutError(f"{what}: {registry.describe()} {registry.notes}")

        await until(
            lambda: {h.state for h in registry.handles.values()} == {READY} and len(registry.handles) == 2,
            "both registered workers ready",
        )
        assert "watching, 2 worker(s)" in registry.notes[str(target)]
        other = EtcdRegistration(target, _record("decode-9", "decode", 9, cluster="other"), lease_s=2)
        other.start()  # another cluster's worker under the same prefix: ignored
        await asyncio.to_thread(regs["decode-0"].close)  # leaves
        await until(lambda: "decode-0" not in registry.handles, "decode-0 removed")
        assert "decode-9" not in registry.handles
        etcd.kill()
        await until(lambda: "unavailable since" in registry.notes[str(target)], "etcd outage noted")
        assert "keeping the last membership (1 worker(s))" in registry.describe() or registry.handles
        assert registry.handles["prefill-0"].state == READY  # kept while etcd is down
        await asyncio.to_thread(etcd.start)
        await until(lambda: "watching" in registry.notes[str(target)], "watch resumed")
        await until(lambda: regs["prefill-0"].registered.is_set(), "prefill-0 registered again")
        assert registry.handles["prefill-0"].state == READY
        for r in (*regs.values(), other):
            await asyncio.to_thread(r.close)
        await until(lambda: not registry.handles, "every worker gone")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await registry.close()

    asyncio.run(go())


def test_two_routers_claim_different_room_tags(etcd):
    from server.router.load import RoomAllocator

    target = EtcdTarget(etcd.url, "/t3/")

    async def go():
        regs = [Registry([], FakeClient, InflightTable(), policy=route_pd, dynamic=True) for _ in range(2)]
        for reg in regs:
            reg.rooms = RoomAllocator(5)  # the same random pick: the second router must move
            await EtcdWatch(target, reg, lease_s=2).prepare()
        assert regs[0].rooms.tag == 5 and regs[1].rooms.tag != 5
        assert sorted(EtcdClient(etcd.url).get_prefix("/t3/routers/")[1]) == sorted(
            f"/t3/routers/{r.rooms.tag}" for r in regs
        )

    asyncio.run(go())
