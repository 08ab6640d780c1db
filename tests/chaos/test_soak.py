"""Soak: 5,000 short requests (``PDSERVE_SOAK_REQUESTS``) through a launched PD
cluster (router, 1 prefill and 1 decode worker, tiny model, KV over NIXL) at concurrency 64, two
tokens each (streamed); the RSS of every process (the router and each worker) is sampled every 250 requests.
After the warm-up (the first fifth of the requests) no process may grow by 5 % or more, every
request succeeds, and the pools end empty. Prints the figures and the run's duration."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum
from tests.chaos.chaos_cluster import Cluster, leaks, rss_bytes, stream_one
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

REQUESTS = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "5000"))
CONCURRENCY = 64
SAMPLE_EVERY = 250
WARMUP = REQUESTS // 5
MAX_GROWTH = 0.05


def sample(pids: dict[str, int]) -> dict[str, int]:
    return {name: rss_bytes(pid) for name, pid in pids.items()}


async def soak(url: str, pids: dict[str, int]) -> tuple[list, dict[int, dict[str, int]]]:
    """Run every request, ``CONCURRENCY`` at a time; RSS samples keyed by requests completed."""
    samples = {0: sample(pids)}
    failures, done = [], 0
    queue = iter(range(REQUESTS))
    limits = httpx.Limits(max_connections=CONCURRENCY + 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, trust_env=False) as c:

        async def client():
            nonlocal done
            for i in queue:
                o = await stream_one(c, f"soak request {i} about the river and the stone", 2, i)
                if o.error is not None or len(o.tokens) != 2:
                    failures.append(o)
                done += 1
                if done % SAMPLE_EVERY == 0:
                    samples[done] = sample(pids)

        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return failures, samples


def test_soak_rss_growth_after_warmup(tmp_path):
    cluster = Cluster(
        save_tiny_model(tmp_path / "model"), prefill=1, decode=1, args=["--kv-pool-tokens", "4096", "--page-size", "16"]
    )
    cluster.start()
    try:
        pids = {"router": cluster.router_pid, **{w: cluster.pid(w) for w in ("prefill-0", "decode-0")}}
        t0 = time.monotonic()
        failures, samples = asyncio.run(soak(cluster.url, pids))
        elapsed = time.monotonic() - t0
        m = cluster.wait_recovered()
        assert {n: cluster.pid(n) for n in ("prefill-0", "decode-0")} == {n: pids[n] for n in ("prefill-0", "decode-0")}
    finally:
        cluster.stop()
    warm = samples[min(k for k in samples if k >= WARMUP)]
    end = samples[max(samples)]
    growth = {n: (end[n] - warm[n]) / warm[n] for n in pids}
    print(
        f"\nsoak: {REQUESTS} requests x 2 tokens, concurrency {CONCURRENCY}, {elapsed:.1f} s "
        f"({REQUESTS / elapsed:.0f} req/s)"
    )
    print("| process | RSS at start | after warm-up | end | growth after warm-up |\n|---|---|---|---|---|")
    for n in pids:
        print(
            f"| {n} | {samples[0][n] / 2**20:.1f} MiB | {warm[n] / 2**20:.1f} MiB | {end[n] / 2**20:.1f} MiB | "
            f"{100 * growth[n]:+.2f} % |"
        )
    for n in pids:
        series = " ".join(f"{samples[k][n] / 2**20:.0f}" for k in sorted(samples) if k % (REQUESTS // 10 or 1) == 0)
        print(f"{n} RSS (MiB) every {REQUESTS // 10} requests: {series}")
    assert failures == [], failures[:3]
    assert metric_sum(m, "pdserve_requests_total", status="200") == REQUESTS
    assert leaks(m) == (0, 0)
    assert all(g < MAX_GROWTH for g in growth.values()), growth
