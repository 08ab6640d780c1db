"""Parallel sampling in PD shares the prompt's pages on the decode worker (insert on landing,
``cache.prefix_share``): once the first choice's KV has landed its full prompt pages are in the decode
radix cache, so the other choices (sent once the first has its first token, as the router sends them)
match them, the prefill worker ships only the last page, and each choice writes its own pages from
there. Seeded outputs equal separate requests; the pools are clean after (PD harness, tiny model)."""
from __future__ import annotations

import random

import pytest

from configs.schema import PdserveConfig
from server.testing.pd_harness import PDHarness, checked_harnesses
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

PAGE = 4


def cfg(**sched) -> PdserveConfig:
    return PdserveConfig.model_validate({"engine": {"kv_pool_tokens": 4096, "page_size": PAGE}, "scheduler": sched,
                                         "cluster": {"mode": "pd", "host_kv_pool_gb": 0.01,
                                                     "transfer_backend": "loopback"}})


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda d=None: PDHarness(cfg(), d or cfg(), tiny[0], tiny[1]))


def choices(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=8, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(n)]


def run_choices(h: PDHarness, prompt: list[int], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Choice 0 first, the others once it has its first token; tokens per choice."""
    out: dict[str, list[int]] = {f"c{i}": [] for i in range(len(params))}
    h.submit("c0", prompt, params[0])
    sent = False
    while h.busy or not sent:
        for d in h.step():
            out[d.rid] += d.token_ids
        if not sent and out["c0"]:
            for i, p in enumerate(params[1:], 1):
                h.submit(f"c{i}", prompt, p)
            sent = True
    return out


PROMPT = [random.Random(3).randrange(0, 96) for _ in range(30)]


def alone(harness, params: list[SamplingParams]) -> list[list[int]]:
    """Each choice as a separate request on a fresh pair."""
    got = []
    for p in params:
        solo = harness()
        solo.submit("r", PROMPT, p)
        got.append(solo.run()["r"]["tokens"])
        assert solo.decode.stats.cached_prompt_tokens == 0
    return got


def test_choices_share_the_prompt_on_the_decode_worker(harness):
    params = choices(4)
    h = harness()
    shared = run_choices(h, PROMPT, params)
    full_pages = (len(PROMPT) - 1) // PAGE  # a match stops before the last prompt token
    assert h.decode.stats.cached_prompt_tokens == 3 * full_pages * PAGE
    assert [shared[f"c{i}"] for i in range(4)] == alone(harness, params)


def test_shared_choices_survive_forced_retracts(harness):
    params = choices(4)
    h = harness(cfg(retract_test_interval=3))
    shared = run_choices(h, PROMPT, params)
    rs = h.decode.retract.stats
    assert h.decode.stats.retractions > 0 and rs.resumed > 0
    assert [shared[f"c{i}"] for i in range(4)] == alone(harness, params)
