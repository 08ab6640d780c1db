"""Chaos rows for live role switching (``POST /admin/role``), on one launched cluster (the tiny
model, real processes, KV over NIXL on loopback): ``pdserve launch`` with 1 prefill + 1 decode
worker (decode-0, a small KV pool that every request is routed to: it parks requests and migrates
them) and one decode worker the test runs itself (decode-x, a large pool and slow steps: a move
into it takes a few of its steps). Each row runs the mixed streamed load of the failover rows
(greedy, seeded temperature, ``json_schema``, ``n=2``, ``logprobs``, stop strings) and compares
every output with the fault-free run of the same bodies; no KV page, host pool byte or in-flight
entry is left on any worker afterwards.

- decode-0 switches to prefill while its migrations to decode-x are in flight: the switch waits for
  them and moves the rest, it completes, nothing is lost; then decode-0 switches back;
- ``kill -9`` of decode-0 while it evacuates to decode-x for a switch (some of its requests already
  moved): those still on it are recovered (a streamed one fails over, one that streamed nothing yet
  is retried on a fresh pair), those moved continue, the switch is answered 409 at once
  (not at its timeout) and not counted, and the launcher brings decode-0 back in its launch role.

(A switch that would leave a role empty is refused in tests/e2e/test_role_switch_e2e.py.)
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import replace

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum
from tests.chaos.chaos_cluster import Cluster, running, signal_worker
from tests.chaos.failover_support import ARGS, SEED, Reference, assert_failed_over, fault_free, load
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

SWITCH_TIMEOUT_S = 30.0  # --drain-timeout-s: bounds the switch; a dead worker must not cost it
# every request goes to decode-0, whose pool holds a few of them: it retracts one every few steps,
# whose pages a waiting request takes, and offers it to decode-x
MIGRATING = [
    "--kv-pool-tokens",
    "384",
    "--route-decode",
    "decode-0",
    "--retract-test-interval",
    "4",
    "--migrate-on-retract",
    "--migrate-after",
    "2",
    "--host-kv-pool-gb",
    "0.25",
    "--health-interval-s",
    "0.05",  # the rows see migrations through the workers' reports: every 50 ms
    "--drain-timeout-s",
    str(SWITCH_TIMEOUT_S),
]
DECODE_X = ["--kv-pool-tokens", "2048", "--retract-test-interval", "1000000", "--test-step-delay-s", "0.1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("role-faults-model"))
    yield from running(Cluster(model, prefill=1, decode=1, args=[*ARGS, *MIGRATING], external=DECODE_X))


def switched(m: dict, old: str, new: str) -> float:
    return metric_sum(m, "pdserve_role_switches_total", **{"from": old, "to": new})


def moved(m: dict, before: dict, name: str, **labels: str) -> float:
    return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)


async def post_role(url: str, worker: str, role: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=2 * SWITCH_TIMEOUT_S + 30, trust_env=False) as client:
        return await client.post(f"{url}/admin/role", json={"worker": worker, "role": role})


async def until(cluster: Cluster, what, timeout_s: float = 60.0) -> dict:
    """Poll the router's metrics until ``what(m)``; those metrics."""
    deadline = time.monotonic() + timeout_s
    while not what(m := await asyncio.to_thread(cluster.metrics)):
        assert time.monotonic() < deadline, cluster.log_tail()
        await asyncio.sleep(0.02)
    return m


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> Reference:
    """The fault-free run of the mixed load, once for both rows."""
    return fault_free(cluster.url, cluster.wait_recovered)


def since_now(ref: Reference, cluster: Cluster) -> Reference:
    """``ref`` with its metrics taken now: a row's counters move from here."""
    return replace(ref, before=cluster.wait_recovered())


def test_a_switch_during_migrations_moves_every_request_again(cluster, reference):
    ref = since_now(reference, cluster)
    before = ref.before

    async def scenario():
        task = asyncio.create_task(load(cluster.url, ref.bodies))
        name = "pdserve_migrations_total"
        await until(cluster, lambda m: moved(m, before, name, worker="decode-0", direction="out", outcome="done") >= 1)
        r = await post_role(cluster.url, "decode-0", "prefill")
        return await task, r

    got, r = asyncio.run(scenario())
    m = cluster.wait_recovered()
    health = httpx.get(f"{cluster.url}/health", timeout=10, trust_env=False).text
    # back first, whatever the checks find: the next row starts from decode-0 decoding
    back = asyncio.run(post_role(cluster.url, "decode-0", "decode")) if r.status_code == 200 else None
    into = {w: moved(m, before, "pdserve_migrations_total", worker=w, direction="in") for w in ("decode-0", "decode-x")}
    print(f"\nswitch during migrations (seed {SEED}): {r.status_code} {r.text}; moved in {into}")
    assert_failed_over("switch during migrations", ref, got, m)
    assert r.status_code == 200, r.text
    assert switched(m, "decode", "prefill") - switched(before, "decode", "prefill") == 1
    assert "decode-0 (prefill): ready" in health
    assert back.status_code == 200, back.text


def test_kill9_of_the_switching_worker_mid_evacuation_loses_nothing(cluster, reference):
    ref = since_now(reference, cluster)
    before, name = ref.before, "pdserve_migrations_total"

    async def scenario():
        task = asyncio.create_task(load(cluster.url, ref.bodies))
        # some requests moved to decode-x already (decode-0's pool is full), some stream on decode-0
        await until(cluster, lambda m: moved(m, before, name, worker="decode-x", direction="in", outcome="done") >= 1)
        await until(cluster, lambda m: metric_sum(m, "pdserve_queue_requests", worker="decode-0", queue="running") >= 2)
        # decode-x stopped: decode-0's evacuation offers its streams but cannot hand them over, so the
        # kill lands while they are on their way out, however fast the host
        signal_worker(cluster, "decode-x", signal.SIGSTOP)
        switch = asyncio.create_task(post_role(cluster.url, "decode-0", "prefill"))
        async with httpx.AsyncClient(base_url=cluster.url, timeout=10, trust_env=False) as c:
            while "decode-0 (decode): switching" not in (await c.get("/health")).text:  # it evacuates now
                assert not switch.done(), switch.result().text
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        signal_worker(cluster, "decode-0", signal.SIGKILL)
        signal_worker(cluster, "decode-x", signal.SIGCONT)
        t0 = time.monotonic()
        r = await switch
        answered_s = time.monotonic() - t0
        return await task, r, answered_s

    got, r, answered_s = asyncio.run(scenario())
    m = cluster.wait_recovered()
    print(f"\nkill -9 mid-switch (seed {SEED}): {r.status_code} after {answered_s:.2f}s {r.text}")
    moved_by = assert_failed_over("kill -9 mid-switch", ref, got, m)
    # streams still on decode-0 or on their way out continued elsewhere (a stream on its way out is
    # counted under the worker the router last pointed it at)
    assert moved_by("pdserve_failovers_total", outcome="continued") >= 1
    assert r.status_code == 409 and "decode-0" in r.json()["error"]["message"], r.text
    assert answered_s < SWITCH_TIMEOUT_S / 2
    assert switched(m, "decode", "prefill") == switched(before, "decode", "prefill")
    assert "decode-0 (decode): ready" in httpx.get(f"{cluster.url}/health", timeout=10, trust_env=False).text
