"""Llama 3.x (rope_type llama3), Qwen2 (q/k/v biases), Qwen3 (Q/K norms), Phi-3 (fused projections,
partial rotary, longrope), Gemma 2 (soft caps, alternating sliding layers in the SWA pools), Gemma 3
text (Q/K norms, a sliding pattern, the local RoPE base and linear scaling of the full layers) and
Qwen3-MoE, Qwen2-MoE (its shared expert) and Mixtral (expert mixtures), and gpt-oss (attention sinks,
alternating sliding layers past their window, clamped SwiGLU experts, YaRN) from HF folders in PD mode:
small random models loaded as a worker loads them give transformers' greedy tokens (float32) through
the in-process prefill/decode pair (real schedulers, loopback KV transport), with the KV shipped
from prefill to decode, and again when the decode side retracts (a decode pool too small for every
request, and a retract forced every few steps), its KV parked on the host and resumed. Every pool
and host buffer is checked back at teardown (``checked_harnesses``)."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from configs.schema import PdserveConfig
from engine.loader import load_for_engine
from tests.support.hf_folders import (
    GEMMA2,
    GEMMA3,
    GPT_OSS,
    MIXTRAL,
    PHI3_LONGROPE,
    PHI3_PARTIAL,
    QWEN2_MOE,
    QWEN3_MOE,
    random_prompts,
    reference_greedy,
    save_small_model,
)
from transfer.wire.sampling_params import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.slow]

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}
CASES = {
    "llama3": ("llama", {"rope_parameters": LLAMA3}),
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "phi3-partial": ("phi3", PHI3_PARTIAL),
    "phi3-longrope": ("phi3", PHI3_LONGROPE),
    "gemma2": ("gemma2", GEMMA2),
    "gemma3_text": ("gemma3_text", GEMMA3),
    "qwen3-moe": ("qwen3_moe", QWEN3_MOE),
    "mixtral": ("mixtral", MIXTRAL),
    "qwen2-moe": ("qwen2_moe", QWEN2_MOE),
    "gpt-oss": ("gpt_oss", GPT_OSS),
}
NEW = 16
PARAMS = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
# Without ignore_eos admission reserves a fraction (new_token_ratio) of each request's tokens, so
# the small pool overcommits and retracts; the decode side is built without EOS ids (the harness's
# default), and these prompts draw no EOS from the prefill side (checked by the token count).
OPTIMISTIC = SamplingParams(max_new_tokens=NEW, temperature=0)
# Decode-side settings: roomy; a pool of 96 tokens (24 pages) admitted optimistically, where the
# four prompts (20 pages) fit but not their 16 tokens each (36 pages); a retract every third step.
DECODE = {
    "plain": ({"kv_pool_tokens": 4096}, {}),
    "small-pool": ({"kv_pool_tokens": 96}, {"init_new_token_ratio": 0.1}),
    "forced": ({"kv_pool_tokens": 4096}, {"retract_test_interval": 3}),
}


def _cfg(engine: dict, sched: dict, page_size: int = 4) -> PdserveConfig:
    # max_model_len 128: the longrope models' original_max_position_embeddings (the runs fit in it)
    return PdserveConfig.model_validate(
        {
            "engine": {"page_size": page_size, "dtype": "float32", "max_model_len": 128, **engine},
            "scheduler": sched,
            "cluster": {"mode": "pd", "host_kv_pool_gb": 0.01, "transfer_backend": "loopback"},
        }
    )


@pytest.fixture(scope="module", params=sorted(CASES))
def arch_model(request, tmp_path_factory):
    """(folder, prompts, transformers' greedy tokens) of one architecture's small random model."""
    kind, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = save_small_model(kind, folder, **overrides)
    prompts = [p[:20] for p in random_prompts(4, 20)]  # 4 x 5 pages
    return folder, prompts, reference_greedy(model, prompts, NEW)


@pytest.fixture
def harness():
    yield from checked_harnesses(lambda p, d, c, w: PDHarness(p, d, c, w))


@pytest.mark.parametrize("decode", sorted(DECODE))
def test_pd_greedy_tokens_equal_transformers(arch_model, harness, decode):
    folder, prompts, ref = arch_model
    prefill_cfg, decode_cfg = _cfg({"kv_pool_tokens": 4096}, {}), _cfg(*DECODE[decode])
    config, weights = load_for_engine(folder, decode_cfg.engine)
    h = harness(prefill_cfg, decode_cfg, config, weights)
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, OPTIMISTIC if decode == "small-pool" else PARAMS)
    out = h.run()
    got = [out[f"r{i}"]["tokens"] for i in range(len(prompts))]
    assert got == ref and all(len(t) == NEW for t in got)
    assert h.prefill.transfer_bytes > 0
    rs = h.decode.retract.stats
    if decode == "plain":
        assert h.decode.stats.retractions == 0
    else:
        assert h.decode.stats.retractions > 0 and rs.resumed > 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_phi3_pd_with_forced_retracts_equals_transformers(tmp_path, harness, page_size):
    """Phi-3 with partial rotary and longrope through PD at page sizes 1 and 16, a retract forced
    every third decode step: the parked and resumed KV (K in the partial-rotary head order) gives
    transformers' tokens."""
    model = save_small_model("phi3", tmp_path, **PHI3_LONGROPE)
    prompts = [p[:20] for p in random_prompts(4, 20)]
    prefill_cfg = _cfg({"kv_pool_tokens": 4096}, {}, page_size)
    decode_cfg = _cfg({"kv_pool_tokens": 4096}, {"retract_test_interval": 3}, page_size)
    config, weights = load_for_engine(tmp_path, decode_cfg.engine)
    assert config.rotary_dim == 12 and config.rope_scaling.rope_type == "longrope"
    h = harness(prefill_cfg, decode_cfg, config, weights)
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, PARAMS)
    out = h.run()
    assert [out[f"r{i}"]["tokens"] for i in range(len(prompts))] == reference_greedy(model, prompts, NEW)
    assert h.decode.stats.retractions > 0 and h.decode.retract.stats.resumed > 0
