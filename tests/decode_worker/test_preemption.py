"""Preemption for API keys under their share, PD decode side, in one process against
the transformers reference: a request with ``GenerateRequest.preempt`` that finds the batch
(``max_running_requests``) full takes the place of the newest running request without the mark,
which is retracted (offloaded to the host pool, or recomputed without one) and resumes when a place
frees; every output still equals transformers, and every page and host byte comes back."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from decode_worker.jobs import DecodeState
from tests.support.metrics_scrape import scrape, val
from tests.support.models import hf_greedy
from tests.support.pd import pd_cfg, pd_prompts
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LONG = SamplingParams(max_new_tokens=24, temperature=0)


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda d: PDHarness(pd_cfg(), d, tiny[0], tiny[1]))


def until(h: PDHarness, cond, steps: int = 200) -> dict:
    """Step ``h`` until ``cond()``; the token deltas so far by rid."""
    out: dict[str, list[int]] = {}
    for _ in range(steps):
        if cond():
            return out
        for d in h.step():
            out.setdefault(d.rid, []).extend(d.token_ids)
    raise AssertionError("condition never held")


@pytest.mark.parametrize("host_gb", [0.01, 0.0], ids=["offload", "recompute"])
def test_a_preempting_request_takes_the_place_of_the_newest_running_one(harness, tiny, host_gb):
    h = harness(pd_cfg(host_gb=host_gb, max_running_requests=2))
    ps = pd_prompts(3, seed=7)
    for i in (0, 1):
        h.submit(f"r{i}", ps[i], LONG)
    running = h.decode.running
    got = until(h, lambda: len(running.reqs) == 2 and all(len(r.output_ids) >= 3 for r in running.reqs))
    h.submit("light", ps[2], LONG, preempt=True)
    victim = h.decode.jobs["r1"]  # the newest running request without the mark
    more = until(h, lambda: victim.state is not DecodeState.RUNNING)
    assert h.decode.stats.preemptions == 1 and h.decode.stats.retractions == 0
    assert victim.state is (DecodeState.HOST_PARKED if host_gb else DecodeState.RECOMPUTING)
    assert h.decode.jobs["r0"].state is DecodeState.RUNNING  # the older one keeps its place
    more2 = until(h, lambda: "light" in h.decode.jobs and h.decode.jobs["light"].state is DecodeState.RUNNING)
    assert victim.state is not DecodeState.RUNNING  # the batch of 2: r0 and light, r1 waits for a place
    out = h.run()
    tokens = {
        rid: got.get(rid, []) + more.get(rid, []) + more2.get(rid, []) + out.get(rid, {}).get("tokens", [])
        for rid in ("r0", "r1", "light")
    }
    assert tokens == {rid: hf_greedy(tiny[2], p, 24) for rid, p in zip(("r0", "r1", "light"), ps)}
    m = scrape(h.decode)  # what a scraper of the router reads
    assert val(m, "pdserve_preemptions_total") == 1 and val(m, "pdserve_retractions_total") == 0
    assert val(m, "pdserve_retract_resumed_total" if host_gb else "pdserve_retract_recomputed_total") == 1


def test_no_preemption_while_a_place_is_free_or_only_preempting_requests_run(harness, tiny):
    h = harness(pd_cfg(max_running_requests=2))
    ps = pd_prompts(3, seed=8)
    h.submit("a", ps[0], LONG, preempt=True)
    h.submit("b", ps[1], LONG)  # a free place each: nobody is retracted
    until(h, lambda: len(h.decode.running.reqs) == 2)
    h.submit("c", ps[2], LONG, preempt=True)  # the only one without the mark goes
    until(h, lambda: h.decode.jobs["b"].state is not DecodeState.RUNNING)
    assert h.decode.stats.preemptions == 1
    h.submit("d", ps[0], LONG, preempt=True)  # a and c both carry the mark: d waits for a place
    for _ in range(5):
        h.step()
    assert h.decode.stats.preemptions == 1
    out = h.run()
    assert all(o["error"] is None for o in out.values()), out


def test_a_preempting_request_short_of_pages_waits_without_retracting_anyone(harness):
    """Preemption makes a place in the batch, never pages: a preempting request whose prompt and
    decode reserve do not fit the pool's headroom waits like any other, and nobody is retracted."""
    h = harness(pd_cfg(pool=128, max_running_requests=2))
    ps = pd_prompts(3, lo=20, hi=30, seed=9)
    h.submit("a", ps[0], LONG)
    h.submit("b", ps[1], LONG)
    until(h, lambda: len(h.decode.running.reqs) == 2)
    h.submit("big", ps[2], SamplingParams(max_new_tokens=90, temperature=0, ignore_eos=True), preempt=True)
    for _ in range(4):
        h.step()
    assert h.decode.stats.preemptions == 0 and h.decode.jobs["big"].state is DecodeState.QUEUED
    out = h.run()
    assert all(o["error"] is None for o in out.values()) and len(out["big"]["tokens"]) == 90, out
    assert h.decode.stats.preemptions == 0
