"""Chaos rows for a worker's death with 2 prefill workers, on one launch of 2 prefill + 2 decode
workers (the tiny model, real processes, KV over NIXL on loopback, ``--worker-timeout-s 30`` so only
the kills are deaths) under the mixed streamed load, every output compared with the fault-free run
and nothing left on any worker once the killed ones are back:

- ``kill -9`` of the busier decode worker at a seeded moment: its streams continue on the other
  one, and each continuation's recompute goes back to the prefill worker that prefilled its prompt
  (whose radix cache holds it), so the prefill workers compute only the sent tokens and the
  prompts' partial last pages of them; one whose prompt the dead decode worker prefilled itself
  (selective disaggregation) goes to the policy's pick and is computed whole;
- ``kill -9`` of a prefill worker before the handoff: it is stopped (SIGSTOP) before the load, so
  the requests routed to it wait in its queue, then killed once all of them reached the router;
  each of them goes to the other prefill worker (a fresh-pair retry);
- ``kill -9`` of a prefill worker while it holds the recomputes of a dead decode worker's
  continuations: at a seeded moment both prefill workers are stopped and the busiest decode worker
  A killed; A's streams continue on the other decode worker B, each with the prefill worker that
  prefilled its prompt, and B prefills some of them itself and sends the others' recomputes to
  those prefill workers, where they wait until one of them is killed (the other one resumes). They
  fail over a second time before their first new token, to the other prefill worker (or B's local
  prefill), B still streaming them;
- ``kill -9`` of a prefill worker while the surviving decode worker prefills continuations itself:
  the same start, but the prefill worker is killed the moment A's continuations have gone out (no
  settling), while B works through its own share of the burst; those B prefills itself do not depend
  on it (``PrefilledLocally``), and B computes some of the continuations' tokens itself.

The rows share one fault-free reference run (the seeded load is the same for every row).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from bench.harness.subprocess_server import metric_sum
from tests.chaos.chaos_cluster import Cluster, signal_worker
from tests.chaos.failover_support import (
    PAGE_SIZE,
    STREAMS,
    Reference,
    assert_failed_over,
    busiest_first,
    continuations,
    failover_cluster,
    fault_free,
    killed_load,
    load,
    requests_left,
    tokens_reached,
)

pytestmark = [pytest.mark.process, pytest.mark.slow]

PREFILLS, DECODES = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with failover_cluster(tmp_path_factory.mktemp("failover-prefill-model"), prefill=2, decode=2) as c:
        yield c


@pytest.fixture(scope="module")
def reference(cluster):
    """``fresh()``: the fault-free run's bodies and outputs (run once for the module) with the
    metrics of the cluster as it is now, recovered, for a row's counters."""
    made: list[Reference] = []

    def fresh() -> Reference:
        if not made:
            made.append(fault_free(cluster.url, cluster.wait_recovered))
            return made[0]
        return Reference(made[0].mixes, made[0].outputs, cluster.wait_recovered())

    return fresh


def test_kill9_of_a_decode_worker_recomputes_on_the_prefill_worker_holding_the_prompt(cluster, reference):
    c = cluster
    ref = reference()
    kill_tokens, total = ref.kill_tokens(salt=0)
    got, victim = asyncio.run(killed_load(c, ref.bodies, kill_tokens, DECODES))
    row = f"decode kill -9 with 2 prefill workers: {victim} at {kill_tokens}/{total} tokens"
    moved = assert_failed_over(row, ref, got, c.wait_recovered(), (victim,))
    continued, sent = moved("pdserve_failovers_total"), moved("pdserve_failover_recomputed_tokens_total")
    computed = sum(moved("pdserve_continuation_prefill_tokens_total", worker=p) for p in PREFILLS)
    cached = sum(moved("pdserve_continuation_cached_tokens_total", worker=p) for p in PREFILLS)
    same = moved("pdserve_failover_same_prefill_total")
    longest = max(r["usage"]["prompt_tokens"] for r in ref.outputs)
    print(
        f"  prefill workers: {computed:g} continuation tokens computed, {cached:g} cached, {sent:g} sent; "
        f"{same:g} of {continued:g} continuations to their prompt's prefill worker"
    )
    # the others' prompts the dead decode worker had prefilled itself (PrefilledLocally): none is cached
    assert 0 <= same <= continued and cached % PAGE_SIZE == 0, (same, continued, cached)
    # a recompute where the prompt is cached computes its sent tokens but the last one, plus the
    # prompt's partial last page; one at a prefill worker without the prompt computes it all again
    bound = sent + (PAGE_SIZE - 2) * same + longest * (continued - same)
    assert computed <= bound, (computed, cached, sent, same, continued)


def test_kill9_of_a_prefill_worker_before_the_handoff_goes_to_the_other(cluster, reference):
    c = cluster
    ref = reference()
    signal_worker(c, "prefill-0", signal.SIGSTOP)

    async def scenario():
        task = asyncio.create_task(load(c.url, ref.bodies))
        deadline = time.monotonic() + 30
        while metric_sum(await asyncio.to_thread(c.metrics), "pdserve_inflight_requests") < STREAMS:
            assert time.monotonic() < deadline, "the load never reached the router"
            await asyncio.sleep(0.05)
        signal_worker(c, "prefill-0", signal.SIGKILL)
        return await task

    got = asyncio.run(scenario())
    moved = assert_failed_over("prefill kill -9 before the handoff", ref, got, c.wait_recovered())
    assert moved("pdserve_router_retries_total") >= 1  # the stopped worker held requests: they went to prefill-1


async def recompute_killed_load(c: Cluster, bodies: list[dict], kill_tokens: int, settle_s: float = 0.3) -> dict:
    """The load with both prefill workers stopped and the busiest decode worker A killed once the
    clients hold ``kill_tokens`` tokens; ``settle_s`` after A's continuations went out (each to the
    prefill worker of its prompt), the prefill worker the most of them depend on at the router
    (``pdserve_router_continuations``: not those B prefills itself; ties: the first) is killed and
    the other resumed (SIGCONT). What happened, with the records."""
    counting, reached = tokens_reached(kill_tokens)
    task = asyncio.create_task(load(c.url, bodies, counting))
    await reached.wait()
    a, b = await asyncio.to_thread(busiest_first, c, DECODES)
    pids = {p: signal_worker(c, p, signal.SIGSTOP) for p in PREFILLS}
    victim = None
    try:
        signal_worker(c, a, signal.SIGKILL)
        await requests_left(c, a, settle_s=settle_s)
        held = {p: await asyncio.to_thread(continuations, c, p) for p in PREFILLS}
        victim = max(PREFILLS, key=held.get)
        os.kill(pids[victim], signal.SIGKILL)  # stopped: killed before it computed a token of them
    finally:
        for p, pid in pids.items():
            if p != victim:
                os.kill(pid, signal.SIGCONT)
    return {"got": await task, "a": a, "b": b, "victim": victim, "held": held}


def test_kill9_of_a_prefill_worker_recomputing_continuations_fails_them_over_again(cluster, reference):
    c = cluster
    ref = reference()
    kill_tokens, total = ref.kill_tokens(salt=4)
    run = asyncio.run(recompute_killed_load(c, ref.bodies, kill_tokens))
    a, b = run["a"], run["b"]
    row = (
        f"prefill kill -9 during the recomputes: {a} killed at {kill_tokens}/{total} tokens, then "
        f"{run['victim']} (continuations depending on each prefill worker: {run['held']})"
    )
    # a failover is counted under the worker that was streaming: B's (alive) for prefill-0's death
    assert_failed_over(row, ref, run["got"], c.wait_recovered(), (a, b))


def test_kill9_of_a_prefill_worker_while_the_survivor_prefills_continuations(cluster, reference):
    c = cluster
    ref = reference()
    kill_tokens, total = ref.kill_tokens(salt=5)
    run = asyncio.run(recompute_killed_load(c, ref.bodies, kill_tokens, settle_s=0.0))
    a, b = run["a"], run["b"]
    row = (
        f"prefill kill -9 during the survivor's own prefill of continuations: {a} killed at "
        f"{kill_tokens}/{total} tokens, then at once {run['victim']} (continuations on each: {run['held']})"
    )
    moved = assert_failed_over(row, ref, run["got"], c.wait_recovered(), (a,))
    local = moved("pdserve_continuation_prefill_tokens_total", worker=b)
    again = moved("pdserve_failovers_total", worker=b)
    print(f"  {b} computed {local:g} continuation tokens itself; {again:g} failed over again")
    assert local > 0, f"{b} prefilled none of {a}'s continuations itself"
