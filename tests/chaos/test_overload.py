"""Overload: a launched PD cluster (router, 1 prefill and 1 decode worker, tiny model, real
HTTP) behind the router's admission stage.

1. ``test_overload_then_recovery``: unloaded TTFT, then the measured capacity (closed loop), then
   Poisson arrivals at 3x that capacity for ``PDSERVE_OVERLOAD_S`` seconds (mixed prompt and output
   lengths), then 0.5x for ``PDSERVE_RECOVER_S``. Asserted: only 200 / 429 / 504, every 200
   carries all its tokens, every 429 has ``Retry-After`` and is counted in
   ``pdserve_shed_requests_total``, overload really shed, nothing leaked. Printed (the goals
   table): 429 latency P99 (seen by a probe in its own process, and by the load generator, whose
   busy event loop adds its own delay), accepted TTFT P99 against ``max_queue_wait_s`` + one prefill, RSS growth
   after warm-up, time back to normal latency.
2. ``test_light_key_under_a_heavy_one``: two API keys with equal shares, one sending 10x the other
   (and 2x the capacity); asserted: the light key is never refused; printed: its TTFT P99 loaded vs
   alone.
3. ``test_soak_under_retract_pressure``: ``PDSERVE_RETRACT_SOAK_REQUESTS`` requests (default 144, each
   of the 24 distinct prompts 6 times: 115 retractions, 60 resumes and 55 recomputes in a run; 288, 600
   and 2000 made the same assertions) through a decode KV pool of 512
   tokens (6 requests in flight of up to ~125 tokens each) and a host pool of a few pages, so retract
   with offload, resume and recompute happen all along; asserted: every output equals the same
   prompt's output run alone, retractions / resumes / recomputes all happened, no page or host byte leaked;
   printed: counts and RSS.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from bench.harness.subprocess_server import metric_sum
from tests.chaos.chaos_cluster import Cluster, leaks, rss_bytes
from tests.chaos.overload_load import (
    HEAVY,
    LIGHT,
    WORDS,
    Shot,
    check_outcomes,
    client,
    closed_loop,
    pct,
    poisson,
    sample_rss,
    shoot,
)
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

OVERLOAD_S = float(os.environ.get("PDSERVE_OVERLOAD_S", "20"))
RECOVER_S = float(os.environ.get("PDSERVE_RECOVER_S", "10"))
SOAK_REQUESTS = int(os.environ.get("PDSERVE_RETRACT_SOAK_REQUESTS", "144"))
SEED = int(os.environ.get("PDSERVE_CHAOS_SEED", "1313"))
QUEUE_WAIT_S = 2.0
ROOT = Path(__file__).resolve().parents[2]  # the repository: the load processes run tests.chaos modules
# a batch of 8 and the default forwarding bound (the batch + 2): beyond that, requests queue in the router
ADMISSION = [
    "--max-running-requests",
    "8",
    "--max-queued-requests",
    "32",
    "--max-queue-wait-s",
    str(QUEUE_WAIT_S),
    "--api-key",
    f"{HEAVY}:1,{LIGHT}:1",
]
SHED_429 = ("queue_full", "queue_tokens", "queue_wait", "displaced")
ROWS: list[tuple[str, str, str]] = []


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(
        save_tiny_model(tmp_path_factory.mktemp("overload-model")),
        prefill=1,
        decode=1,
        args=["--kv-pool-tokens", "4096", "--page-size", "16", *ADMISSION],
    )
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def baseline(cluster):
    """(unloaded TTFT P50, unloaded TTFT P99, capacity in requests/s) of ``cluster``."""
    rng = random.Random(SEED)
    asyncio.run(closed_loop(cluster.url, 5, 1, rng))  # warm-up
    alone, _ = asyncio.run(closed_loop(cluster.url, 30, 1, rng))
    loaded, elapsed = asyncio.run(closed_loop(cluster.url, 120, 16, rng))
    check_outcomes(alone + loaded)
    ttfts = [s.ttft for s in alone]
    cap = sum(s.status == 200 for s in loaded) / elapsed
    ROWS.append(("unloaded TTFT P50 / P99", "-", f"{pct(ttfts, 0.5) * 1e3:.0f} / {pct(ttfts, 0.99) * 1e3:.0f} ms"))
    ROWS.append(("capacity (closed loop, 16 clients)", "-", f"{cap:.1f} req/s"))
    return pct(ttfts, 0.5), pct(ttfts, 0.99), cap


def test_overload_then_recovery(cluster, baseline):
    p50, p99, cap = baseline
    rng = random.Random(SEED + 1)
    pids = {"router": cluster.router_pid, **{w: cluster.pid(w) for w in ("prefill-0", "decode-0")}}
    m0 = cluster.metrics()

    probe = subprocess.Popen(
        [sys.executable, "-m", "tests.chaos.probe429", cluster.url, HEAVY, str(OVERLOAD_S), "0.05"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )

    async def run():
        rss: list = []
        sampler = asyncio.create_task(sample_rss(pids, rss))
        async with client(cluster.url) as c:
            over = await poisson(c, 3 * cap, OVERLOAD_S, rng)
            t_over_end = time.monotonic()
            calm = await poisson(c, 0.5 * cap, RECOVER_S, rng)
            over, calm = await asyncio.gather(asyncio.gather(*over), asyncio.gather(*calm))
        sampler.cancel()
        return over, calm, t_over_end, rss

    over, calm, t_over_end, rss = asyncio.run(run())
    probed = json.loads(probe.communicate(timeout=600)[0])
    m = cluster.wait_recovered()
    statuses = check_outcomes(over + calm)
    assert {s for s, _ in probed} <= {200, 429, 504}, Counter(s for s, _ in probed)
    assert statuses[429] > 0 and statuses[200] > 0, statuses  # it was overloaded, and still served
    shed = sum(
        metric_sum(m, "pdserve_shed_requests_total", reason=r) - metric_sum(m0, "pdserve_shed_requests_total", reason=r)
        for r in SHED_429
    )
    assert shed == statuses[429] + sum(s == 429 for s, _ in probed)
    assert metric_sum(m, "pdserve_queued_requests") == 0 and leaks(m) == (0, 0)

    fast = [s.t_head - s.t_start for s in over + calm if s.status == 429]
    probe_429 = [t for s, t in probed if s == 429]
    accepted = [s.ttft for s in over if s.status == 200]
    normal = max(2 * p99, p99 + 0.05)
    late = [s.t_start - t_over_end for s in calm if s.status != 200 or s.ttft > normal]
    warm = next(i for i, (t, _) in enumerate(rss) if t >= rss[0][0] + 0.2 * OVERLOAD_S)
    growth = {n: (rss[-1][1][n] - rss[warm][1][n]) / rss[warm][1][n] for n in pids}
    ROWS.extend(
        [
            (
                "offered load (asked; sent by this client)",
                "3x then 0.5x",
                f"{3 * cap:.1f} req/s for {OVERLOAD_S:g} s ({len(over) / OVERLOAD_S:.1f} sent), {0.5 * cap:.1f} for "
                f"{RECOVER_S:g} s ({len(calm) / RECOVER_S:.1f} sent)",
            ),
            ("responses other than 200/429/504", "0", f"0 ({dict(statuses)})"),
            (
                "429 answered, P99: probe process / load generator",
                "< 50 ms",
                f"{pct(probe_429, 0.99) * 1e3:.1f} ms (P50 {pct(probe_429, 0.5) * 1e3:.1f}, n={len(probe_429)}) / "
                f"{pct(fast, 0.99) * 1e3:.1f} ms (P50 {pct(fast, 0.5) * 1e3:.1f}, n={len(fast)})",
            ),
            (
                "accepted TTFT P99 at 3x",
                f"< {QUEUE_WAIT_S:g} s + one prefill ({QUEUE_WAIT_S + p50:.2f} s)",
                f"{pct(accepted, 0.99):.2f} s (n={len(accepted)})",
            ),
            ("RSS growth after warm-up", "< 5 %", ", ".join(f"{n} {100 * g:+.1f} %" for n, g in growth.items())),
            (
                f"back to normal TTFT (< {normal * 1e3:.0f} ms) after the overload",
                "< 10 s",
                f"{max(late, default=0.0):.1f} s ({len(late)} slow of {len(calm)})",
            ),
        ]
    )


def light_beside_heavy(
    cluster: Cluster, light_rate: float, heavy_rate: float, duration: float, rng: random.Random
) -> tuple[list[Shot], list[Shot], dict]:
    """The light key's Poisson load alone, then again beside the heavy key's (from its own process,
    ``heavy_load.py``: sent from this one, its load would saturate this event loop and the light key's
    TTFT would measure the client). Asserted: only 200/429/504 with all tokens, the light key never
    refused (under its share), the heavy key really shed. (light alone, light loaded, heavy's JSON)."""

    async def light_load():
        async with client(cluster.url) as c:
            return await asyncio.gather(*await poisson(c, light_rate, duration, rng, key=LIGHT))

    alone = asyncio.run(light_load())
    heavy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.chaos.heavy_load",
            cluster.url,
            HEAVY,
            str(heavy_rate),
            str(duration),
            str(SEED + 3),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    light = asyncio.run(light_load())
    out, _ = heavy.communicate(timeout=600)
    assert heavy.returncode == 0, "the heavy load saw an outcome other than 200 with all tokens / 429 / 504"
    heavy_out = json.loads(out)
    cluster.wait_recovered()
    check_outcomes(alone + light)
    refused = [(s.status, s.error) for s in alone + light if s.status != 200]
    assert {s.status for s in alone + light} == {200}, refused  # never shed: under its share
    assert heavy_out["statuses"].get("429", 0) > 0, heavy_out  # the heavy key really was over capacity
    return alone, light, heavy_out


def light_row(what: str, alone: list[Shot], light: list[Shot], heavy_out: dict, extra: str = "") -> None:
    before, after = pct([s.ttft for s in alone], 0.99), pct([s.ttft for s in light], 0.99)
    p50s = f"P50 {pct([s.ttft for s in light], 0.5) * 1e3:.0f} vs {pct([s.ttft for s in alone], 0.5) * 1e3:.0f} ms"
    ROWS.append(
        (
            what,
            "< 1.5x alone",
            f"{after * 1e3:.0f} ms vs {before * 1e3:.0f} ms alone = {after / before:.2f}x "
            f"({p50s}); heavy ({heavy_out['sent_per_s']:.0f} req/s sent): {heavy_out['statuses']}{extra}",
        )
    )


def test_light_key_under_a_heavy_one(cluster, baseline):
    _, _, cap = baseline
    light_rate, duration = 0.2 * cap, max(10.0, OVERLOAD_S / 2)
    alone, light, heavy_out = light_beside_heavy(
        cluster, light_rate, 10 * light_rate, duration, random.Random(SEED + 2)
    )
    light_row("light key TTFT P99, heavy key at 10x (2x capacity)", alone, light, heavy_out)


def test_light_key_under_a_heavy_one_with_model_like_steps(tmp_path):
    """The same with steps as slow as a real model's (``--test-step-delay-s 0.02``): here the
    batch, not the CPU, is what the keys share. As above the light key asks 0.2x this cluster's
    capacity (closed loop, 16 clients) and the heavy key 10x that; the light key is under its share,
    so its requests are forwarded past a full router and the decode worker retracts a heavy request
    for each one that finds the batch full (``fair_preemption``; ``PDSERVE_FAIR_PREEMPTION=0`` runs
    the same without, for the A/B). Asserted: as above, and none without it (how many happen with it
    depends on the moments: 2 to 41 in a run, seen)."""
    preempt = os.environ.get("PDSERVE_FAIR_PREEMPTION", "1") != "0"
    c = Cluster(
        save_tiny_model(tmp_path),
        prefill=1,
        decode=1,
        args=[
            "--kv-pool-tokens",
            "4096",
            "--page-size",
            "16",
            "--test-step-delay-s",
            "0.02",
            *ADMISSION,
            *([] if preempt else ["--no-fair-preemption"]),
        ],
    )
    c.start()
    try:
        asyncio.run(closed_loop(c.url, 4, 1, random.Random(SEED)))  # warm-up
        shots, elapsed = asyncio.run(closed_loop(c.url, 64, 16, random.Random(SEED + 5)))
        cap = sum(s.status == 200 for s in shots) / elapsed
        m0 = c.metrics()
        alone, light, heavy_out = light_beside_heavy(
            c, 0.2 * cap, 2 * cap, max(10.0, OVERLOAD_S / 2), random.Random(SEED + 4)
        )
        n = metric_sum(c.metrics(), "pdserve_preemptions_total") - metric_sum(m0, "pdserve_preemptions_total")
    finally:
        c.stop()
    assert preempt or n == 0, n
    light_row(
        f"light key TTFT P99, heavy key at 10x, 20 ms steps, fair_preemption {'on' if preempt else 'off'}",
        alone,
        light,
        heavy_out,
        f"; capacity {cap:.1f} req/s, {n:g} preemptions",
    )


def test_soak_under_retract_pressure(tmp_path):
    cluster = Cluster(
        save_tiny_model(tmp_path / "model"),
        prefill=1,
        decode=1,
        args=[
            "--kv-pool-tokens",
            "512",
            "--page-size",
            "16",
            "--max-model-len",
            "512",
            "--init-new-token-ratio",
            "0.05",
            "--host-kv-pool-gb",
            "0.00005",
            "--retract-test-interval",
            "16",
            "--test-step-delay-s",
            "0.005",
            "--max-inflight-per-worker",
            "6",
            "--max-queued-requests",
            "64",
        ],
    )
    rng = random.Random(SEED + 3)
    distinct = [
        (" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))), rng.choice([24, 48, 96])) for _ in range(24)
    ]
    cluster.start()
    try:
        pids = {"router": cluster.router_pid, **{w: cluster.pid(w) for w in ("prefill-0", "decode-0")}}

        async def run():
            async with client(cluster.url) as c:
                ref = {i: await shoot(c, *distinct[i]) for i in range(len(distinct))}  # alone: no retraction
                m_ref = cluster.metrics()
                work, shots, rss = iter(range(SOAK_REQUESTS)), [], []

                async def worker():
                    for n in work:
                        shots.append((n % len(distinct), await shoot(c, *distinct[n % len(distinct)])))
                        if len(shots) % max(1, SOAK_REQUESTS // 10) == 0:
                            rss.append({name: rss_bytes(p) for name, p in pids.items()})

                t0 = time.monotonic()
                await asyncio.gather(*(worker() for _ in range(24)))
                return ref, m_ref, shots, rss, time.monotonic() - t0

        ref, m_ref, shots, rss, elapsed = asyncio.run(run())
        m = cluster.wait_recovered()
    finally:
        cluster.stop()
    assert all(r.status == 200 and len(r.tokens) == r.max_tokens for r in ref.values())
    assert metric_sum(m_ref, "pdserve_retractions_total") == 0
    check_outcomes([s for _, s in shots])
    wrong = [(i, s.status, s.error) for i, s in shots if s.tokens != ref[i].tokens]
    counts = {k: metric_sum(m, f"pdserve_{k}_total") for k in ("retractions", "retract_resumed", "retract_recomputed")}
    growth = {n: (rss[-1][n] - rss[1][n]) / rss[1][n] for n in pids}
    ROWS.extend(
        [
            (
                "soak under retract pressure",
                f"{SOAK_REQUESTS} requests",
                f"{elapsed:.0f} s, retractions {counts['retractions']:.0f}, resumed {counts['retract_resumed']:.0f}, "
                f"recomputed {counts['retract_recomputed']:.0f}",
            ),
            (
                "soak: outputs equal to the reference, leaked pages / host bytes",
                "all, 0 / 0",
                f"{len(shots) - len(wrong)} of {len(shots)}, {leaks(m)[0]:.0f} / {leaks(m)[1]:.0f}",
            ),
            (
                "soak: RSS growth after the first tenth",
                "flat",
                ", ".join(f"{n} {100 * g:+.1f} %" for n, g in growth.items()),
            ),
        ]
    )
    assert not wrong, wrong[:5]
    assert all(v > 0 for v in counts.values()), counts
    assert leaks(m) == (0, 0)


def teardown_module() -> None:
    print("\n| goal | target | measured |\n|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(row) + " |")
