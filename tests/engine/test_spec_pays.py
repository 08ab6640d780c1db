"""The cost rule of speculative decoding (``engine.spec.pays``): a draft token is verified only where
its chance of acceptance raises the step's expected tokens per unit of cost, so a batch of one drafts
a half-likely draft nearly whole, a batch of 8 one token of it, a batch of 32 none, and a request
whose drafts are rejected stops drafting in a large batch while one whose drafts are accepted goes on."""

from __future__ import annotations

import pytest
import torch

from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from engine.request import Phase, Request
from engine.sampling import Sampler, SamplerState
from engine.scheduler.executor import token_delta
from engine.spec.pays import Acceptance, StepBudget
from engine.spec.verify import NgramSpeculator
from transfer.wire.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("rows", "p", "paying"), [(1, 0.5, 3), (8, 0.5, 1), (32, 0.5, 0), (32, 0.95, 4), (8, 0.9, 4), (8, 0.3, 0)]
)
def test_budget_takes_exactly_the_tokens_that_raise_tokens_per_cost(rows, p, paying):
    budget = StepBudget(12.0, rows)
    assert budget.paying(p, 4) == paying
    rate = budget.gain / budget.cost
    budget.take(p, paying)
    assert paying == 0 or budget.gain / budget.cost > rate  # what it took pays
    if paying < 4:  # the next token (chance p ** (paying + 1)) would lower it
        q = p ** (paying + 1)
        assert (budget.gain + q) / (budget.cost + 1) <= budget.gain / budget.cost


def test_acceptance_rate_follows_recent_verifies():
    a = Acceptance()
    assert a.rate() == 0.5  # the prior
    for _ in range(4):
        a.observe(4, 4)
    assert a.rate() > 0.85
    for _ in range(6):
        a.observe(0, 4)
    assert a.rate() < 0.3


# the output's last token (1) recurs once, followed by 2 5 6 7: a draft from the shortest n-gram
SHORT_MATCH = [1, 2, 5, 6, 7, 3]


def running(kv: KVManager, rid: str, prompt: list[int] = SHORT_MATCH) -> Request:
    """A running request whose next step drafts from ``prompt`` + ``[1]``."""
    params = SamplingParams(max_new_tokens=10_000, temperature=0, ignore_eos=True)
    req = Request(rid, list(prompt), params, SamplerState.new(params, 8), status=Phase.RUNNING)
    req.output_ids = [1]
    req.kv_len = req.seq_len - 1
    assert kv.ensure_pages(req.kv, req.kv_len + 1)
    return req


def test_large_batch_drafts_only_for_requests_whose_drafts_are_accepted():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = NgramSpeculator(kv, k=4, n_min=1, n_max=3, max_model_len=10**6, fixed=12.0)
    reqs = [running(kv, f"r{i}") for i in range(8)]
    assert [len(d) for d in spec.drafts(reqs[:1], 0)] == [3]  # batch 1, prior 0.5: 3 of 4 pay
    assert [len(d) for d in spec.drafts(reqs, 0)] == [1] * 8  # batch 8: the first token only
    for r in reqs[:4]:  # four requests' drafts are accepted, four are rejected
        spec._drafting(r).acceptance = Acceptance(hits=12.0, misses=0.0)
    for r in reqs[4:]:
        spec._drafting(r).acceptance = Acceptance(hits=0.0, misses=3.0)
    lengths = [len(d) for d in spec.drafts(reqs, 0)]
    assert lengths[:4] == [4, 4, 4, 4] and lengths[4:] == [0, 0, 0, 0], lengths
    plain = NgramSpeculator(kv, k=4, n_min=1, n_max=3, max_model_len=10**6)  # no cost rule
    assert [len(d) for d in plain.drafts(reqs, 0)] == [4] * 8


def verify(spec: NgramSpeculator, req: Request, accept_all: bool) -> None:
    """One verify of ``req``'s draft whose target tokens are the draft (all accepted) or 7 (none)."""
    d = spec.draft(req)
    assert d
    logits = torch.zeros(len(d) + 1, 8)
    for j, t in enumerate([*d, 1] if accept_all else [7] * (len(d) + 1)):
        logits[j, t] = 1.0
    emit = lambda r, t, lp, top: token_delta(r, t, lp, top, frozenset(), 10**6)  # noqa: E731
    spec.accept(Sampler(), [(req, d, logits)], emit)
    assert spec.kv.ensure_pages(req.kv, req.kv_len + 1)


def test_verify_updates_the_request_acceptance():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = NgramSpeculator(kv, k=3, n_min=1, n_max=3, max_model_len=10**6, fixed=12.0)
    hit, miss = running(kv, "hit"), running(kv, "miss")
    verify(spec, hit, True)
    verify(spec, miss, False)
    assert spec._drafting(hit).acceptance.rate() == pytest.approx(4 / 5)  # 3 hits, the prior
    assert spec._drafting(miss).acceptance.rate() == pytest.approx(1 / 3)  # 1 miss, the prior


def test_an_adopted_record_drafts_as_on_its_source():
    """A migrated request is a new ``Request`` on its target: with its source's record (``record`` /
    ``adopt``, carried in the migration messages) it drafts there what it would have on the source."""
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    source, target, fresh = (NgramSpeculator(kv, k=4, n_min=1, n_max=3, max_model_len=10**6, fixed=12.0) for _ in "abc")
    reqs = [running(kv, f"r{i}") for i in range(8)]
    for r in reqs[:4]:
        source._drafting(r).acceptance = Acceptance(hits=12.0, misses=0.0)
    for r in reqs[4:]:
        source._drafting(r).acceptance = Acceptance(hits=0.5, misses=1.0)
    source._drafting(reqs[5]).wait, source._drafting(reqs[5]).backoff = 3, 4
    assert source.record(running(kv, "never")) is None  # no record yet: the peer's prior serves
    moved = [running(kv, r.rid) for r in reqs]
    for r, m in zip(reqs, moved):
        target.adopt(m, source.record(r))
    assert target.record(moved[5]) == source.record(reqs[5]) and target.record(moved[5]).wait == 3
    lengths = [len(d) for d in source.drafts(reqs, 0)]
    assert [len(d) for d in target.drafts(moved, 0)] == lengths and lengths[:4] == [4] * 4 and lengths[5] == 0
    assert [len(d) for d in fresh.drafts(moved, 0)] != lengths  # at the prior it would draft otherwise


def test_per_position_counts_follow_the_run():
    """``position_trials`` / ``position_hits`` (the acceptance profile ``benchmarks.spec_step --bound``
    reads): a position is tried only after the ones before it were accepted."""
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = NgramSpeculator(kv, k=3, n_min=1, n_max=3, max_model_len=10**6)
    req = running(kv, "r")
    d = spec.draft(req)
    assert len(d) == 3
    logits = torch.zeros(4, 8)
    for j, t in enumerate([d[0], 7, 7, 7]):  # the first draft token accepted, the second rejected
        logits[j, t] = 1.0
    emit = lambda r, t, lp, top: token_delta(r, t, lp, top, frozenset(), 10**6)  # noqa: E731
    spec.accept(Sampler(), [(req, d, logits)], emit)
    assert (spec.position_trials, spec.position_hits) == ([1, 1, 0], [1, 0, 0])
    assert kv.ensure_pages(req.kv, req.kv_len + 1)
    verify(spec, req, True)  # a draft accepted whole: every position it had tried and hit
    n = spec.draft_tokens - 3
    assert spec.position_trials[:n] == [2, 2, 1][:n] and spec.position_hits[:n] == [2, 1, 1][:n]
