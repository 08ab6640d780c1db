"""A request whose drafts are wholly rejected drafts again after 1, 2, 4, ... steps (up to
MAX_BACKOFF_STEPS), and every step once one of its draft tokens is accepted; a miss right after a run of
accepted drafts (an estimate of at least REPROBE_RATE) does not start the back-off."""

from __future__ import annotations

import torch

from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from engine.request import Phase, Request
from engine.sampling import Sampler, SamplerState
from engine.scheduler.executor import token_delta
from engine.spec.pays import Acceptance
from engine.spec.verify import MAX_BACKOFF_STEPS, REPROBE_RATE, NgramSpeculator
from transfer.wire.sampling_params import SamplingParams

V = 8


def running_request(kv: KVManager) -> Request:
    params = SamplingParams(max_new_tokens=10_000, temperature=0, ignore_eos=True)
    req = Request("r", [1, 2, 3] * 3, params, SamplerState.new(params, V), status=Phase.RUNNING)
    req.output_ids = [1]
    req.kv_len = req.seq_len - 1
    assert kv.ensure_pages(req.kv, req.kv_len + 1)
    return req


def step(spec: NgramSpeculator, req: Request, answer) -> tuple[int, int]:
    """One step whose target token is ``answer(draft)``: (draft length, tokens emitted)."""
    d = spec.draft(req)
    answer = answer(d)
    if not d:  # a plain decode row
        token_delta(req, answer, None, None, frozenset(), 10**6)
        req.kv_len += 1
        spec.kv.ensure_pages(req.kv, req.kv_len + 1)
        return 0, 1
    logits = torch.zeros(len(d) + 1, V)
    logits[:, answer] = 1.0
    emit = lambda r, t, lp, top: token_delta(r, t, lp, top, frozenset(), 10**6)  # noqa: E731
    n = len(spec.accept(Sampler(), [(req, d, logits)], emit))
    spec.kv.ensure_pages(req.kv, req.kv_len + 1)
    return len(d), n


def test_backoff_doubles_on_misses_and_resets_on_a_hit():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = NgramSpeculator(kv, k=3, n_min=1, n_max=3, max_model_len=10**6)
    req = running_request(kv)
    drafted = [step(spec, req, lambda d: 7)[0] > 0 for _ in range(12)]
    # the 1-2-3 history drafts no 7: a miss, one step without; then 7 7 is in the history and drafted
    assert drafted[:3] == [True, False, True]
    assert spec.accepted_tokens > 0 and all(drafted[2:])  # accepted: it drafts every step
    kv.free(req.kv)


def test_backoff_grows_to_its_cap_while_every_draft_misses():
    kv = KVManager(PageAllocator(1 << 16), 4, enable_radix_cache=False)
    spec = NgramSpeculator(kv, k=3, n_min=1, n_max=3, max_model_len=10**6)
    req = running_request(kv)
    gaps, gap = [], 0
    for _ in range(200):  # the target token is never the draft's first
        d, _ = step(spec, req, lambda d: (d[0] + 1) % V if d else 1)
        if d:
            gaps.append(gap)
            gap = 0
        else:
            gap += 1
    assert spec.accepted_tokens == 0
    assert gaps[:6] == [0, 1, 2, 4, 8, 16] and set(gaps[6:]) <= {MAX_BACKOFF_STEPS}
    kv.free(req.kv)


def test_a_miss_after_a_run_of_accepted_drafts_reprobes_at_once():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = NgramSpeculator(kv, k=3, n_min=1, n_max=3, max_model_len=10**6)
    req = running_request(kv)
    assert [step(spec, req, lambda d: 7)[0] for _ in range(2)] == [3, 0]  # a fresh miss, one step off
    for _ in range(3):  # then 7 7 .. is drafted and wholly accepted
        assert step(spec, req, lambda d: 7) == (3, 4)
    assert spec._drafting(req).acceptance.rate() >= REPROBE_RATE
    assert step(spec, req, lambda d: 1) == (3, 1)  # the draft's first token rejected
    miss = lambda d: (d[0] + 1) % V if d else 1  # noqa: E731
    assert step(spec, req, miss) == (3, 1)  # drafts again the very next step: one miss is no trend
    assert step(spec, req, miss)[0] == 0  # a second miss in a row backs off (its estimate fell)
    kv.free(req.kv)


def test_a_miss_on_a_low_record_still_backs_off():
    kv = KVManager(PageAllocator(4096), 4, enable_radix_cache=False)
    spec = NgramSpeculator(kv, k=3, n_min=1, n_max=3, max_model_len=10**6)
    req = running_request(kv)
    spec._drafting(req).acceptance = Acceptance(hits=1.0, misses=1.0)  # rate 0.5: half its drafts fail
    assert step(spec, req, lambda d: 7)[0] == 3
    assert step(spec, req, lambda d: 7)[0] == 0
    kv.free(req.kv)
