"""The adaptive parts of the draft rule beyond the cost rule itself: a long n-gram match raises a
request's estimated acceptance (it drafts where a short match would not, even after misses), a
request the rule switched off is probed again after a few steps, the rows most likely accepted take
the step's room first, and without a configured cap a step drafts only up to where a draft token
needs a 3/4 chance of acceptance (three times the step's fixed cost, within the measured linear
range), so a batch of 8 whose drafts are accepted drafts nearly whole and a compute-bound one does not."""

from __future__ import annotations

import pytest

from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from configs.scheduler import SchedulerConfig
from engine.spec import pays
from engine.spec.ngram import NgramIndex
from engine.spec.pays import Acceptance, step_cap
from engine.spec.verify import NgramSpeculator, speculator_for
from tests.engine.test_spec_pays import running

LONG_MATCH = [1, 2, 3] * 8  # + [1]: the suffix matches 22 tokens back


def speculator(kv: KVManager, **kw) -> NgramSpeculator:
    return NgramSpeculator(kv, k=4, n_min=1, n_max=3, max_model_len=10**6, fixed=12.0, **kw)


def test_lookup_counts_the_match_past_the_ngram():
    ix = NgramIndex(2, 3)
    ix.extend([9, 8, 1, 2, 3, 4, 5, 7, 1, 2, 3])
    assert ix.lookup(2, longest=16) == ([4, 5], 3)  # 1 2 3 recurs, 8 != 7 before it
    assert ix.lookup(2) == ([4, 5], 3)  # never counted past n_max without longest
    ix.extend([4, 5])
    assert ix.lookup(1, longest=16) == ([7], 5)
    assert ix.lookup(1, longest=4) == ([7], 4)
    assert ix.lookup(0, longest=16) == ([], 0)


def test_a_long_match_drafts_where_a_short_one_does_not():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = speculator(kv)
    reqs = [running(kv, f"s{i}") for i in range(7)] + [running(kv, "long", LONG_MATCH)]
    fresh = [len(d) for d in spec.drafts(reqs, 0)]
    assert fresh[7] == 4 and max(fresh[:7]) == 1, fresh  # 0.9 a token against the short ones' 0.5
    for r in reqs:  # both kinds after two rejected drafts
        spec._drafting(r).acceptance = Acceptance(hits=0.0, misses=1.5)
    lengths = [len(d) for d in spec.drafts(reqs, 0)]
    assert lengths[:7] == [0] * 7 and lengths[7] > 0, lengths  # the long match is probed again


def test_a_switched_off_request_is_probed_again():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = speculator(kv)
    reqs = [running(kv, f"r{i}") for i in range(8)]
    off = reqs[0]
    spec._drafting(off).acceptance = Acceptance(hits=0.0, misses=1.5)  # rate 0.29 < 0.4 at batch 8
    for r in reqs[1:]:  # the others never draft: no match
        spec._drafting(r).index.extend([7] * 64)
        spec._drafting(r).wait = 1 << 20
    steps = [len(spec.drafts(reqs, 0)[0]) for _ in range(10)]
    assert steps[:7] == [0] * 7 and steps[7] == 1, steps  # 1.5 * 0.85 ** 7 < 0.5: 1 / 2.5 pays


def test_without_fading_it_stays_off(monkeypatch):
    monkeypatch.setattr(pays, "IDLE_DECAY", 1.0)
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = speculator(kv)
    reqs = [running(kv, f"r{i}") for i in range(8)]
    spec._drafting(reqs[0]).acceptance = Acceptance(hits=0.0, misses=1.5)
    assert all(not spec.drafts(reqs, 0)[0] for _ in range(30))


def test_the_likeliest_rows_take_the_room_first():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = speculator(kv, step_tokens=14)  # 8 rows + 6 drafted tokens
    reqs = [running(kv, f"r{i}") for i in range(8)]
    spec._drafting(reqs[6]).acceptance = Acceptance(hits=8.0, misses=0.0)
    spec._drafting(reqs[3]).acceptance = Acceptance(hits=6.0, misses=0.0)
    lengths = [len(d) for d in spec.drafts(reqs, 0)]
    assert lengths[6] == 4 and lengths[3] == 2 and sum(lengths) == 6, lengths


@pytest.mark.parametrize(
    ("fixed", "linear", "cap"), [(12.0, 96, 24), (8.0, 96, 16), (40.0, 96, 80), (60.0, 96, 96), (0.4, 96, 1)]
)
def test_unset_cap_is_where_a_draft_needs_two_thirds_within_the_linear_range(fixed, linear, cap):
    kv = KVManager(PageAllocator(64), 4, enable_radix_cache=False)
    cfg = SchedulerConfig(
        speculative_method="ngram",
        spec_step_fixed_tokens=fixed,
        spec_step_linear_tokens=linear,
        max_num_batched_tokens=4096,
    )
    assert step_cap(fixed, linear) == cap and speculator_for(cfg, kv, 4096).step_tokens == cap
    if cap > 1:  # a draft token at the cap needs a 2/3 chance (up to rounding), one past it more
        assert cap / (fixed + cap) <= pays.CAP_BREAK_EVEN or cap == linear
    capped = SchedulerConfig(speculative_method="ngram", spec_max_batch_tokens=10, spec_step_fixed_tokens=fixed)
    assert speculator_for(capped, kv, 4096).step_tokens == 10


def test_a_batch_of_8_whose_drafts_are_accepted_fills_the_cap_with_whole_drafts():
    """At c = 8 rows accepting 93 % of their drafts fill the 2F cap (24 tokens: 16 drafted), whole
    drafts to the likeliest rows first: every one of them pays at batch 8 (break-even 0.4 to 0.66)."""
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    cfg = SchedulerConfig(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)
    spec = speculator_for(cfg.model_copy(update=dict(max_num_batched_tokens=4096)), kv, 10**6)
    reqs = [running(kv, f"r{i}", LONG_MATCH) for i in range(8)]
    for r in reqs:
        spec._drafting(r).acceptance = Acceptance(hits=12.0, misses=0.0)
    lengths = [len(d) for d in spec.drafts(reqs, 0)]
    assert sum(lengths) == 24 - 8 and lengths[:4] == [4] * 4, lengths


def test_compute_bound_batch_neither_drafts_nor_looks_up():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = speculator(kv, step_tokens=step_cap(12.0, 96))
    reqs = [running(kv, f"r{i}", LONG_MATCH) for i in range(32)]
    assert all(not d for d in spec.drafts(reqs, 0)) and not spec._state  # 32 rows overfill the step
    assert all(not d for d in spec.drafts(reqs[:24], 0)) and not spec._state  # 24 rows fill it
    chat = [running(kv, f"c{i}") for i in range(20)]  # a short match: the prior 0.5 does not pay at 20 rows
    assert all(not d for d in spec.drafts(chat, 0))
    assert sum(len(d) for d in spec.drafts(reqs[:16], 0)) == 8  # 16 rows: 8 drafted tokens fit
