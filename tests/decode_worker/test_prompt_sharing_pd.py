"""Parallel sampling in PD shares the prompt's pages on the decode worker (insert on landing,
``cache.prefix_share``): once the first choice's KV has landed its full prompt pages are in the decode
radix cache, so the other choices (sent once the first has its first token, as the router sends them)
match them, the prefill worker ships only the last page, and each choice writes its own pages from
there. Seeded outputs equal separate requests; the pools are clean after (PD harness, tiny model)."""

from __future__ import annotations

import random

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from cache.prefix_share import park, share_prefix, shared_elsewhere
from configs.schema import PdserveConfig
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

PAGE = 4


def cfg(**sched) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": 4096, "page_size": PAGE},
            "scheduler": sched,
            "cluster": {"mode": "pd", "host_kv_pool_gb": 0.01, "transfer_backend": "loopback"},
        }
    )


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


def test_parked_choice_copies_only_its_own_pages(harness):
    """A retracted choice leaves the prompt pages the other choices hold on the device, locked by
    its parked handle (``cache.prefix_share.park``): the host pool holds exactly the parked choices' own
    pages, the resume copies back only those, and the outputs equal separate requests."""
    params = choices(4)
    h = harness(cfg(retract_test_interval=3))
    retract, full_pages = h.decode.retract, (len(PROMPT) - 1) // PAGE
    parked: list[tuple[int, int, int, int, int]] = []
    real_offload = retract.offload

    def offload(job):
        real_offload(job)
        own = retract.budget.pages_for(job.req.kv_len) - job.host_kv.first_page
        held = sum(len(j.host_kv.pages) for j in retract.queue)
        parked.append((job.host_kv.first_page, len(job.host_kv.pages), own, retract.host.used_pages(), held))

    retract.offload = offload
    shared = run_choices(h, PROMPT, params)
    assert parked and retract.stats.resumed > 0
    assert all(first == full_pages and n_host == own for first, n_host, own, _, _ in parked), parked
    assert all(used == held for _, _, _, used, held in parked), parked  # the host holds own pages only
    assert retract.stats.kept_shared_pages == full_pages * retract.stats.offloaded
    assert retract.stats.offload_bytes == sum(n for _, n, _, _, _ in parked) * retract.host.page_bytes
    assert h.decode.kv.tree.protected_size() == 0  # every lock a parked handle took is given back
    assert [shared[f"c{i}"] for i in range(4)] == alone(harness, params)


def test_park_keeps_only_the_prefix_another_request_holds():
    """``cache.prefix_share.park``: the longest radix prefix another handle locks stays in the parked handle
    (locked), the rest is freed exactly as ``free`` would; ``restore`` grows the handle from it;
    with no other holder everything is given back; the pool invariant holds throughout."""
    kv = KVManager(PageAllocator(32), PAGE, True)
    prompt = list(range(3 * PAGE))
    a = kv.match_prefix(prompt)
    assert kv.ensure_pages(a, len(prompt) + 2) and share_prefix(kv, a, prompt) == 3
    b = kv.match_prefix(prompt + [99])
    assert b.full.num_shared == 3 and kv.ensure_pages(b, len(prompt) + 2)
    d = kv.match_prefix(prompt[: 2 * PAGE] + [50] * PAGE)  # a shorter holder: the first 2 pages
    assert d.full.num_shared == 2

    free = kv.allocator.num_free()
    assert shared_elsewhere(kv, b) == 3 and park(kv, b) == 3
    assert b.pages == a.pages[:3] and b.full.num_shared == 3 and kv.allocator.num_free() == free + 1
    kv.check_integrity([a, b, d])
    assert kv.restore(b, len(prompt) + 2, []) and b.pages[:3] == a.pages[:3] and len(b.pages) == 4
    kv.check_integrity([a, b, d])

    kv.free(b)
    assert shared_elsewhere(kv, a) == 2 and park(kv, a) == 2  # only d's 2 pages are held elsewhere
    assert len(a.pages) == 2 and a.full.num_shared == 2
    kv.check_integrity([a, d])
    kv.free(d)
    assert shared_elsewhere(kv, a) == 0 and park(kv, a) == 0 and a.empty
    assert kv.tree.protected_size() == 0
    kv.check_integrity([a, b, d])
