"""Chaos suite: a launched PD cluster (router, 2 prefill and 2 local
decode workers, one more decode worker run by the test), real processes on loopback, a tiny random
model behind the embedded tokenizer, KV over NIXL. Under a load of concurrent streams each fault of
``faults.FAULTS`` hits a worker at a moment picked from a seeded RNG (``PDSERVE_CHAOS_SEED``), once
that worker shows the fault's moment in its queues; a wave that ends before the moment is seen is
checked and another one runs (``waves_until_injected``).

After every fault: every request ended with exactly the reference tokens or an explicit error,
within lease + 10 s of the fault; once recovered, every KV pool and the host pool hold nothing; the
router is the same process and its counters never went back; the reference prompts give the
reference tokens again. The reference is this server's own greedy output before any fault.
The last test prints the table (faults, requests affected, max time to error, leaks)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum
from tests.chaos.chaos_cluster import Cluster, leaks, run_load, signal_worker
from tests.chaos.faults import FAULTS, Fault, inject
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]

SEED = int(os.environ.get("PDSERVE_CHAOS_SEED", "1313"))
LEASE_S = 4.0  # worker_timeout_s (router) = peer_timeout_s (decode -> prefill)
ARGS = [
    "--kv-pool-tokens",
    "384",
    "--page-size",
    "16",
    "--max-model-len",
    "512",
    "--init-new-token-ratio",
    "0.05",
    "--chunked-prefill-size",
    "4",
    "--test-step-delay-s",
    "0.005",
    "--worker-timeout-s",
    str(LEASE_S),
    "--peer-timeout-s",
    str(LEASE_S),
    "--transfer-fence-s",
    "8",
    "--restart-backoff-s",
    "0.5",
    # reports every 50 ms (the cluster's default is 0.2 s): a prefill worker holds a wave's prompts
    # in "waiting" for ~0.1-0.2 s, and the mid-prefill fault sees that queue only through its reports
    "--health-interval-s",
    "0.05",
]
# decode-x, the decode worker the test runs itself: slower steps and a retract every 4 of them, whose
# parked requests migrate to decode-0/1 after three steps: every fault meets migrations too.
# The faults that wait for "retracted"/"migrating" see a parked request only through decode-x's
# reports (every 50 ms) as the router's /metrics shows them: parked for one step (~35 ms) it was
# missed for a whole wave now and then (CI, once in ~4 runs locally); three steps (>= ~0.1 s, two
# reports) are seen in every wave and still leave the migration a few ms.
EXTERNAL_ARGS = [
    "--kv-pool-tokens",
    "128",
    "--retract-test-interval",
    "4",
    "--test-step-delay-s",
    "0.03",
    "--migrate-after",
    "3",
    "--health-interval-s",
    "0.05",
]
WORDS = (
    "river stone light garden window morning paper music silver forest engine voice winter harbor "
    "letter market bridge candle orange summer"
).split()
STREAMS = 12
WAVES_FOR_MOMENT = 3  # load waves a fault waits through for its moment before it takes any moment
ROWS: list[dict] = []


def make_prompts(rng: random.Random, n: int = 12) -> list[tuple[str, int]]:
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))), rng.choice([12, 24])) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(
        save_tiny_model(tmp_path_factory.mktemp("chaos-model")), prefill=2, decode=2, args=ARGS, external=EXTERNAL_ARGS
    )
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def rng():
    print(f"\nchaos seed {SEED} (PDSERVE_CHAOS_SEED)")
    return random.Random(SEED)


@pytest.fixture(scope="module")
def prompts(rng):
    return make_prompts(rng)


@pytest.fixture(scope="module")
def refs(cluster, prompts):
    """Greedy tokens of every prompt, from this server before any fault (and the same twice)."""
    first = asyncio.run(run_load(cluster.url, prompts))
    again = asyncio.run(run_load(cluster.url, prompts))
    assert [o.error for o in first + again] == [None] * 2 * len(prompts)
    assert [o.tokens for o in first] == [o.tokens for o in again]
    assert [len(o.tokens) for o in first] == [n for _, n in prompts]
    return [o.tokens for o in first]


def check_outcomes(outcomes, refs) -> list:
    """Every outcome is the reference or an explicit error (tokens so far a prefix); the errors."""
    errors = []
    for o in outcomes:
        ref = refs[o.prompt]
        if o.error is None:
            assert o.status == 200 and o.tokens == ref, (o.prompt, o.tokens, ref)
        else:
            assert o.error.strip() and "transport error" not in o.error and "without [DONE]" not in o.error, o
            assert o.tokens == ref[: len(o.tokens)], o
            errors.append(o)
    return errors


def check_correct_again(cluster: Cluster, prompts, refs) -> None:
    again = asyncio.run(run_load(cluster.url, prompts))
    assert [(o.error, o.tokens) for o in again] == [(None, r) for r in refs]


def check_router_unchanged(cluster: Cluster, router_pid: int, requests_before: float, m: dict) -> None:
    assert cluster.server.proc.poll() is None and cluster.router_pid == router_pid
    assert metric_sum(m, "pdserve_requests_total") >= requests_before  # a restarted router starts at 0


# ---- retry on a fresh pair, one request at a time so the route is known ------------------
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_kill9_before_the_first_token_is_retried_on_a_fresh_pair(cluster, prompts, refs, role):
    """The idle router sends the request to prefill-0 + decode-0 (ties: lowest id). That worker is
    stopped first, so no token can come; kill -9 then fails the request with 503, which the router
    retries on prefill-1 + decode-1: the client never sees the 503."""
    cluster.wait_recovered()
    retries = cluster.counter("pdserve_router_retries_total")
    victim = f"{role}-0"
    signal_worker(cluster, victim, signal.SIGSTOP)

    async def scenario():
        task = asyncio.create_task(run_load(cluster.url, prompts[:1]))
        deadline = time.monotonic() + 30
        while metric_sum(await asyncio.to_thread(cluster.metrics), "pdserve_inflight_requests") < 1:
            assert time.monotonic() < deadline, "the request never reached the router"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        signal_worker(cluster, victim, signal.SIGKILL)
        return (await task)[0]

    out = asyncio.run(scenario())
    assert (out.error, out.tokens) == (None, refs[0])
    assert cluster.counter("pdserve_router_retries_total") == retries + 1
    assert leaks(cluster.wait_recovered()) == (0, 0)


def test_kill9_of_the_prefill_worker_while_its_request_decodes_loses_nothing(cluster, prompts):
    """Finding of the chaos suite: the router failed every request that had gone through a prefill
    worker when that worker died, also those long past their prefill (tokens streaming from a live
    decode worker). The request goes to prefill-0 + decode-0 (idle router, lowest ids); prefill-0 is
    killed once the first tokens arrived; the stream must still end with the reference tokens."""
    prompt = (prompts[0][0], 160)
    cluster.wait_recovered()
    ref = asyncio.run(run_load(cluster.url, [prompt]))[0]
    assert ref.error is None and len(ref.tokens) == 160
    cluster.wait_recovered()
    retries = cluster.counter("pdserve_router_retries_total")

    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60, trust_env=False) as c:
            body = {
                "prompt": prompt[0],
                "max_tokens": prompt[1],
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            tokens, error = [], None
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        error = event["error"]["message"]
                        continue
                    new = event["choices"][0].get("token_ids") or []
                    if new and not tokens:
                        signal_worker(cluster, "prefill-0", signal.SIGKILL)
                    tokens += new
            return tokens, error

    tokens, error = asyncio.run(scenario())
    assert (error, tokens) == (None, ref.tokens)
    assert cluster.counter("pdserve_router_retries_total") == retries
    assert leaks(cluster.wait_recovered()) == (0, 0)


# ---- faults under load --------------------------------------------------------------------
def wave_load(prompts, rng: random.Random, streams: int) -> tuple[list[tuple[str, int]], list[int]]:
    """``streams`` requests drawn from ``prompts`` in a seeded order, and each one's prompt index."""
    order = list(range(len(prompts))) * (streams // len(prompts) + 1)
    rng.shuffle(order)
    return [prompts[i] for i in order[:streams]], order[:streams]


async def _wave(cluster: Cluster, fault: Fault, rng: random.Random, load, at_any_moment: bool):
    started = asyncio.Event()
    task = asyncio.create_task(run_load(cluster.url, load, started, timeout_s=LEASE_S + 60))
    await started.wait()
    injected = await asyncio.to_thread(inject, cluster, fault, rng, at_any_moment)
    try:
        return await task, injected
    finally:
        if injected is not None:
            injected.end()


def waves_until_injected(cluster: Cluster, fault: Fault, prompts, refs, rng: random.Random):
    """Run load waves until one meets the fault's moment (a prompt in the prefill worker's queue, a
    parked request...) and the fault is injected there; at most ``WAVES_FOR_MOMENT``, the last one
    injecting at whatever moment it reaches. A wave the fault missed is checked like any other
    (every request its reference tokens, nothing failed). Returns (outcomes, injected, t0)."""
    for wave in range(WAVES_FOR_MOMENT):
        load, order = wave_load(prompts, rng, STREAMS)
        t0 = time.monotonic()
        outcomes, injected = asyncio.run(_wave(cluster, fault, rng, load, wave == WAVES_FOR_MOMENT - 1))
        for o, i in zip(outcomes, order):
            o.prompt = i
        if injected is not None:
            return outcomes, injected, t0
        assert check_outcomes(outcomes, refs) == [], f"a wave without the fault {fault.name!r} had errors"
        print(f"\n{fault.name}: moment not seen in wave {wave + 1}, another wave")
        cluster.wait_recovered()
    raise AssertionError("unreachable: the last wave injects at any moment")


def restore(cluster: Cluster, fault: Fault, prompts, refs) -> list:
    """After the page-size fault: the router keeps the worker out of routing, saying why in
    ``/health``, and a load meanwhile succeeds whole without a retry; then page size 16 again.
    Returns that load's outcomes."""
    if fault.action != "page_size":
        return []
    deadline = time.monotonic() + 90
    while "its KV page size 8 matches no prefill worker's (16)" not in (
        health := httpx.get(f"{cluster.url}/health", timeout=5, trust_env=False).json()["workers"]
    ):
        assert time.monotonic() < deadline, health
        time.sleep(0.25)
    retries = cluster.counter("pdserve_router_retries_total")
    outcomes = asyncio.run(run_load(cluster.url, prompts))
    assert [(o.error, o.tokens) for o in outcomes] == [(None, r) for r in refs]
    assert cluster.counter("pdserve_router_retries_total") == retries
    cluster.external.kill()
    cluster.external.start()
    return outcomes


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_under_load(cluster, prompts, refs, rng, fault):
    cluster.wait_recovered()
    before = cluster.metrics()
    router_pid = cluster.router_pid
    outcomes, injected, t0 = waves_until_injected(cluster, fault, prompts, refs, rng)
    try:
        errors = check_outcomes(outcomes, refs)
    except AssertionError:
        print(cluster.log_tail())  # what the workers and the router said (CI keeps only the output)
        raise
    late = [o for o in errors if o.t_end > injected.t + LEASE_S + 10]
    extra = restore(cluster, fault, prompts, refs)
    errors += [o for o in extra if o.error is not None]
    m = cluster.wait_recovered()
    check_router_unchanged(cluster, router_pid, metric_sum(before, "pdserve_requests_total"), m)
    retried = metric_sum(m, "pdserve_router_retries_total") - metric_sum(before, "pdserve_router_retries_total")
    row = {
        "fault": fault.name,
        "victim": injected.victim,
        "moment": injected.observed,
        "requests": len(outcomes) + len(extra),
        "errors": len(errors),
        "retried": int(retried),
        "max_to_error_s": max((o.t_end - injected.t for o in errors), default=None),
        "leaks": leaks(m),
        "fault_at_s": round(injected.t - t0, 2),
        "load_s": round(max(o.t_end for o in outcomes) - t0, 1),
        "migrated_in": {
            o: max(
                0,
                int(
                    metric_sum(m, "pdserve_migrations_total", direction="in", outcome=o)
                    - metric_sum(before, "pdserve_migrations_total", direction="in", outcome=o)
                ),
            )
            for o in ("done", "failed", "refused")
        },
    }
    ROWS.append(row)
    print(f"\n{row} {sorted({o.error[:90] for o in errors})}")
    assert not late, f"{len(late)} requests failed more than lease + 10 s after the fault"
    assert row["leaks"] == (0, 0)
    if "migration" in fault.name:  # the moment is real: the victim had parked or offered requests.
        # (Whether a migration had finished before the kill is a race of milliseconds: the table shows
        # decode-0/1's migrations in; tests/e2e/test_migration_e2e.py proves a migration deterministically.)
        assert injected.seen, injected.observed
    check_correct_again(cluster, prompts, refs)
    check_router_unchanged(cluster, router_pid, metric_sum(before, "pdserve_requests_total"), cluster.metrics())


def test_print_the_chaos_table():
    assert len(ROWS) == len(FAULTS), "a fault test failed or did not run"
    lines = [
        "| fault | victim | moment (victim queues) | requests | affected (errors + retried) | errors | "
        "max time to error | leaks (pages, host bytes) | migrations in (done, failed, refused) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        to_err = "-" if r["max_to_error_s"] is None else f"{r['max_to_error_s']:.1f} s"
        lines.append(
            f"| {r['fault']} | {r['victim']} | {r['moment']} | {r['requests']} | "
            f"{r['errors'] + r['retried']} | {r['errors']} | {to_err} | "
            f"{r['leaks'][0]:g}, {r['leaks'][1]:g} | {', '.join(str(v) for v in r['migrated_in'].values())} |"
        )
    print(f"\nchaos table (seed {SEED}, lease {LEASE_S:g} s):\n" + "\n".join(lines))
    assert all(r["leaks"] == (0, 0) for r in ROWS)
