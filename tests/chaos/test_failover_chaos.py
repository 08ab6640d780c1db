"""Chaos row for failover: a launched 1 prefill + 2 decode cluster (the tiny model, real processes,
KV over NIXL on loopback) under a mixed streamed load (greedy, seeded temperature, ``json_schema``,
``n=2``, ``logprobs``, stop strings) loses a decode worker to ``kill -9`` at a seeded moment (a
seeded share of all tokens streamed, ``PDSERVE_CHAOS_SEED``). Every request must end whole: no
error, and text, token ids, finish reason, logprobs and usage those of the fault-free run of the
same bodies; the failovers were counted as continued; once the killed worker is back, no KV page,
host pool byte or in-flight entry is left on any worker."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum
from benchmarks.failover_load import astream, differences, first_difference, mixed_bodies, same_output
from tests.chaos.chaos_cluster import Cluster, leaks, signal_worker
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

SEED = int(os.environ.get("PDSERVE_CHAOS_SEED", "1313"))
STREAMS, MAX_TOKENS = 12, 48
WORDS = "river stone light garden window morning paper music silver forest engine voice winter harbor".split()
ARGS = ["--kv-pool-tokens", "2048", "--page-size", "16", "--max-model-len", "512", "--test-step-delay-s", "0.02"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(save_tiny_model(tmp_path_factory.mktemp("failover-model")), prefill=1, decode=2, args=ARGS)
    c.start()
    yield c
    c.stop()


async def load(url: str, bodies: list[dict], on_chunk=None) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=32)) as c:
        return await asyncio.gather(*(astream(c, b, on_chunk) for b in bodies))


async def killed_load(
    cluster: Cluster,
    bodies: list[dict],
    kill_tokens: int,
    workers: tuple[str, ...] = ("decode-0", "decode-1"),
    signal_with=signal_worker,
) -> tuple[list[dict], str]:
    """The load with ``kill -9`` (``signal_with(cluster, worker, SIGKILL)``) of the one of ``workers``
    running the most requests once the clients hold ``kill_tokens`` tokens; (records, victim)."""
    held: dict[int, int] = {}
    reached = asyncio.Event()

    def counting(out: dict) -> None:
        held[id(out)] = out["tokens"]
        if sum(held.values()) >= kill_tokens:
            reached.set()

    task = asyncio.create_task(load(cluster.url, bodies, counting))
    await reached.wait()
    m = await asyncio.to_thread(cluster.metrics)
    victim = max(
        workers,
        key=lambda w: metric_sum(m, "pdserve_queue_requests", worker=w, queue="running"),
    )
    signal_with(cluster, victim, signal.SIGKILL)
    return await task, victim


def test_kill9_of_a_decode_worker_under_mixed_streams_loses_nothing(cluster):
    rng = random.Random(SEED)
    mixes = mixed_bodies(STREAMS, MAX_TOKENS, WORDS, seed=SEED)
    bodies = [b for _, b in mixes]
    ref = asyncio.run(load(cluster.url, bodies))
    assert [r["errors"] for r in ref] == [[]] * STREAMS
    before = cluster.wait_recovered()
    total = sum(b.get("n", 1) for b in bodies) * MAX_TOKENS
    kill_tokens = int(rng.uniform(0.15, 0.5) * total)  # the seeded moment
    got, victim = asyncio.run(killed_load(cluster, bodies, kill_tokens))
    m = cluster.wait_recovered()  # the launcher restarted the victim; every worker idle again

    def moved(name: str, **labels: str) -> float:
        return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)

    differing = [
        (n, first_difference(g, r), differences(g, r), g["usage"], r["usage"])
        for (n, _), g, r in zip(mixes, got, ref)
        if not same_output(g, r)
    ]
    print(
        f"\nfailover chaos (seed {SEED}): kill -9 {victim} at {kill_tokens}/{total} tokens; "
        f"{moved('pdserve_failovers_total', outcome='continued'):g} continued, "
        f"{moved('pdserve_failover_recomputed_tokens_total'):g} tokens recomputed, leaks {leaks(m)}, "
        f"differing {differing}"
    )
    assert [g["errors"] for g in got] == [[]] * STREAMS
    assert differing == []
    assert moved("pdserve_failovers_total", worker=victim, outcome="continued") >= 1
    assert moved("pdserve_failovers_total") == moved("pdserve_failovers_total", outcome="continued")
    assert leaks(m) == (0, 0)
    assert metric_sum(m, "pdserve_inflight_requests") == 0
