"""Chaos row: a second failover. 1 prefill + 3 decode workers (the tiny model) under the mixed
streamed load; at a seeded moment the second busiest decode worker (B) is stopped (SIGSTOP) and the
busiest (A) is killed (``kill -9``). A's streams continue as continuations, some of them on B, which
cannot start them: they are waiting for their recompute, no new token yet, when B is killed in turn.
Those fail over a second time (``--max-failovers`` 2), to the third decode worker (A, restarted, is
not a route for its own requests), B's own streams a first time. Every request ends whole, with the
outputs of the fault-free run; once A and B are back nothing is left on any worker."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest

from bench.harness.subprocess_server import metric_sum
from benchmarks.failover_load import mixed_bodies
from tests.chaos.chaos_cluster import Cluster, leaks, signal_worker
from tests.chaos.test_failover_chaos import ARGS, MAX_TOKENS, STREAMS, WORDS, load
from tests.chaos.test_failover_rows import differing
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

SEED = int(os.environ.get("PDSERVE_CHAOS_SEED", "1313"))
DECODES = ("decode-0", "decode-1", "decode-2")


def outstanding(c: Cluster, worker: str) -> float:
    """Prompt + max_tokens of the router's requests in flight on ``worker`` (its own table, live)."""
    return metric_sum(c.metrics(), "pdserve_router_outstanding_tokens", worker=worker)


async def twice_killed_load(c: Cluster, bodies: list[dict], kill_tokens: int) -> dict:
    """The load with B stopped and A killed once the clients hold ``kill_tokens`` tokens, then B
    killed once A's requests left it; what happened, with the records."""
    held: dict[int, int] = {}
    reached = asyncio.Event()

    def counting(out: dict) -> None:
        held[id(out)] = out["tokens"]
        if sum(held.values()) >= kill_tokens:
            reached.set()

    task = asyncio.create_task(load(c.url, bodies, counting))
    await reached.wait()
    m = await asyncio.to_thread(c.metrics)
    a, b, _ = sorted(DECODES, key=lambda w: -metric_sum(m, "pdserve_queue_requests", worker=w, queue="running"))
    pid_b = signal_worker(c, b, signal.SIGSTOP)
    try:
        b_before = await asyncio.to_thread(outstanding, c, b)
        signal_worker(c, a, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(outstanding, c, a) > 0:  # A's requests failed: continuations go out
            assert time.monotonic() < deadline, f"{a}'s requests never left it"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        b_after = await asyncio.to_thread(outstanding, c, b)
    finally:
        os.kill(pid_b, signal.SIGKILL)  # stopped: killed before it computed a token of them
    return {"got": await task, "a": a, "b": b, "b_before": b_before, "b_after": b_after}


def test_a_continuation_whose_worker_dies_before_its_first_token_fails_over_again(tmp_path):
    c = Cluster(save_tiny_model(tmp_path / "model"), prefill=1, decode=3, args=[*ARGS, "--worker-timeout-s", "30"])
    c.start()
    try:
        mixes = mixed_bodies(STREAMS, MAX_TOKENS, WORDS, seed=SEED)
        bodies = [b for _, b in mixes]
        ref = asyncio.run(load(c.url, bodies))
        assert [r["errors"] for r in ref] == [[]] * STREAMS
        before = c.wait_recovered()
        total = sum(b.get("n", 1) for b in bodies) * MAX_TOKENS
        kill_tokens = int(random.Random(SEED + 3).uniform(0.15, 0.4) * total)  # the seeded moment
        run = asyncio.run(twice_killed_load(c, bodies, kill_tokens))
        got, a, b = run["got"], run["a"], run["b"]
        m = c.wait_recovered()

        def moved(name: str, **labels: str) -> float:
            return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)

        bad = differing(mixes, got, ref)
        from_a = moved("pdserve_failovers_total", worker=a, outcome="continued")
        from_b = moved("pdserve_failovers_total", worker=b, outcome="continued")
        print(
            f"\nsecond failover (seed {SEED}): {a} killed at {kill_tokens}/{total} tokens, {b} stopped then "
            f"killed; {b} held {run['b_before']:g} outstanding tokens before, {run['b_after']:g} with the "
            f"continuations; continued from {a}: {from_a:g}, from {b}: {from_b:g}; leaks {leaks(m)}, differing {bad}"
        )
        assert run["b_after"] > run["b_before"]  # B was sent continuations it never started
        assert [g["errors"] for g in got] == [[]] * STREAMS
        assert bad == []
        assert from_a >= 1 and from_b >= 1
        assert moved("pdserve_failovers_total") == moved("pdserve_failovers_total", outcome="continued")
        assert leaks(m) == (0, 0)
        assert metric_sum(m, "pdserve_inflight_requests") == 0
    finally:
        c.stop()
