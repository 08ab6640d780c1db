"""Chaos rows for failover beside the decode worker's kill -9 (``test_failover_prefill.py``, with 2
prefill workers), each on a launch of its own (the tiny model, real processes, KV over NIXL on
loopback) under the same mixed streamed load (greedy, seeded temperature, ``json_schema``,
``n=2``, ``logprobs``, stop strings), every output compared with the fault-free run of the same
bodies, and no KV page, host pool byte or in-flight entry left on any worker once the killed one is
back:

- 2 colocated replicas, ``kill -9`` of the one running the most requests once a seeded share of the
  tokens went out (``PDSERVE_CHAOS_SEED``): its streams continue on the other replica;
- 2 colocated replicas, SIGSTOP of the busier one at a seeded moment: detected by the heartbeats,
  its streams continue on the other replica; SIGCONT once the load ended;
- 1 prefill + 2 decode workers, SIGSTOP of the decode worker running the most requests at a seeded
  moment: the router learns of it from the heartbeats (``--worker-timeout-s``) and its streams
  continue on the other decode worker; SIGCONT once the load ended: the worker is taken back, and
  what it still held of the requests it lost ends there (no page left).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from bench.harness.subprocess_server import LaunchedServer, scrape_metrics, wait_idle
from benchmarks.failover_load import worker_pid
from tests.chaos.chaos_cluster import HEARTBEAT_S, Cluster, signal_worker
from tests.chaos.failover_support import ARGS, assert_failed_over, fault_free, killed_load
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

LEASE_S = 3.0  # the router's worker_timeout_s in the SIGSTOP row: detection by heartbeats


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("failover-rows-model"))


def replicas_recovered(url: str, timeout_s: float = 90.0) -> dict:
    """Fresh metrics once ``/health`` is 200 (the killed replica is back) and every worker is idle."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code != 200:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.25)
    return wait_idle(url, HEARTBEAT_S, timeout_s=max(5.0, deadline - time.monotonic()))


class Replicas:
    """What ``killed_load`` needs of a cluster, for a ``LaunchedServer`` of colocated replicas."""

    def __init__(self, server: LaunchedServer) -> None:
        self.server, self.url = server, server.url

    def metrics(self) -> dict:
        return scrape_metrics(self.url)

    def pid(self, worker_id: str) -> int:
        return worker_pid(self.server, worker_id)


def replica_args(model, extra: list[str]) -> list[str]:
    """2 colocated replicas of the tiny model, least-loaded routing, the rows' shared flags."""
    args = ["--mode", "colocated", "--replicas", "2", "--port", "0", "--model", str(model)]
    args += ["--health-interval-s", str(HEARTBEAT_S), "--log-level", "WARNING", "--routing", "least-loaded"]
    return [*args, *ARGS, *extra]


def test_kill9_of_a_colocated_replica_under_mixed_streams_loses_nothing(model):
    with LaunchedServer(replica_args(model, [])) as server:
        ref = fault_free(server.url, lambda: replicas_recovered(server.url))
        kill_tokens, total = ref.kill_tokens(salt=0)
        got, victim = asyncio.run(
            killed_load(Replicas(server), ref.bodies, kill_tokens, ("colocated-0", "colocated-1"))
        )
        row = f"replica kill -9: {victim} at {kill_tokens}/{total} tokens"
        assert_failed_over(row, ref, got, replicas_recovered(server.url), (victim,))


def test_sigstop_of_a_colocated_replica_is_detected_by_heartbeats_and_loses_nothing(model):
    """The replica stopped (SIGSTOP) at the seeded moment: the router learns of it from the heartbeats
    (``--worker-timeout-s``) and its streams continue on the other replica; SIGCONT once the load
    ended: what the stopped replica still held of the requests it lost ends there (no page left)."""
    with LaunchedServer(replica_args(model, ["--worker-timeout-s", str(LEASE_S)])) as server:
        ref = fault_free(server.url, lambda: replicas_recovered(server.url))
        kill_tokens, total = ref.kill_tokens(salt=2)
        stopped: dict[str, int] = {}

        def stopping(cluster, worker_id, sig):  # killed_load's signal, turned into SIGSTOP
            stopped[worker_id] = cluster.pid(worker_id)
            os.kill(stopped[worker_id], signal.SIGSTOP)

        try:
            replicas = Replicas(server)
            got, victim = asyncio.run(
                killed_load(replicas, ref.bodies, kill_tokens, ("colocated-0", "colocated-1"), signal_with=stopping)
            )
        finally:
            for pid in stopped.values():
                os.kill(pid, signal.SIGCONT)
        row = f"replica SIGSTOP: {victim} at {kill_tokens}/{total} tokens"
        assert_failed_over(row, ref, got, replicas_recovered(server.url), (victim,))
        assert f"worker {victim} is dead: no heartbeat" in server.log()


def test_sigstop_of_a_decode_worker_is_detected_by_heartbeats_and_loses_nothing(model):
    c = Cluster(model, prefill=1, decode=2, args=[*ARGS, "--worker-timeout-s", str(LEASE_S)])
    c.start()
    try:
        ref = fault_free(c.url, c.wait_recovered)
        kill_tokens, total = ref.kill_tokens(salt=1)
        stopped: dict[str, int] = {}

        def stopping(cluster, worker_id, sig):  # killed_load's signal, turned into SIGSTOP
            stopped[worker_id] = signal_worker(cluster, worker_id, signal.SIGSTOP)

        try:
            got, victim = asyncio.run(killed_load(c, ref.bodies, kill_tokens, signal_with=stopping))
        finally:
            for pid in stopped.values():
                os.kill(pid, signal.SIGCONT)
        m = c.wait_recovered()
        assert_failed_over(f"decode SIGSTOP: {victim} at {kill_tokens}/{total} tokens", ref, got, m, (victim,))
        assert f"worker {victim} is dead: no heartbeat" in c.server.log()
    finally:
        c.stop()
