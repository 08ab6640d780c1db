"""Drain units: the worker's exit decision (``server.worker.drain``) on a fake clock, the 503 it
turns a timed-out drain's aborts into, and the registry's drain states (``server.router``) with
scripted fake workers. The drain of real processes under load: tests/chaos/test_drain.py."""

from __future__ import annotations

import asyncio

import pytest

from server.router.inflight import InflightTable
from server.router.membership import add_worker, drain_worker, remove_worker
from server.router.registry import DEAD, DRAINED, DRAINING, READY, STARTING, Registry, WorkerSpec, route_pd
from server.worker.drain import Drain, Verdict, as_unavailable
from tests.support.router_doubles import fake_stats
from transfer.wire.outbox import Outbox, Peer
from transfer.wire.protocol import PrefillFailed, TokenDelta


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_drain_waits_for_held_requests_and_quiet_then_exits():
    clock = Clock()
    d = Drain(timeout_s=30, quiet_s=1.0, clock=clock)
    assert d.verdict(5) is Verdict.SERVE and not d.active
    assert d.begin("SIGTERM") and not d.begin("again")
    clock.t += 5
    assert d.verdict(2) is Verdict.SERVE  # still holding
    assert d.verdict(0) is Verdict.SERVE  # empty just now: routers have not seen it empty yet
    clock.t += 0.5
    d.took_request()  # a router that had not seen the flag sent one more
    clock.t += 0.9
    assert d.verdict(0) is Verdict.SERVE
    clock.t += 0.2
    assert d.verdict(0) is Verdict.EXIT


def test_a_drain_without_quiet_period_exits_once_it_holds_nothing():
    # SIGUSR1 (the launcher stops its whole cluster, router first): no router is left to see the flag
    clock = Clock()
    d = Drain(timeout_s=30, quiet_s=3.0, clock=clock)
    assert d.begin("SIGUSR1", quiet_s=0.0)
    assert d.verdict(1) is Verdict.SERVE  # what it holds is still finished
    clock.t += 0.1
    assert d.verdict(0) is Verdict.EXIT
    later = Drain(timeout_s=30, quiet_s=3.0, clock=clock)  # a SIGTERM drain, then the cluster stops
    later.begin("SIGTERM")
    assert later.verdict(0) is Verdict.SERVE
    assert not later.begin("SIGUSR1", quiet_s=0.0)  # already draining: only the quiet period changes
    assert later.verdict(0) is Verdict.EXIT


def test_drain_expires_after_its_timeout():
    clock = Clock()
    d = Drain(timeout_s=10, quiet_s=1.0, clock=clock)
    d.begin("drain requested")
    clock.t += 9.9
    assert d.verdict(1) is Verdict.SERVE
    clock.t += 0.2
    assert d.verdict(1) is Verdict.EXPIRED
    assert "drain_timeout_s=10s" in d.expired_error()


def test_expired_drain_fails_requests_with_503():
    out = Outbox()
    out.token(b"r", TokenDelta.failed("a", "aborted", 499))
    out.token(b"r", TokenDelta(rid="b", token_ids=[1], finish_reason="length"))
    out.send(Peer("tcp://d:1"), PrefillFailed(rid="c", room=1, generation=0, error="x", error_status=499))
    fixed = as_unavailable(out, "drain ran out of time")
    assert [(d.rid, d.error_status, d.error) for d in fixed.deltas] == [
        ("a", 503, "drain ran out of time"),
        ("b", None, None),
    ]
    assert fixed.messages[0].msg.error_status == 503 and fixed.messages[0].msg.error == "drain ran out of time"


class FakeClient:
    def __init__(self, spec, on_tokens, on_stats) -> None:
        self.spec, self.on_stats = spec, on_stats
        self.draining = False
        self.holding = 0
        self.drains: list[str] = []
        self.aborts: list[str] = []
        self.closed = False

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True

    def request_stats(self, nonce: int) -> None:
        fields = {"cluster_id": "c1", "capacity_tokens": 1000, "draining": self.draining, "holding": self.holding}
        self.on_stats(self.spec.worker_id, fake_stats(self.spec.worker_id, self.spec.role, nonce, "i1", **fields))

    def drain(self, reason: str) -> None:
        self.drains.append(reason)

    def abort(self, rids, reason) -> None:
        self.aborts += rids


def _registry(*specs: WorkerSpec, dynamic: bool = False) -> Registry:
    return Registry(list(specs), FakeClient, InflightTable(), policy=route_pd, model_name="m", dynamic=dynamic)


P0, D0, D1 = (
    WorkerSpec("prefill-0", "prefill", "tcp://a:1"),
    WorkerSpec("decode-0", "decode", "tcp://a:2"),
    WorkerSpec("decode-1", "decode", "tcp://a:3"),
)


def _beat(reg: Registry) -> None:
    for h in list(reg.handles.values()):
        h.client.request_stats(1)


def test_drained_worker_leaves_rotation_at_once_and_health_stays_ok():
    reg = _registry(P0, D0, D1)
    _beat(reg)
    assert reg.health()[0]
    drain_worker(reg, "decode-0", "operator")
    assert reg.handles["decode-0"].state == DRAINING and reg.handles["decode-0"].client.drains == ["operator"]
    _beat(reg)  # a reply sent before the worker read Drain: it stays out of rotation
    assert reg.handles["decode-0"].state == DRAINING
    assert {reg.route().stream_from.worker_id for _ in range(5)} == {"decode-1"}
    ok, detail = reg.health()
    assert ok and "decode-0 (decode): draining" in detail
    reg.handles["decode-0"].client.draining, reg.handles["decode-0"].client.holding = True, 3
    _beat(reg)
    assert "3 request(s) still held" in reg.handles["decode-0"].reason
    reg.mark_drained("decode-0", "exited 0")
    assert reg.handles["decode-0"].state == DRAINED and reg.health()[0]
    with pytest.raises(ValueError, match="decode-0 is drained: exited 0"):
        drain_worker(reg, "decode-0", "again")
    with pytest.raises(KeyError):
        drain_worker(reg, "decode-7", "unknown")


def test_worker_draining_on_its_own_is_not_routed_to():
    reg = _registry(P0, D0, D1)
    reg.handles["decode-1"].client.draining = True  # SIGTERM: the flag arrives in its stats
    _beat(reg)
    assert reg.handles["decode-1"].state == DRAINING
    assert reg.route().stream_from.worker_id == "decode-0"


def test_joining_and_leaving_workers_keep_in_flight_requests():
    async def go():
        reg = _registry(dynamic=True)
        assert not reg.health()[0] and "no worker registered" in reg.health()[1]
        await reg.start()
        for spec in (P0, D0):
            await add_worker(reg, spec)  # the first heartbeat goes out at once
        assert reg.handles["decode-0"].state == READY and reg.health()[0]
        route = reg.route()
        reg.table.open("r1", tuple(h.worker_id for h in route.targets), route.stream_from.worker_id, 10)
        await add_worker(reg, D1)
        await remove_worker(reg, "decode-0", "its discovery key is gone")
        assert reg.handles["decode-0"].state == DRAINING  # kept: r1 still runs there
        assert reg.route().stream_from.worker_id == "decode-1"
        _beat(reg)
        assert reg.handles["decode-0"].state == DRAINING
        reg.table.close("r1")
        client = reg.handles["decode-0"].client
        await reg.sweep()
        assert "decode-0" not in reg.handles and client.closed
        await add_worker(reg, WorkerSpec("decode-1", "decode", "tcp://b:9"))  # same id, new address
        assert reg.handles["decode-1"].spec.addr == "tcp://b:9"
        await reg.close()

    asyncio.run(go())


def test_dns_watch_follows_the_records_and_keeps_them_when_resolution_fails():
    from server.discovery.target import parse_discovery
    from server.router.discovery_watch import DnsWatch

    answers: list = [["10.0.0.5"], ["10.0.0.5", "10.0.0.6"], OSError("Name or service not known"), ["10.0.0.6"]]

    async def resolve(name: str, port: int) -> list[str]:
        assert (name, port) == ("decode.ns.svc", 29500)
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    async def go():
        reg = _registry(dynamic=True)
        await reg.start()
        watch = DnsWatch(parse_discovery("dns://decode.ns.svc:29500"), reg, 1.0, resolve)
        await watch.poll()
        assert [(h.worker_id, h.spec.role, h.spec.addr) for h in reg.handles.values()] == [
            ("decode@10.0.0.5", "decode", "tcp://10.0.0.5:29500")
        ]
        await watch.poll()
        assert sorted(reg.handles) == ["decode@10.0.0.5", "decode@10.0.0.6"]
        await watch.poll()  # resolution fails: the last membership stays
        assert sorted(reg.handles) == ["decode@10.0.0.5", "decode@10.0.0.6"]
        assert "unavailable since" in reg.notes[str(watch.target)] and "(2 worker(s))" in reg.notes[str(watch.target)]
        await watch.poll()
        assert sorted(reg.handles) == ["decode@10.0.0.6"] and "1 address(es)" in reg.describe() + str(reg.notes)
        assert reg.handles["decode@10.0.0.6"].reported_id == "decode@10.0.0.6"  # its stats name it so here
        await reg.close()

    asyncio.run(go())


def test_launcher_leaves_a_drained_worker_down_and_restarts_a_crashed_one():
    from server.launch.supervisor import RestartPolicy, WorkerSupervisor
    from server.router.registry import RESTARTING

    class Procs:
        def __init__(self) -> None:
            self.exits: list = []
            self.restarted: list[str] = []

        def new_exits(self):
            out, self.exits = self.exits, []
            return out

        def restart(self, spec) -> None:
            self.restarted.append(spec.worker_id)

    clock = Clock()
    reg = _registry(P0, D0, D1)
    _beat(reg)
    procs = Procs()
    sup = WorkerSupervisor(procs, RestartPolicy(limit=3, base_s=0.0, max_s=0.0), reg, clock=clock)
    procs.exits = [(D0, 0), (D1, -9)]  # decode-0 drained and exited 0; decode-1 was killed
    assert sup.tick() == []
    assert reg.handles["decode-0"].state == DRAINED and "stays down" in reg.handles["decode-0"].reason
    assert procs.restarted == ["decode-1"] and reg.handles["decode-1"].state == RESTARTING
    clock.t += 10
    sup.tick()
    assert procs.restarted == ["decode-1"]  # decode-0 is never restarted


def _admin_app(reg: Registry):
    """The router's real app over ``reg`` (fake workers), with API key ``sekret``."""
    from configs.schema import PdserveConfig
    from server.router.app import build_admission, create_app
    from server.router.context import RouterContext
    from server.router.metrics import RouterMetrics

    cfg = PdserveConfig.model_validate({"server": {"api_key": "sekret"}})
    ctx = RouterContext(
        cfg,
        None,
        "m",
        reg,
        reg.table,
        RouterMetrics(lambda: reg.handles.values(), lambda: 0),
        build_admission(cfg, reg),
    )
    return create_app(ctx)


def test_admin_drain_needs_the_api_key_and_takes_the_worker_out_at_once():
    from fastapi.testclient import TestClient

    reg = _registry(P0, D0, D1)
    with TestClient(_admin_app(reg)) as http:
        _beat(reg)
        r = http.post("/admin/drain", json={"worker_id": "decode-0"})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        auth = {"Authorization": "Bearer sekret"}
        r = http.post("/admin/drain", json={"worker_id": "decode-0"}, headers=auth)
        assert r.status_code == 202 and r.json() == {"worker_id": "decode-0", "state": "draining", "in_flight": 0}
        assert reg.handles["decode-0"].client.drains and reg.route().stream_from.worker_id == "decode-1"
        r = http.post("/admin/drain", json={"worker_id": "nope"}, headers=auth)
        assert r.status_code == 404 and "known workers: decode-0, decode-1, prefill-0" in r.json()["error"]["message"]
        r = http.post("/admin/drain", content=b"[]", headers=auth)
        assert r.status_code == 400
        r = http.post("/admin/drain", json={"worker_id": "decode-0"}, headers=auth)
        assert r.status_code == 202  # asking again resends Drain
        health = http.get("/health").json()
        assert health["status"] == "ok" and "decode-0 (decode): draining" in health["workers"]
        reg.handles["decode-0"].state = DRAINED
        r = http.post("/admin/drain", json={"worker_id": "decode-0"}, headers=auth)
        assert r.status_code == 409 and r.json()["error"]["code"] == "worker_not_serving"
        assert "decode-0 is drained" in r.json()["error"]["message"]


def test_openapi_document_states_admin_drain_its_body_answers_and_bearer_key():
    from fastapi.testclient import TestClient

    from server.router.admin import DrainBody

    with TestClient(_admin_app(_registry(P0, D0))) as http:
        doc = http.get("/openapi.json").json()
    op = doc["paths"]["/admin/drain"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = doc["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert ref.endswith("/DrainBody") and body["required"] == ["worker_id"]
    assert set(body["properties"]) == set(DrainBody.model_fields) and body["additionalProperties"] is False
    assert set(op["responses"]) == {"202", "400", "401", "404", "409", "413"}
    answer = op["responses"]["202"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    assert set(doc["components"]["schemas"][answer]["properties"]) == {"worker_id", "state", "in_flight"}
    assert op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    (scheme,) = op["security"][0]
    assert doc["components"]["securitySchemes"][scheme] == {
        "type": "http",
        "scheme": "bearer",
        "description": "One of the router's --api-key values",
    }


def test_a_worker_that_rejoins_discovery_while_silent_still_fails_its_requests():
    """A container killed and restarted at the same address: DNS drops it, then lists it again,
    before it answers. Its requests in flight must still fail once it has been silent too long."""

    async def go():
        clock = Clock()
        reg = Registry(
            [], FakeClient, InflightTable(), policy=route_pd, model_name="m", dynamic=True, clock=clock, timeout_s=8
        )
        await reg.start()
        for spec in (P0, D0):
            await add_worker(reg, spec)
        route = reg.route()
        reg.table.open("r1", tuple(h.worker_id for h in route.targets), route.stream_from.worker_id, 10)
        await remove_worker(reg, "decode-0", "decode no longer resolves to it")
        await add_worker(reg, D0)  # listed again (restarted at the same address), not answering yet
        assert reg.handles["decode-0"].state == STARTING
        clock.t += 9
        reg.handles["prefill-0"].client.request_stats(2)
        assert [h.worker_id for h in reg.check_liveness()] == ["decode-0"]
        assert reg.handles["decode-0"].state == DEAD and "no heartbeat for 9.0s" in reg.handles["decode-0"].reason
        assert reg.handles["prefill-0"].client.aborts == ["r1"]  # r1 failed with 503 (aborted everywhere)
        await reg.close()

    asyncio.run(go())
