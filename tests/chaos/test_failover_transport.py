"""Chaos row: a decode worker that no launcher watches (started on its own, ``pdserve worker``, as in
a compose or Kubernetes deployment, routed to with ``--worker decode=decode-x=ADDR``) is killed with
``kill -9`` under the mixed streamed load while the heartbeat lease is long (``--worker-timeout-s
30``). Only the transport can tell the router in time: its control connection closes and the
reconnect is refused, so the worker is dead within a reconnect interval, its streams continue on
``decode-0`` with the outputs of the fault-free run, long before the lease would have run out.
Started again, the worker is taken back by its heartbeats and nothing is left on any worker."""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks.failover_load import dead_at
from tests.chaos.chaos_cluster import Cluster, signal_worker
from tests.chaos.failover_support import ARGS, assert_failed_over, fault_free, killed_load
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

LEASE_S = 30.0  # the heartbeat lease: far longer than the transport's detection


def test_kill9_of_a_worker_no_launcher_watches_is_seen_through_its_closed_connection(tmp_path):
    c = Cluster(
        save_tiny_model(tmp_path / "model"),
        prefill=1,
        decode=1,
        args=[*ARGS, "--worker-timeout-s", str(LEASE_S), "--log-level", "INFO"],
        external=[],
    )
    c.start()
    try:
        ref = fault_free(c.url, c.wait_recovered)
        kill_tokens, total = ref.kill_tokens(salt=2)
        killed_at: list[float] = []

        def killing(cluster, worker_id, sig):
            killed_at.append(time.time())
            signal_worker(cluster, worker_id, sig)

        got, victim = asyncio.run(killed_load(c, ref.bodies, kill_tokens, ("decode-x",), signal_with=killing))
        c.external.proc.wait()
        log = c.server.log()
        dead = dead_at(log, victim, killed_at[0])
        assert dead is not None, log[-4000:]
        detection = dead - killed_at[0]
        c.external.start()  # back at its address: taken back by its heartbeats
        row = f"kill -9 of an unwatched decode worker at {kill_tokens}/{total} tokens, detected after {detection:.3f}s"
        moved = assert_failed_over(row, ref, got, c.wait_recovered(), (victim,))
        assert f"worker {victim} is dead: its control connection" in log
        assert "closed and the reconnect was refused" in log
        assert "no heartbeat" not in log
        assert detection < 5.0  # a reconnect interval plus the load's delays, against a 30 s lease
        assert moved("pdserve_failovers_total") == moved("pdserve_failovers_total", worker=victim)
    finally:
        c.stop()
