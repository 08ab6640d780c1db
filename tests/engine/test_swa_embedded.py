"""The SWA pool on real weights: SmolLM2-135M as a sliding/full hybrid
(sliding on even layers, window 61: not a multiple of any page size) against transformers'
``MinistralForCausalLM`` with the same weights, comparing the top-5 logprobs of every step
within 1e-3 as well as the greedy tokens: colocated (page 16 and 64, chunked prefill crossing
the window edge), PD with the decode radix cache, forced retract with offload and with
recompute. Prompts are at least 3W tokens, so every request drops SWA pages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.harness.pd_harness import PDHarness
from configs.schema import PdserveConfig
from engine.llm import LLM, run_batch
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the embedded model against transformers

W, NEW, TOP = 61, 12, 5
TYPES = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(30))


@pytest.fixture(scope="module")
def hybrid(embedded, hf_embedded):
    from transformers import MinistralConfig, MinistralForCausalLM

    cfg = dataclasses.replace(embedded[0], sliding_window=W, layer_types=TYPES)
    hf_cfg = MinistralConfig(
        **{
            **hf_embedded.config.to_dict(),
            "layer_types": list(TYPES),
            "sliding_window": W,
            "model_type": "ministral",
            "architectures": ["MinistralForCausalLM"],
        }
    )
    hf = MinistralForCausalLM(hf_cfg).eval()
    hf.load_state_dict(hf_embedded.state_dict(), strict=True)
    return cfg, embedded[1], embedded[2], hf


@pytest.fixture(scope="module")
def prompts(hybrid):
    g = torch.Generator().manual_seed(61)
    shared = torch.randint(100, 40000, (70,), generator=g).tolist()
    return [shared + torch.randint(100, 40000, (n,), generator=g).tolist() for n in (140, 125)]


@pytest.fixture(scope="module")
def reference(hybrid, prompts):
    """Per prompt: transformers' greedy tokens and each step's top-5 (token, logprob)."""
    hf, out = hybrid[3], []
    with torch.no_grad():
        for p in prompts:
            ids, tops = list(p), []
            for _ in range(NEW):
                logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
                v, i = logp.topk(TOP)
                tops.append(list(zip(i.tolist(), v.tolist())))
                ids.append(int(i[0]))
            out.append((ids[len(p) :], tops))
    return out


def check(results, reference) -> None:
    for (tokens, tops), (want, want_tops) in zip(results, reference):
        assert tokens == want
        for got, exp in zip(tops, want_tops):
            assert [t for t, _ in got] == [t for t, _ in exp]
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, exp)) < 1e-3


PARAMS = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True, logprobs=TOP)


@pytest.mark.parametrize("page,chunk", [(16, 50), (64, 4096)])
def test_colocated_embedded_hybrid_matches_transformers(hybrid, prompts, reference, page, chunk):
    llm = LLM(
        engine_cfg(page_size=page, kv_pool_tokens=4096, swa_pool_tokens=1024),
        sched_cfg(chunked_prefill_size=chunk),
        loaded=hybrid[:3],
    )
    out = run_batch(llm.scheduler, prompts, [PARAMS] * 2)
    check([(o.token_ids, o.top_logprobs) for o in out], reference)
    assert llm.scheduler.kv.swa_pages_released > 0
    llm.scheduler.check_integrity()


def _pd_cfg(**sched) -> PdserveConfig:
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": 4096, "page_size": 16, "swa_pool_tokens": 1024, "dtype": "float32"},
            "scheduler": sched,
            "cluster": {"mode": "pd", "host_kv_pool_gb": 0.05, "transfer_backend": "loopback"},
        }
    )


def _pd(h: PDHarness, prompts) -> list:
    for i, p in enumerate(prompts):
        h.submit(f"e{i}", p, PARAMS)
    by_rid: dict = {}
    for _ in range(100000):
        if not h.busy:
            break
        for d in h.step():
            o = by_rid.setdefault(d.rid, ([], []))
            o[0].extend(d.token_ids)
            o[1].extend(d.top_logprobs)
    h.check_clean()
    return [by_rid[f"e{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("host_gb", [0.05, 0.0], ids=["offload", "recompute"])
def test_pd_embedded_hybrid_with_decode_radix_and_forced_retract(hybrid, prompts, reference, host_gb):
    d = _pd_cfg(retract_test_interval=4)
    d.cluster.host_kv_pool_gb = host_gb
    h = PDHarness(_pd_cfg(), d, hybrid[0], hybrid[1], eos=(2,))
    try:
        check(_pd(h, prompts), reference)
        st = h.decode.retract.stats
        assert (st.offloaded > 0 and st.resumed > 0) if host_gb else st.recomputed > 0
        # the decode radix cache: the same prompts again come mostly from the decode worker's tree
        before = h.decode.stats.cached_prompt_tokens
        check(_pd(h, prompts), reference)
        assert h.decode.stats.cached_prompt_tokens - before >= 2 * 112
    finally:
        h.close()
