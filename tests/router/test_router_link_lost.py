"""The router learns of a worker's death from its control connection: a real ``WorkerClient`` (ZMQ
DEALER, its monitor) in a real ``Registry`` against a ROUTER socket in process that plays the
worker (answers heartbeats). Closing that socket leaves nothing listening at the address, as a
killed process does: the worker is dead within the first reconnect, long before the heartbeat lease
(60 s here), and its request in flight fails with a 503 naming the closed connection. A socket bound
again at the address is taken back by its heartbeats. Then the state rules, on test doubles."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from server.router.inflight import InflightTable
from server.router.link_lost import on_link_lost
from server.router.membership import drain_worker
from server.router.registry import DEAD, DRAINING, READY, RESTARTING, STARTING, Registry, WorkerSpec
from server.router.worker_client import WorkerClient
from tests.support.zmq_peers import bind_router
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import StatsRequest, WorkerStats, decode, encode


def stats(instance: str) -> WorkerStats:
    return WorkerStats(
        worker_id="w0",
        instance=instance,
        role="colocated",
        model="m",
        capacity_tokens=64,
        max_model_len=64,
        page_size=1,
    )


async def answer_heartbeats(sock: zmq.asyncio.Socket, instance: str) -> None:
    while True:
        ident, *parts = await sock.recv_multipart()
        if isinstance(decode(parts)[0], StatsRequest):
            await sock.send_multipart([ident, *encode(stats(instance))])


async def wait_state(reg: Registry, state: str, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while reg.handles["w0"].state != state:
        assert time.monotonic() - t0 < timeout_s, reg.describe()
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_a_closed_control_connection_marks_the_worker_dead_at_once_and_a_new_process_comes_back():
    async def scenario():
        peer_ctx, ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
        sock = bind_router(peer_ctx, "tcp://127.0.0.1:*")
        addr = sock.last_endpoint.decode()
        answering = asyncio.create_task(answer_heartbeats(sock, "first"))
        table = InflightTable()

        def factory(spec, on_tokens, on_stats):
            return WorkerClient(spec.worker_id, spec.addr, ctx, on_tokens, on_stats, auth=ControlAuth.insecure())

        reg = Registry([WorkerSpec("w0", "colocated", addr)], factory, table, interval_s=0.1, timeout_s=60.0)
        await reg.start()
        try:
            await wait_state(reg, READY)
            entry = table.open("r1", ("w0",), "w0", 5)
            answering.cancel()
            sock.close(0)
            detected = await wait_state(reg, DEAD)
            assert detected < 2.0  # the first reconnect, 200 ms on, is refused; the lease is 60 s
            err = entry.queue.get_nowait()
            assert err.error_status == 503 and "closed and the reconnect was refused" in err.error
            assert "closed and the reconnect was refused" in reg.handles["w0"].reason
            sock = bind_router(peer_ctx, addr)  # a new process at the address
            answering = asyncio.create_task(answer_heartbeats(sock, "second"))
            await wait_state(reg, READY)
            assert reg.handles["w0"].restarts == 1
        finally:
            answering.cancel()
            await reg.close()
            sock.close(0)
            ctx.term()
            peer_ctx.term()

    asyncio.run(scenario())


class Double:
    def abort(self, rids, reason):
        pass

    def drain(self, reason):
        pass


def test_the_state_rules_of_a_lost_connection():
    table = InflightTable()
    reg = Registry([WorkerSpec("w0", "colocated", "x")], lambda *a: Double(), table)
    h = reg.handles["w0"]
    on_link_lost(reg, "w0", "gone")  # not serving yet, holds nothing: a worker still starting
    assert (h.state, h.reason) == (STARTING, "waiting for its first heartbeat")
    reg.on_stats("w0", stats("a"))
    reg.mark_restarting("w0", "restarting")  # the launcher is on it already
    on_link_lost(reg, "w0", "gone")
    assert h.state == RESTARTING
    reg.on_stats("w0", stats("b"))
    drain_worker(reg, "w0", "asked")
    on_link_lost(reg, "w0", "gone")  # exited after its drain, nothing held: the launcher or heartbeats say drained
    assert (h.state, h.reason) == (DRAINING, "asked")
    on_link_lost(reg, "unknown", "gone")  # removed meanwhile: nothing to do


def test_a_lost_connection_of_a_ready_worker_fails_its_requests():
    async def scenario():
        table = InflightTable()
        reg = Registry([WorkerSpec("w0", "colocated", "x")], lambda *a: Double(), table)
        reg.on_stats("w0", stats("a"))
        entry = table.open("r1", ("w0",), "w0", 5)
        on_link_lost(reg, "w0", "its control connection closed")
        return reg.handles["w0"], entry.queue.get_nowait()

    h, err = asyncio.run(scenario())
    assert (h.state, h.reason) == (DEAD, "its control connection closed")
    assert err.error_status == 503 and "its control connection closed" in err.error
