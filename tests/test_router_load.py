"""Several routers in front of the same workers (issue 28, item 4), in-process: the load a router
routes by blends the workers' reported queues and KV with its own recent sends, and room numbers
of routers with different tags never meet. With real processes and etcd:
tests/chaos/test_two_routers.py."""
from __future__ import annotations

import pytest

from server.router.inflight import InflightTable
from server.router.load import ROOM_COUNTER_BITS, RoomAllocator
from server.router.registry import Registry, WorkerSpec, route_pd
from transfer.wire.protocol import WorkerStats
from transfer.wire.sampling_params import SamplingParams

SPECS = [WorkerSpec("prefill-0", "prefill", "tcp://a:1"), WorkerSpec("decode-0", "decode", "tcp://a:2"),
         WorkerSpec("decode-1", "decode", "tcp://a:3")]


class Client:
    def __init__(self, spec, on_tokens, on_stats) -> None:
        self.spec, self.on_stats = spec, on_stats
        self.gauges: dict[str, float] = {"kv_pages_used": 0.0, "kv_pages_total": 100.0}
        self.sent = 0

    def report(self) -> None:
        self.on_stats(self.spec.worker_id, WorkerStats(
            worker_id=self.spec.worker_id, role=self.spec.role, model="m", capacity_tokens=1000, max_model_len=512,
            page_size=16, gauges=self.gauges))

    def prefill(self, *args) -> None:
        self.sent += 1

    def generate(self, *args, **kw) -> None:
        self.sent += 1


def _registry() -> Registry:
    reg = Registry(SPECS, Client, InflightTable(), policy=route_pd)
    for h in reg.handles.values():
        h.client.report()
    return reg


def _send(reg: Registry) -> str:
    from server.router.registry import send_request

    route = reg.route()
    send_request(route, "r", reg.next_room(), [1, 2], SamplingParams(max_new_tokens=4))
    return route.stream_from.worker_id


def test_another_routers_requests_reported_by_a_worker_steer_new_ones_away():
    reg = _registry()
    assert _send(reg) == "decode-0"  # nothing anywhere: lowest id
    assert _send(reg) == "decode-1"  # its own send, not yet in any report, counts
    reg.handles["decode-0"].client.gauges.update(queue_running=5)  # 5 of another router's requests
    reg.handles["decode-1"].client.gauges.update(queue_running=1)
    for h in reg.handles.values():
        h.client.report()
    assert [_send(reg) for _ in range(4)] == ["decode-1"] * 4  # 1+0 -> 1+3 before 5 vs 5
    assert _send(reg) == "decode-0"  # 5 vs 5 (the reports plus this router's sends since): lowest id


def test_kv_used_breaks_ties():
    reg = _registry()
    reg.handles["decode-0"].client.gauges.update(queue_running=2, kv_pages_used=90)
    reg.handles["decode-1"].client.gauges.update(queue_running=2, kv_pages_used=10)
    for h in reg.handles.values():
        h.client.report()
    assert _send(reg) == "decode-1"


def test_rooms_of_routers_with_different_tags_never_meet():
    a, b = RoomAllocator(7), RoomAllocator(8)
    rooms_a = {a.next() for _ in range(10_000)}
    rooms_b = {b.next() for _ in range(10_000)}
    assert len(rooms_a) == 10_000 and not rooms_a & rooms_b
    assert {r >> ROOM_COUNTER_BITS for r in rooms_a} == {7}
    with pytest.raises(ValueError, match="router tag"):
        RoomAllocator(1 << 22)
