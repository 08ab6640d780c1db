"""Colocated scheduler on a tiny random model: continuous batching, chunked prefill, radix reuse,
new_token_ratio admission, retract (forced and under real pressure), refusals and aborts.
Every scenario ends with the pool invariant: free + used + cached == total, nothing used."""

from __future__ import annotations

import random

import pytest

from engine.llm import run_batch
from engine.model_runner import ModelRunner
from engine.scheduler.base import RequestRejected
from engine.scheduler.colocated import ColocatedScheduler
from tests.support.models import engine_cfg, hf_greedy, sched_cfg
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

EOS = 96  # tiny_config's EOS; prompts avoid it and ignore_eos keeps lengths fixed


def make_sched(tiny, kv_pool_tokens=4096, page_size=4, eos=(EOS,), **sched_kw) -> ColocatedScheduler:
    cfg, weights, _ = tiny
    runner = ModelRunner(engine_cfg(kv_pool_tokens=kv_pool_tokens, page_size=page_size), cfg, weights)
    return ColocatedScheduler(runner, sched_cfg(**sched_kw), eos)


def submit(sched: ColocatedScheduler, rid: str, prompt: list[int], params: SamplingParams) -> None:
    sched.add(b"", GenerateRequest(rid=rid, params=params), prompt)


def prompts(n, lo=3, hi=40, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(0, EOS) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def refs(tiny):
    """HF greedy continuations (16 tokens) of the standard prompt set."""
    ps = prompts(6)
    return ps, [hf_greedy(tiny[2], p, 16) for p in ps]


def assert_clean(sched: ColocatedScheduler):
    sched.check_integrity()
    assert sched.kv.tree is None or sched.kv.tree.protected_size() == 0, "a radix lock was not released"
    usage = sched.kv.usage([])
    assert not sched.requests and usage.used == 0
    assert usage.free + usage.cached == usage.total


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batch_matches_hf(tiny, refs, page_size):
    sched = make_sched(tiny, page_size=page_size)
    ps, ref = refs
    out = run_batch(sched, ps, [greedy(16)] * len(ps))
    assert [o.token_ids for o in out] == ref
    assert all(o.finish_reason == "length" for o in out)
    assert_clean(sched)


def test_chunked_prefill_matches_hf(tiny, refs):
    sched = make_sched(tiny, chunked_prefill_size=7)
    ps, ref = refs
    out = run_batch(sched, ps, [greedy(16)] * len(ps))
    assert [o.token_ids for o in out] == ref
    assert sched.stats.extend_steps >= sum(len(p) for p in ps) // 7
    assert_clean(sched)


def test_radix_cache_reuses_prefix(tiny):
    sched = make_sched(tiny, page_size=4)
    base = prompts(1, 30, 30, seed=3)[0]
    first = run_batch(sched, [base], [greedy(8)])[0]
    second_prompt = base[:24] + [5, 6, 7]
    second = run_batch(sched, [second_prompt], [greedy(8)])[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 24
    assert second.token_ids == hf_greedy(tiny[2], second_prompt, 8)
    assert sched.stats.prefill_computed_tokens == 30 + 3
    assert sched.stats.cached_prompt_tokens == 24
    assert sched.kv.usage([]).cached > 0
    assert_clean(sched)


def test_radix_disabled_computes_everything(tiny):
    sched = make_sched(tiny, enable_radix_cache=False)
    base = prompts(1, 30, 30, seed=3)[0]
    run_batch(sched, [base], [greedy(4)])
    out = run_batch(sched, [base], [greedy(4)])[0]
    assert out.cached_tokens == 0 and sched.stats.prefill_computed_tokens == 60
    assert sched.kv.usage([]).free == sched.kv.usage([]).total


@pytest.mark.slow
def test_forced_retract_keeps_outputs(tiny, refs):
    sched = make_sched(tiny, retract_test_interval=3)
    ps, ref = refs
    out = run_batch(sched, ps, [greedy(16)] * len(ps))
    assert sched.stats.retractions > 0
    assert [o.token_ids for o in out] == ref
    assert_clean(sched)


@pytest.mark.slow
def test_retract_under_memory_pressure(tiny):
    # 4 requests of 20+16 tokens (9 pages each at the end) in a 24-page pool, all admitted with a
    # small new-token reservation (no ignore_eos, so new_token_ratio applies; no EOS id so lengths
    # stay fixed): decode must retract to make progress.
    sched = make_sched(tiny, kv_pool_tokens=96, page_size=4, eos=(), init_new_token_ratio=0.1)
    ps = prompts(4, 20, 20, seed=21)
    ref = [hf_greedy(tiny[2], p, 16) for p in ps]
    sp = SamplingParams(max_new_tokens=16, temperature=0)
    out = run_batch(sched, ps, [sp] * len(ps))
    assert sched.stats.retractions > 0
    assert sched.stats.retracted_output_tokens > 0
    assert [o.token_ids for o in out] == ref
    assert sched.stats.oom_aborts == 0
    assert_clean(sched)


def test_impossible_request_refused_at_once(tiny):
    sched = make_sched(tiny, kv_pool_tokens=64, page_size=4)
    with pytest.raises(
        RequestRejected,
        match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds the KV cache pool capacity of 64",
    ):
        submit(sched, "big", list(range(60)), greedy(10))
    with pytest.raises(RequestRejected, match="model context of 512"):
        submit(make_sched(tiny), "ctx", list(range(10)), greedy(600))
    assert not sched.has_work and sched.stats.rejected_requests == 1


def test_abort_frees_everything(tiny):
    sched = make_sched(tiny, chunked_prefill_size=8)
    ps = prompts(3, 20, 30, seed=5)
    for i, p in enumerate(ps):
        submit(sched, f"r{i}", p, greedy(50))
    for _ in range(6):
        sched.step()
    assert sched.kv.usage(sched.live_handles()).used > 0
    for i in range(3):
        assert sched.abort(f"r{i}").deltas[0].finish_reason == "abort"
        assert not sched.abort(f"r{i}")  # idempotent
    assert not sched.has_work
    assert_clean(sched)


@pytest.mark.slow
def test_admission_reserves_new_tokens(tiny):
    # Pool of 128 tokens, ratio 1.0: a 10-token prompt reserving 100 new tokens leaves no room for
    # a second one, so the second waits (NO_TOKEN) instead of being admitted and retracted later.
    sched = make_sched(tiny, kv_pool_tokens=128, page_size=4, init_new_token_ratio=1.0)
    ps = prompts(2, 10, 10, seed=7)
    submit(sched, "a", ps[0], greedy(100))
    submit(sched, "b", ps[1], greedy(100))
    sched.step()
    assert len(sched.running) == 1 and len(sched.waiting) == 1
    while sched.has_work:
        sched.step()
    assert sched.stats.retractions == 0
    assert_clean(sched)


@pytest.mark.slow
def test_sampled_requests_complete_with_seed(tiny):
    sched = make_sched(tiny, retract_test_interval=2)
    ps = prompts(4, seed=11)
    sp = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    a = run_batch(sched, ps, [sp] * 4)
    b = run_batch(make_sched(tiny), ps, [sp] * 4)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert all(len(x.token_ids) == 12 for x in a)
    assert_clean(sched)


@pytest.mark.slow
def test_pool_far_smaller_than_workload(tiny):
    # 16 prompts of 12-24 tokens + 16 new: ~600 tokens of demand against a 128-token pool.
    ps = prompts(16, 12, 24, seed=33)
    sp = SamplingParams(max_new_tokens=16, temperature=0)
    free_run = run_batch(make_sched(tiny, eos=()), ps, [sp] * 16)
    sched = make_sched(tiny, kv_pool_tokens=128, page_size=4, eos=(), init_new_token_ratio=0.05)
    small = run_batch(sched, ps, [sp] * 16)
    assert [o.token_ids for o in small] == [o.token_ids for o in free_run]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 16 for o in small)
    assert sched.stats.retractions > 0 and sched.stats.finished_requests == 16
    assert_clean(sched)


def test_last_request_oom_abort_then_keeps_serving(tiny):
    # Pages leased away by something else (here: taken straight from the allocator) leave the
    # lone running request no room to grow: it ends with the OOM abort, the loop carries on.
    sched = make_sched(tiny, kv_pool_tokens=64, page_size=4, eos=())
    submit(sched, "victim", prompts(1, 8, 8, seed=1)[0], greedy(40))
    sched.step()  # prefill: 8 prompt tokens -> 2 pages
    stolen = sched.kv.allocator.alloc(sched.kv.allocator.num_free())
    events = []
    while sched.has_work:
        events += sched.step().outbox.deltas
    final = [e for e in events if e.finish_reason][-1]
    assert final.finish_reason == "abort" and final.error_status == 500
    assert "KV cache pool is too small" in final.error and sched.stats.oom_aborts == 1
    sched.kv.allocator.free(stolen)
    nxt = run_batch(sched, [prompts(1, 8, 8, seed=2)[0]], [greedy(8)])[0]
    assert nxt.finish_reason == "length" and len(nxt.token_ids) == 8
    assert_clean(sched)


def test_request_that_fits_an_empty_pool_is_admitted(tiny):
    # prompt 40 + 20 * 0.7 reserved = 54 tokens = 14 of 16 pages: must be admitted at once
    # (a reservation that double-counted the prompt's pages once kept it waiting forever).
    sched = make_sched(tiny, kv_pool_tokens=64, page_size=4, eos=())
    submit(sched, "a", prompts(1, 40, 40, seed=8)[0], SamplingParams(max_new_tokens=20, temperature=0))
    for _ in range(40):
        sched.step()
        if not sched.has_work:
            break
    assert not sched.has_work and sched.stats.finished_requests == 1
    assert_clean(sched)


def test_chunked_prefill_size_defaults_by_device():
    """Unset, the prefill chunk is 512 tokens on CPU and 2048 on CUDA (the A/B the field's description cites); a
    value given is kept on either."""
    from configs.scheduler import SchedulerConfig

    assert SchedulerConfig().chunked_prefill_size is None
    assert SchedulerConfig().for_device("cpu").chunked_prefill_size == 512
    assert SchedulerConfig().for_device("cuda").chunked_prefill_size == 2048
    assert SchedulerConfig(chunked_prefill_size=96).for_device("cpu").chunked_prefill_size == 96


def test_a_colocated_scheduler_on_cpu_prefills_512_tokens_a_step(tiny):
    sched = make_sched(tiny)
    assert sched.cfg.chunked_prefill_size == 512 and sched.admission.cfg.chunked_prefill_size == 512
