"""Sliding-window hybrids with a separate SWA pool (issue 11): colocated engine against
transformers' Ministral on the same weights, pool invariants per pool, window release, retract.

Tiny random models (4 layers, sliding/full alternating, window 8, page 4) so prompts of 40+
tokens really drop SWA pages; logprobs are compared, not only greedy tokens (an off-by-one
window often keeps the argmax)."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from tests.conftest import engine_cfg, sched_cfg, tiny_config, tiny_weights
from transfer.wire.sampling_params import SamplingParams

WINDOW, PAGE = 8, 4
TYPES = ("sliding_attention", "full_attention") * 2


@pytest.fixture(scope="module")
def swa_model():
    from transformers import MinistralConfig, MinistralForCausalLM

    cfg = tiny_config(num_layers=4, arch="mistral", sliding_window=WINDOW, layer_types=TYPES)
    weights = tiny_weights(cfg, seed=3)
    hf_cfg = MinistralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        layer_types=list(TYPES),
        bos_token_id=0,
        eos_token_id=96,
    )
    hf = MinistralForCausalLM(hf_cfg).eval()
    hf.load_state_dict(weights, strict=True)
    return cfg, weights, hf


def hf_reference(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs by a full recompute each step."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            lps.append(float(logp.max()))
    return ids[len(prompt) :], lps


def prompts(n: int, length: int, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    head = torch.randint(1, 90, (shared,), generator=g).tolist()
    return [head + torch.randint(1, 90, (length - shared,), generator=g).tolist() for _ in range(n)]


def make_llm(swa_model, **sched) -> LLM:
    cfg, weights, _ = swa_model
    eng = engine_cfg(page_size=PAGE, kv_pool_tokens=sched.pop("pool", 1024), swa_pool_tokens=sched.pop("swa", 256))
    return LLM(eng, sched_cfg(**sched), loaded=(cfg, weights, _NoTokenizer()))


class _NoTokenizer:
    eos_token_ids = (96,)

    def decode(self, ids):
        return ""


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
    batch = prompts(3, 41, shared=24)
    check_outputs(llm, swa_model[2], batch, 12)
    assert llm.scheduler.kv.swa_pages_released > 0  # the window really dropped pages
    # the same prompts again: with the radix cache they reuse the full KV of the shared prefix
    check_outputs(llm, swa_model[2], batch, 6)


def test_every_layer_in_the_full_pool_matches_too(swa_model):
    llm = make_llm(swa_model, swa=0)
    assert llm.runner.pools.swa is None and llm.scheduler.kv.usage([], "swa") is None
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    p = prompts(1, 37)[0]
    assert llm.generate_ids([p], params)[0].token_ids == hf_reference(swa_model[2], p, 10)[0]


def test_swa_pool_holds_only_the_window_while_decoding(swa_model):
    """Decoding 4W tokens, a request keeps at most ``max_pages`` SWA pages (the window plus its
    page margin: 4 pages of 4 for W=8) while its full KV grows to every token."""
    llm = make_llm(swa_model)
    kv = llm.scheduler.kv
    params = SamplingParams(max_new_tokens=4 * WINDOW, temperature=0, ignore_eos=True)
    sched = llm.scheduler
    from transfer.wire.protocol import GenerateRequest

    sched.add(b"", GenerateRequest(rid="r", params=params), prompts(1, 45)[0])
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
    check_outputs(llm, swa_model[2], prompts(3, 30), 10)
    assert llm.scheduler.stats.retractions > 0


@pytest.mark.slow
def test_small_swa_pool_limits_admission_and_stays_exact(swa_model):
    """An SWA pool of 12 pages for four 20-token prompts (5 SWA pages each at prefill): admission
    counts the SWA pool apart from the roomy full pool, so they run in turns, all exact."""
    llm = make_llm(swa_model, swa=48, pool=2048, enable_radix_cache=False)
    check_outputs(llm, swa_model[2], prompts(4, 20), 16)
    assert llm.scheduler.stats.extend_steps >= 2
    u = llm.scheduler.kv.usage([], "swa")
    assert (u.free, u.cached, llm.scheduler.kv.usage([]).free) == (48 // PAGE, 0, 2048 // PAGE)


def _decode_batch(pools, seq_lens, window):
    """A decode ForwardBatch over fresh pools: each request's SWA pages cover only its window
    (other entries 0, pointing at an SWA page that is not theirs)."""
    from engine.forward_batch import ForwardBatch, ForwardMode

    P, nxt, full_rows, swa_rows = PAGE, iter(range(1, 1000)), [], []
    full_next = iter(range(1000))
    for n in seq_lens:
        pages = -(-n // P)
        full_rows.append([next(full_next) for _ in range(pages)])
        first = max(0, n - window) // P
        swa_rows.append([0] * first + [next(nxt) for _ in range(pages - first)])
    width = max(len(r) for r in full_rows)
    pad = lambda rows: torch.tensor([r + [0] * (width - len(r)) for r in rows])  # noqa: E731
    full_t, swa_t = pad(full_rows), pad(swa_rows)
    last = [n - 1 for n in seq_lens]
    slots = lambda t: torch.tensor([int(t[i, p // P]) * P + p % P for i, p in enumerate(last)])  # noqa: E731
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(seq_lens), dtype=torch.long),
        positions=torch.tensor(last),
        out_slots=slots(full_t),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.ones(len(seq_lens), dtype=torch.long),
        block_table=full_t,
        seq_lens_cpu=list(seq_lens),
        extend_lens_cpu=[1] * len(seq_lens),
        page_size=P,
        swa_block_table=swa_t,
        swa_out_slots=slots(swa_t),
    )


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
    batch = _decode_batch(pools, seq_lens, window)
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
    check_outputs(llm, swa_model[2], prompts(1, 120), 6)
    assert llm.scheduler.stats.extend_steps >= 15
    big = make_llm(swa_model, swa=64, chunked_prefill_size=256)
    from engine.scheduler.base import RequestRejected
    from transfer.wire.protocol import GenerateRequest

    with pytest.raises(RequestRejected, match="--swa-pool-tokens"):
        big.scheduler.add(b"", GenerateRequest(rid="x", params=SamplingParams(max_new_tokens=2)), prompts(1, 120)[0])
    assert big.scheduler.stats.swa_rejections == 1 and not big.scheduler.requests  # only that one, nothing held
    check_outputs(big, swa_model[2], prompts(2, 30), 4)  # the worker goes on serving
