"""Chaos row: a decode worker that no launcher watches (started on its own, ``pdserve worker``, as in
a compose or Kubernetes deployment, routed to with ``--worker decode=decode-x=ADDR``) is killed with
``kill -9`` under the mixed streamed load while the heartbeat lease is long (``--worker-timeout-s
30``). Only the transport can tell the router in time: its control connection closes and the
reconnect is refused, so the worker is dead within a reconnect interval, its streams continue on
``decode-0`` with the outputs of the fault-free run, long before the lease would have run out.
Started again, the worker is taken back by its heartbeats and nothing is left on any worker."""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from bench.harness.subprocess_server import metric_sum
from benchmarks.failover_load import dead_at, differences, first_difference, mixed_bodies, same_output
from tests.chaos.chaos_cluster import Cluster, leaks, signal_worker
from tests.chaos.test_failover_chaos import ARGS, MAX_TOKENS, STREAMS, WORDS, killed_load, load
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

LEASE_S = 30.0  # the heartbeat lease: far longer than the transport's detection
SEED = int(os.environ.get("PDSERVE_CHAOS_SEED", "1313"))


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
        mixes = mixed_bodies(STREAMS, MAX_TOKENS, WORDS, seed=SEED)
        bodies = [b for _, b in mixes]
        ref = asyncio.run(load(c.url, bodies))
        assert [r["errors"] for r in ref] == [[]] * STREAMS
        before = c.wait_recovered()
        total = sum(b.get("n", 1) for b in bodies) * MAX_TOKENS
        kill_tokens = int(random.Random(SEED + 2).uniform(0.15, 0.5) * total)  # the seeded moment
        killed_at: list[float] = []

        def killing(cluster, worker_id, sig):
            killed_at.append(time.time())
            signal_worker(cluster, worker_id, sig)

        got, victim = asyncio.run(killed_load(c, bodies, kill_tokens, ("decode-x",), signal_with=killing))
        c.external.proc.wait()
        log = c.server.log()
        dead = dead_at(log, victim, killed_at[0])
        assert dead is not None, log[-4000:]
        detection = dead - killed_at[0]
        c.external.start()  # back at its address: taken back by its heartbeats
        m = c.wait_recovered()

        def moved(name: str, **labels: str) -> float:
            return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)

        bad = [(n, first_difference(g, r), differences(g, r)) for (n, _), g, r in zip(mixes, got, ref)]
        bad = [b for b, g, r in zip(bad, got, ref) if not same_output(g, r)]
        continued = moved("pdserve_failovers_total", worker=victim, outcome="continued")
        print(
            f"\nkill -9 of an unwatched decode worker (seed {SEED}): at {kill_tokens}/{total} tokens, "
            f"detected after {detection:.3f}s (lease {LEASE_S:g}s), {continued:g} continued, "
            f"leaks {leaks(m)}, differing {bad}"
        )
        assert f"worker {victim} is dead: its control connection" in log
        assert "closed and the reconnect was refused" in log
        assert "no heartbeat" not in log
        assert detection < 5.0  # a reconnect interval plus the load's delays, against a 30 s lease
        assert [g["errors"] for g in got] == [[]] * STREAMS
        assert bad == []
        assert continued >= 1
        assert moved("pdserve_failovers_total") == continued
        assert leaks(m) == (0, 0)
        assert metric_sum(m, "pdserve_inflight_requests") == 0
    finally:
        c.stop()
