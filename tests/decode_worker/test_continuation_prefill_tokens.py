"""The prefill tokens workers compute for failover continuations (``SchedulerStats.continuation_*``,
exported as ``pdserve_continuation_prefill_tokens_total{worker}`` and
``pdserve_continuation_cached_tokens_total{worker}``): a continuation whose prompt the worker's radix
cache holds computes only the pages of the tokens already sent, on the prefill worker (a recompute)
and on a decode worker that prefills it itself alike; an ordinary request moves neither series."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PREFILL_ADDR, ROUTER, PDHarness, checked_harnesses
from configs.schema import PdserveConfig
from engine.model_runner import ModelRunner
from engine.scheduler.colocated import ColocatedScheduler
from tests.support.metrics_scrape import scrape, val
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

PAGE = 4
PROMPT = [3, 17, 29, 41, 8, 55, 60, 12, 71, 5, 33, 90]  # three full pages
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
COMPUTED, CACHED = "pdserve_continuation_prefill_tokens_total", "pdserve_continuation_cached_tokens_total"


def pd_cfg() -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": 512, "page_size": PAGE},
            "cluster": {"mode": "pd", "transfer_backend": "loopback"},
        }
    )


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda: PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1]))


def continuation(h: PDHarness, rid: str, sent: list[int]) -> None:
    msg = GenerateRequest(rid=rid, params=GREEDY, room=next(h.room), prefill_addr=PREFILL_ADDR, resume_output_ids=sent)
    h.deliver(h.decode.add(ROUTER, msg, PROMPT), True)


def test_pd_continuations_compute_only_what_the_caches_miss(harness):
    """The request runs once (both workers' radix caches keep it); then two continuations of it
    arrive as a dead worker's burst does: ``r6`` (6 tokens sent) goes to the prefill worker, whose
    cache holds the prompt's 3 pages, so it computes the 5 sent tokens it needs (its recompute stops
    before the last one, the decode input); ``r5`` (5 sent) is prefilled by the decode worker, whose
    cache holds the whole earlier run, so it computes the one token past its 4 full pages."""
    h = harness()
    h.submit("r", PROMPT, GREEDY)
    ref = h.run()["r"]["tokens"]
    m = scrape(h.prefill, h.decode)
    assert val(m, COMPUTED) == val(m, CACHED) == 0  # an ordinary request moves neither
    p0, d0 = h.prefill.stats.prefill_computed_tokens, h.decode.stats.prefill_computed_tokens
    continuation(h, "r6", ref[:6])
    continuation(h, "r5", ref[:5])
    got = h.run()
    assert got["r6"]["tokens"] == ref[6:] and got["r5"]["tokens"] == ref[5:]
    m = scrape(h.prefill, h.decode)  # w0: the prefill worker, w1: the decode worker
    assert val(m, COMPUTED, worker="w0") == 5 and val(m, CACHED, worker="w0") == len(PROMPT)
    assert val(m, COMPUTED, worker="w1") == 1 and val(m, CACHED, worker="w1") == 4 * PAGE
    # nothing else was computed: the counters are the whole of the continuations' prefill
    assert h.prefill.stats.prefill_computed_tokens - p0 == 5
    assert h.decode.stats.prefill_computed_tokens - d0 == 1


def test_a_colocated_continuation_without_a_cache_hit_computes_prompt_and_sent(tiny):
    """A fresh colocated worker holds nothing: the continuation computes prompt + every sent token."""
    sched = ColocatedScheduler(
        ModelRunner(engine_cfg(kv_pool_tokens=256, page_size=PAGE), tiny[0], tiny[1]), sched_cfg(), ()
    )
    sched.add(b"", GenerateRequest(rid="c", params=GREEDY, resume_output_ids=[7, 8, 9]), PROMPT)
    while sched.has_work:
        sched.step()
    m = scrape(sched)
    assert val(m, COMPUTED) == len(PROMPT) + 3 and val(m, CACHED) == 0
