"""Sliding-window hybrids with a separate SWA pool: colocated engine against
transformers' Ministral on the same weights, pool invariants per pool, window release, retract.

Tiny random models (4 layers, sliding/full alternating, window 8, page 4) so prompts of 40+
tokens really drop SWA pages; logprobs are compared, not only greedy tokens (an off-by-one
window often keeps the argmax)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from tests.support.swa import PAGE, TYPES, WINDOW, decode_batch, hf_reference, make_llm, swa_prompts
from transfer.wire.sampling_params import SamplingParams


def check_outputs(llm: LLM, hf, batch: list[list[int]], n: int) -> None:
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, logprobs=0)
    results = llm.generate_ids(batch, params)
    for p, r in zip(batch, results):
        want, want_lp = hf_reference(hf, p, n)
        assert r.error is None, r.error
        assert r.token_ids == want
        assert max(abs(a - b) for a, b in zip(r.logprobs, want_lp)) < 1e-4
    llm.scheduler.check_integrity()
    assert llm.scheduler.kv.usage([]).used == 0 and llm.scheduler.kv.usage([], "swa").used == 0


def test_swa_pool_is_separate_and_smaller(swa_model):
    llm = make_llm(swa_model)
    pools = llm.runner.pools
    assert pools.swa is not None and pools.swa.num_layers == 2 and pools.full.num_layers == 2
    assert pools.swa.num_pages == 256 // PAGE and pools.full.num_pages == 1024 // PAGE
    assert [p for p, _ in pools.layer_pool] == ["swa", "full", "swa", "full"]


@pytest.mark.slow
@pytest.mark.parametrize("radix", [True, False])
def test_colocated_swa_matches_transformers(swa_model, radix):
    llm = make_llm(swa_model, enable_radix_cache=radix)
    batch = swa_prompts(3, 41, shared=24)
    check_outputs(llm, swa_model[2], batch, 12)
    assert llm.scheduler.kv.swa_pages_released > 0  # the window really dropped pages
    # the same prompts again: with the radix cache they reuse the full KV of the shared prefix
    check_outputs(llm, swa_model[2], batch, 6)


def test_every_layer_in_the_full_pool_matches_too(swa_model):
    llm = make_llm(swa_model, swa=0)
    assert llm.runner.pools.swa is None and llm.scheduler.kv.usage([], "swa") is None
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    p = swa_prompts(1, 37)[0]
    assert llm.generate_ids([p], params)[0].token_ids == hf_reference(swa_model[2], p, 10)[0]


def test_swa_pool_holds_only_the_window_while_decoding(swa_model):
    """Decoding 4W tokens, a request keeps at most ``max_pages`` SWA pages (the window plus its
    page margin: 4 pages of 4 for W=8) while its full KV grows to every token."""
    llm = make_llm(swa_model)
    kv = llm.scheduler.kv
    params = SamplingParams(max_new_tokens=4 * WINDOW, temperature=0, ignore_eos=True)
    sched = llm.scheduler
    from transfer.wire.protocol import GenerateRequest

    sched.add(b"", GenerateRequest(rid="r", params=params), swa_prompts(1, 45)[0])
    sched.step()  # the prefill: it took SWA pages for the whole 45-token prompt, then released
    swa_used, full_used = [], []
    while sched.has_work:
        live = sched.live_handles()
        swa_used.append(kv.usage(live, "swa").used)
        full_used.append(kv.usage(live).used)
        sched.step()
        sched.check_integrity()
    assert len(swa_used) == 4 * WINDOW - 1 and max(swa_used) <= kv.window.max_pages() == 4
    assert full_used[-1] == -(-(45 + 4 * WINDOW - 1) // PAGE)  # the full pool holds every token
    assert kv.usage([], "swa").used == 0


@pytest.mark.slow
def test_forced_retract_recompute_with_swa(swa_model):
    llm = make_llm(swa_model, retract_test_interval=3)
    check_outputs(llm, swa_model[2], swa_prompts(3, 30), 10)
    assert llm.scheduler.stats.retractions > 0


@pytest.mark.slow
def test_small_swa_pool_limits_admission_and_stays_exact(swa_model):
    """An SWA pool of 12 pages for four 20-token prompts (5 SWA pages each at prefill): admission
    counts the SWA pool apart from the roomy full pool, so they run in turns, all exact."""
    llm = make_llm(swa_model, swa=48, pool=2048, enable_radix_cache=False)
    check_outputs(llm, swa_model[2], swa_prompts(4, 20), 16)
    assert llm.scheduler.stats.extend_steps >= 2
    u = llm.scheduler.kv.usage([], "swa")
    assert (u.free, u.cached, llm.scheduler.kv.usage([]).free) == (48 // PAGE, 0, 2048 // PAGE)


@pytest.mark.parametrize("window", [5, 8, 13])
def test_triton_decode_over_the_swa_pool_matches_the_torch_backend(window):
    """Triton paged decode (interpreter on CPU) on the SWA pool's block table equals the torch
    backend's windowed gather (non-resident entries point at SWA page 0, which holds other data)."""
    pytest.importorskip("triton")
    from cache.kv_pools import KVPools
    from engine.attention import TorchBackend
    from engine.kernels import paged_decode_attention

    g = torch.Generator().manual_seed(5)
    pools = KVPools(64, 64, TYPES, PAGE, 2, 16, torch.float32, "cpu")
    pools.units.copy_(torch.randn(pools.units.shape, generator=g))
    pools.swa.buffer[0] = 1e3  # a page of someone else's KV: reading it unmasked would show
    seq_lens = [3, 17, 30, 41]
    batch = decode_batch(pools, seq_lens, window)
    backend = TorchBackend(pools, 4, 16**-0.5, [window if t == "sliding_attention" else None for t in TYPES])
    backend.prepare(batch)
    q = torch.randn(len(seq_lens), 4, 16, generator=g)
    for layer in (0, 2):  # the sliding layers: SWA pool, local layers 0 and 1
        want = backend._decode(q, layer, batch).view_as(q)
        local = pools.layer_pool[layer][1]
        got = paged_decode_attention(
            q,
            pools.swa.k_layer(local),
            pools.swa.v_layer(local),
            batch.swa_block_table,
            batch.seq_lens,
            16**-0.5,
            PAGE,
            window,
            backend="triton",
            block_n=16,
        )
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_long_prompt_prefills_in_chunks_through_a_small_swa_pool(swa_model):
    """A 120-token prompt (30 pages) through a 64-token SWA pool (16 pages), 8-token chunks:
    SWA pages are taken chunk by chunk and released behind the window, so it fits; a prompt that
    needs more at once than the pool is refused at once, naming the flag."""
    llm = make_llm(swa_model, swa=64, chunked_prefill_size=8)
    check_outputs(llm, swa_model[2], swa_prompts(1, 120), 6)
    assert llm.scheduler.stats.extend_steps >= 15
    big = make_llm(swa_model, swa=64, chunked_prefill_size=256)
    from engine.scheduler.base import RequestRejected
    from transfer.wire.protocol import GenerateRequest

    with pytest.raises(RequestRejected, match="--swa-pool-tokens"):
        big.scheduler.add(
            b"", GenerateRequest(rid="x", params=SamplingParams(max_new_tokens=2)), swa_prompts(1, 120)[0]
        )
    assert big.scheduler.stats.swa_rejections == 1 and not big.scheduler.requests  # only that one, nothing held
    check_outputs(big, swa_model[2], swa_prompts(2, 30), 4)  # the worker goes on serving
