"""The PD pool deadlock, end to end: a launched PD cluster (router, 1 prefill
and 1 decode worker, tiny model, real HTTP, KV over NIXL) whose prefill and decode KV pools are
both 384 tokens (24 pages), with no host pool (every retract is a recompute, which the decode
worker reserves first and asks the prefill worker for behind the prompts already queued there) and
a retract forced every 4 decode steps. 16 requests of 30-60 words and 48 or 96 tokens go at once.

Before the prefill worker waited for a prompt's decode destination, the prefill pool filled with
finished KV the decode worker had no room to ask for while the decode pool was held by
destinations of prompts that could not start on the prefill side; the first batch here hung
until ``bootstrap_timeout_s`` (300 s). Asserted: every request ends with all its tokens within
``BOUND_S`` (well under that timeout), twice, with the same tokens both times; recomputes really
happened; afterwards both pools hold nothing (free + cached = total, 0 used) and the host pool is
empty."""

from __future__ import annotations

import asyncio
import random

import pytest

from bench.harness.subprocess_server import metric_sum
from tests.chaos.chaos_cluster import Cluster, leaks, run_load
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

BOOTSTRAP_TIMEOUT_S = 300.0
BOUND_S = 120.0  # a request not done by then is stuck: 16 of them take ~10 s on a loaded 2-core host
WORDS = (
    "river stone light garden window morning paper music silver forest engine voice winter harbor "
    "letter market bridge candle orange summer"
).split()


def test_small_pools_under_recompute_pressure_never_deadlock(tmp_path):
    cluster = Cluster(
        save_tiny_model(tmp_path / "model"),
        prefill=1,
        decode=1,
        args=[
            "--kv-pool-tokens",
            "384",
            "--page-size",
            "16",
            "--max-model-len",
            "512",
            "--host-kv-pool-gb",
            "0",
            "--init-new-token-ratio",
            "0.05",
            "--retract-test-interval",
            "4",
            "--test-step-delay-s",
            "0.005",
            "--max-inflight-per-worker",
            "16",
            "--bootstrap-timeout-s",
            str(BOOTSTRAP_TIMEOUT_S),
        ],
    )
    rng = random.Random(1)
    prompts = [
        (" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60))), rng.choice([48, 96])) for _ in range(16)
    ]
    cluster.start()
    try:
        rounds = [asyncio.run(run_load(cluster.url, prompts, timeout_s=BOUND_S)) for _ in range(2)]
        m = cluster.wait_recovered()
    finally:
        cluster.stop()
    for outs in rounds:
        assert [(o.error, len(o.tokens)) for o in outs] == [(None, n) for _, n in prompts]
    assert [o.tokens for o in rounds[0]] == [o.tokens for o in rounds[1]]
    assert metric_sum(m, "pdserve_retract_recomputed_total") > 0
    assert leaks(m) == (0, 0)
    for worker in ("prefill-0", "decode-0"):
        pages = {s: metric_sum(m, "pdserve_kv_pool_pages", worker=worker, state=s) for s in ("free", "used", "cached")}
        total = metric_sum(m, "pdserve_kv_pool_capacity_pages", worker=worker)
        assert total == 24 and pages["used"] == 0 and pages["free"] + pages["cached"] == total, (worker, pages)
