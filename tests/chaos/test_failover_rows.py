"""Chaos rows for failover beside the decode worker's kill -9 (``test_failover_chaos.py``), each on a
launch of its own (the tiny model, real processes, KV over NIXL on loopback) under the same mixed
streamed load (greedy, seeded temperature, ``json_schema``, ``n=2``, ``logprobs``, stop strings),
every output compared with the fault-free run of the same bodies, and no KV page, host pool byte
or in-flight entry left on any worker once the killed one is back:

- 2 prefill + 1 decode workers, ``kill -9`` of a prefill worker before the handoff: it is stopped
  (SIGSTOP) before the load, so the requests routed to it wait in its queue, then killed once all of
  them reached the router; each of them goes to the other prefill worker (a fresh-pair retry);
- 2 colocated replicas, ``kill -9`` of the one running the most requests once a seeded share of the
  tokens went out (``PDSERVE_CHAOS_SEED``): its streams continue on the other replica;
- 1 prefill + 2 decode workers, SIGSTOP of the decode worker running the most requests at a seeded
  moment: the router learns of it from the heartbeats (``--worker-timeout-s``) and its streams
  continue on the other decode worker; SIGCONT once the load ended: the worker is taken back, and
  what it still held of the requests it lost ends there (no page left).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

from bench.harness.subprocess_server import LaunchedServer, metric_sum, scrape_metrics, wait_idle
from benchmarks.failover_load import differences, first_difference, mixed_bodies, same_output, worker_pid
from tests.chaos.chaos_cluster import HEARTBEAT_S, Cluster, leaks, signal_worker
from tests.chaos.test_failover_chaos import ARGS, MAX_TOKENS, STREAMS, WORDS, killed_load, load
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

LEASE_S = 3.0  # the router's worker_timeout_s in the SIGSTOP row: detection by heartbeats

SEED = int(os.environ.get("PDSERVE_CHAOS_SEED", "1313"))


def differing(mixes, got: list[dict], ref: list[dict]) -> list:
    """(mix, first differing token, what differs) of every request whose output is not the reference's."""
    return [
        (n, first_difference(g, r), differences(g, r)) for (n, _), g, r in zip(mixes, got, ref) if not same_output(g, r)
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("failover-rows-model"))


def test_kill9_of_a_prefill_worker_before_the_handoff_goes_to_the_other(model):
    c = Cluster(model, prefill=2, decode=1, args=ARGS)
    c.start()
    try:
        mixes = mixed_bodies(STREAMS, MAX_TOKENS, WORDS, seed=SEED)
        bodies = [b for _, b in mixes]
        ref = asyncio.run(load(c.url, bodies))
        assert [r["errors"] for r in ref] == [[]] * STREAMS
        before = c.wait_recovered()
        signal_worker(c, "prefill-0", signal.SIGSTOP)

        async def scenario():
            task = asyncio.create_task(load(c.url, bodies))
            deadline = time.monotonic() + 30
            while metric_sum(await asyncio.to_thread(c.metrics), "pdserve_inflight_requests") < STREAMS:
                assert time.monotonic() < deadline, "the load never reached the router"
                await asyncio.sleep(0.05)
            signal_worker(c, "prefill-0", signal.SIGKILL)
            return await task

        got = asyncio.run(scenario())
        m = c.wait_recovered()
        retried = metric_sum(m, "pdserve_router_retries_total") - metric_sum(before, "pdserve_router_retries_total")
        bad = differing(mixes, got, ref)
        print(
            f"\nprefill kill -9 before the handoff (seed {SEED}): {retried:g} retried, "
            f"leaks {leaks(m)}, differing {bad}"
        )
        assert [g["errors"] for g in got] == [[]] * STREAMS
        assert bad == []
        assert retried >= 1  # the stopped worker held requests: they went to prefill-1
        assert leaks(m) == (0, 0)
        assert metric_sum(m, "pdserve_inflight_requests") == 0
    finally:
        c.stop()


def replicas_recovered(url: str, timeout_s: float = 90.0) -> dict:
    """Fresh metrics once ``/health`` is 200 (the killed replica is back) and every worker is idle."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code != 200:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.25)
    return wait_idle(url, HEARTBEAT_S, timeout_s=max(5.0, deadline - time.monotonic()))


def test_kill9_of_a_colocated_replica_under_mixed_streams_loses_nothing(model):
    args = ["--mode", "colocated", "--replicas", "2", "--port", "0", "--model", str(model)]
    args += ["--health-interval-s", str(HEARTBEAT_S), "--log-level", "WARNING", "--routing", "least-loaded", *ARGS]
    with LaunchedServer(args) as server:
        mixes = mixed_bodies(STREAMS, MAX_TOKENS, WORDS, seed=SEED)
        bodies = [b for _, b in mixes]
        ref = asyncio.run(load(server.url, bodies))
        assert [r["errors"] for r in ref] == [[]] * STREAMS
        before = replicas_recovered(server.url)
        total = sum(b.get("n", 1) for b in bodies) * MAX_TOKENS
        kill_tokens = int(random.Random(SEED).uniform(0.15, 0.5) * total)  # the seeded moment

        class Replicas:  # what killed_load needs of a cluster
            url = server.url

            @staticmethod
            def metrics():
                return scrape_metrics(server.url)

            @staticmethod
            def pid(worker_id: str) -> int:
                return worker_pid(server, worker_id)

        got, victim = asyncio.run(killed_load(Replicas, bodies, kill_tokens, ("colocated-0", "colocated-1")))
        m = replicas_recovered(server.url)

        def moved(name: str, **labels: str) -> float:
            return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)

        bad = differing(mixes, got, ref)
        print(
            f"\nreplica kill -9 (seed {SEED}): {victim} at {kill_tokens}/{total} tokens; "
            f"{moved('pdserve_failovers_total', outcome='continued'):g} continued, leaks {leaks(m)}, differing {bad}"
        )
        assert [g["errors"] for g in got] == [[]] * STREAMS
        assert bad == []
        assert moved("pdserve_failovers_total", worker=victim, outcome="continued") >= 1
        assert moved("pdserve_failovers_total") == moved("pdserve_failovers_total", outcome="continued")
        assert leaks(m) == (0, 0)
        assert metric_sum(m, "pdserve_inflight_requests") == 0


def test_sigstop_of_a_decode_worker_is_detected_by_heartbeats_and_loses_nothing(model):
    c = Cluster(model, prefill=1, decode=2, args=[*ARGS, "--worker-timeout-s", str(LEASE_S)])
    c.start()
    try:
        mixes = mixed_bodies(STREAMS, MAX_TOKENS, WORDS, seed=SEED)
        bodies = [b for _, b in mixes]
        ref = asyncio.run(load(c.url, bodies))
        assert [r["errors"] for r in ref] == [[]] * STREAMS
        before = c.wait_recovered()
        total = sum(b.get("n", 1) for b in bodies) * MAX_TOKENS
        kill_tokens = int(random.Random(SEED + 1).uniform(0.15, 0.5) * total)  # the seeded moment
        stopped: dict[str, int] = {}

        def stopping(cluster, worker_id, sig):  # killed_load's signal, turned into SIGSTOP
            stopped[worker_id] = signal_worker(cluster, worker_id, signal.SIGSTOP)

        try:
            got, victim = asyncio.run(killed_load(c, bodies, kill_tokens, signal_with=stopping))
        finally:
            for pid in stopped.values():
                os.kill(pid, signal.SIGCONT)
        m = c.wait_recovered()

        def moved(name: str, **labels: str) -> float:
            return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)

        bad = differing(mixes, got, ref)
        print(
            f"\ndecode SIGSTOP (seed {SEED}): {victim} at {kill_tokens}/{total} tokens; "
            f"{moved('pdserve_failovers_total', outcome='continued'):g} continued, leaks {leaks(m)}, differing {bad}"
        )
        assert [g["errors"] for g in got] == [[]] * STREAMS
        assert bad == []
        assert f"worker {victim} is dead: no heartbeat" in c.server.log()
        assert moved("pdserve_failovers_total", worker=victim, outcome="continued") >= 1
        assert moved("pdserve_failovers_total") == moved("pdserve_failovers_total", outcome="continued")
        assert leaks(m) == (0, 0)
        assert metric_sum(m, "pdserve_inflight_requests") == 0
    finally:
        c.stop()
