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
import signal

import pytest

from tests.chaos.chaos_cluster import Cluster, signal_worker
from tests.chaos.failover_support import (
    assert_failed_over,
    busiest_first,
    failover_cluster,
    fault_free,
    load,
    outstanding,
    requests_left,
    tokens_reached,
)

pytestmark = [pytest.mark.process, pytest.mark.slow]

DECODES = ("decode-0", "decode-1", "decode-2")


async def twice_killed_load(c: Cluster, bodies: list[dict], kill_tokens: int) -> dict:
    """The load with B stopped and A killed once the clients hold ``kill_tokens`` tokens, then B
    killed once A's requests left it; what happened, with the records."""
    counting, reached = tokens_reached(kill_tokens)
    task = asyncio.create_task(load(c.url, bodies, counting))
    await reached.wait()
    a, b, _ = await asyncio.to_thread(busiest_first, c, DECODES)
    pid_b = signal_worker(c, b, signal.SIGSTOP)
    try:
        b_before = await asyncio.to_thread(outstanding, c, b)
        signal_worker(c, a, signal.SIGKILL)
        await requests_left(c, a)
        b_after = await asyncio.to_thread(outstanding, c, b)
    finally:
        os.kill(pid_b, signal.SIGKILL)  # stopped: killed before it computed a token of them
    return {"got": await task, "a": a, "b": b, "b_before": b_before, "b_after": b_after}


def test_a_continuation_whose_worker_dies_before_its_first_token_fails_over_again(tmp_path):
    with failover_cluster(tmp_path / "model", prefill=1, decode=3) as c:
        ref = fault_free(c.url, c.wait_recovered)
        kill_tokens, total = ref.kill_tokens(salt=3, high=0.4)
        run = asyncio.run(twice_killed_load(c, ref.bodies, kill_tokens))
        a, b = run["a"], run["b"]
        row = (
            f"second failover: {a} killed at {kill_tokens}/{total} tokens, {b} stopped then killed; {b} held "
            f"{run['b_before']:g} outstanding tokens before, {run['b_after']:g} with the continuations"
        )
        assert_failed_over(row, ref, run["got"], c.wait_recovered(), (a, b))
        assert run["b_after"] > run["b_before"]  # B was sent continuations it never started
