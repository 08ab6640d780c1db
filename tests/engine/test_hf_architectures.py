"""Llama 3.x (rope_type llama3), Qwen2 (q/k/v biases), Qwen3 (Q/K norms), Phi-3 (fused projections,
partial rotary, longrope), Qwen3-MoE (expert mixture, one dense layer), Qwen2-MoE (q/k/v biases, a
shared expert, decoder_sparse_step with mlp_only_layers, norm_topk_prob both ways) and Mixtral from HF
folders: small random models (every weight, bias and norm drawn at random) give transformers' greedy
tokens (float32) through pdserve's loader and engine, colocated in one process."""

from __future__ import annotations

import pytest

from engine.loader import read_model_config
from tests.support.hf_folders import (
    MIXTRAL,
    PHI3_LONGROPE,
    PHI3_PARTIAL,
    QWEN2_MOE,
    QWEN3_MOE,
    engine_greedy,
    random_prompts,
    reference_greedy,
    save_small_model,
)

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
    "llama3-tied": ("llama", {"rope_parameters": LLAMA3, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "phi3-partial": ("phi3", PHI3_PARTIAL),
    "phi3-longrope": ("phi3", PHI3_LONGROPE),
    "qwen3-moe": ("qwen3_moe", QWEN3_MOE),
    "mixtral": ("mixtral", MIXTRAL),
    "qwen2-moe": ("qwen2_moe", QWEN2_MOE),
    # a shared expert of 64 (the float32 panels' width): the C decode stack runs it; 48 (above): refused,
    # the per-layer path does
    "qwen2-moe-renormalized": (
        "qwen2_moe",
        {**QWEN2_MOE, "norm_topk_prob": True, "shared_expert_intermediate_size": 64},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_equal_transformers(tmp_path, tokenizer, name, page_size):
    kind, overrides = CASES[name]
    model = save_small_model(kind, tmp_path, **overrides)
    cfg = read_model_config(tmp_path)
    assert (cfg.attention_bias, cfg.qk_norm) == (kind in ("qwen2", "qwen2_moe"), kind in ("qwen3", "qwen3_moe"))
    assert (cfg.moe is not None) == (kind in ("qwen3_moe", "mixtral", "qwen2_moe"))
    if kind == "qwen2_moe":
        shared = overrides["shared_expert_intermediate_size"]
        assert (cfg.moe.sparse_layers, cfg.moe.shared_expert_size) == ((1,), shared)
        assert cfg.moe.norm_topk_prob == overrides.get("norm_topk_prob", False)
    assert cfg.rotary_dim == (12 if kind == "phi3" else cfg.head_dim)
    prompts = random_prompts(3, 40)
    # longrope runs within original_max_position_embeddings (128 here; the prompts and tokens fit)
    limit = {"max_model_len": 128} if kind == "phi3" else {}
    got = engine_greedy(tmp_path, tokenizer, prompts, 16, page_size=page_size, **limit)
    assert got == reference_greedy(model, prompts, 16)


def test_phi3_partial_rotary_on_the_torch_attention_backend(tmp_path, tokenizer):
    """The per-layer Python path with torch attention (no C decode stack) on the partial-rotary order."""
    model = save_small_model("phi3", tmp_path, **PHI3_PARTIAL)
    prompts = random_prompts(2, 30)
    got = engine_greedy(tmp_path, tokenizer, prompts, 12, page_size=16, attention_backend="torch")
    assert got == reference_greedy(model, prompts, 12)
