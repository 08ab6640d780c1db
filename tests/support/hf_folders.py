"""Small random transformers models of each served architecture saved as HF folders, and greedy
runs of them through pdserve's loader and engine: the per-architecture references."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.models import engine_cfg, hf_greedy, sched_cfg
from transfer.wire.sampling_params import SamplingParams

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

# Phi-4-mini's partial rotary (three quarters of each head rotates: 12 of 16 dims), and Phi-3's
# longrope (short and long factors; transformers uses the short ones up to
# original_max_position_embeddings, with the attention factor of 512 / 128) with partial rotary.
PHI3_PARTIAL = {
    "pad_token_id": 0,
    "partial_rotary_factor": 0.75,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
}
PHI3_LONGROPE = {
    "pad_token_id": 0,
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 128,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0, 1.3, 1.9, 2.8, 4.5, 7.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
    },
}

# What the Gemma 2 and Gemma 3 text models below share, on the sizes above: 4 layers, a window of 8
# keys on the sliding layers, query_pre_attn_scalar other than head_dim, and transformers' eager
# attention (the reference path that applies the soft caps and the window).
GEMMA_CORE = {
    "num_hidden_layers": 4,
    "pad_token_id": 0,
    "sliding_window": 8,
    "query_pre_attn_scalar": 12,
    "attn_implementation": "eager",
}

# Gemma 2: the sliding layers are 0 and 2 (sliding first); soft caps small enough to act on these
# random weights (the attention cap changes the greedy tokens, checked by the tests).
GEMMA2 = {**GEMMA_CORE, "attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0}

# Gemma 3 text: sliding_window_pattern 3 (layer 2 full, 3 slides again), the local RoPE base apart
# from the global one, linear scaling (factor 8, as the 4B+ models) on the full layers, a tied LM
# head; no soft caps (Gemma 3's).
GEMMA3 = {
    **GEMMA_CORE,
    "tie_word_embeddings": True,
    "sliding_window_pattern": 3,
    "rope_theta": 1e6,
    "rope_local_base_freq": 100.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}

# Qwen3-MoE with the sizes above: 8 experts of 32, the top 2 renormalized (norm_topk_prob), 4 layers
# of which layer 1 keeps the dense MLP (mlp_only_layers).
QWEN3_MOE = {
    "num_hidden_layers": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
}

# Qwen2-MoE with the sizes above: 8 experts of 32, top 2, a shared expert of 48, 4 layers with
# decoder_sparse_step 2 and mlp_only_layers [3]: layer 1 is the only sparse one (0 and 2 off the step, 3 listed);
# norm_topk_prob false (its default: the raw softmax weights).
QWEN2_MOE = {
    "num_hidden_layers": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}

# Mixtral with the sizes above: top 2 of 8 experts of intermediate_size 96, every layer sparse.
MIXTRAL = {"num_local_experts": 8, "num_experts_per_tok": 2}

# gpt-oss with the sizes above: 4 layers alternating sliding (window 8: prompts of 30+ tokens cross it)
# and full, top 2 of 8 experts of 96, a SwiGLU limit low enough to clamp these random activations,
# YaRN (factor 8 over 64 positions, truncate false as gpt-oss ships) and transformers' eager attention
# (the reference path that applies the sinks).
GPT_OSS = {
    "num_hidden_layers": 4,
    "sliding_window": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "swiglu_limit": 1.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
    "attn_implementation": "eager",
}


def _classes(kind: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[kind]


def save_small_model(kind: str, folder: Path, seed: int = 0, **overrides):
    """A ``kind`` model with :data:`SMALL` sizes (``overrides`` on top), every parameter drawn at
    random (biases and Q/K norms too: transformers initializes them to 0 / 1), saved to ``folder``
    as safetensors; returns the float32 transformers model (the reference)."""
    config_cls, model_cls = _classes(kind)
    model = model_cls(config_cls(**{**SMALL, **overrides})).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1 + noise if name.endswith("norm.weight") else noise)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def small_reference(kind: str, folder: Path, new: int, **overrides):
    """A :func:`save_small_model` of ``kind`` in ``folder``, 3 random prompts (30, 37 and 44 tokens)
    and transformers' greedy ``new`` tokens of each: ``(folder, prompts, tokens, model)``."""
    model = save_small_model(kind, folder, **overrides)
    prompts = random_prompts(3, 30)
    return folder, prompts, reference_greedy(model, prompts, new), model


def reference_variant(kind: str, folder: Path, **fields):
    """The ``kind`` model saved in ``folder`` as transformers loads it (eager attention, float32) with
    config ``fields`` changed: the same weights without a feature, to show that the feature changes
    what transformers computes (a path that ignored it would then fail)."""
    return _classes(kind)[1].from_pretrained(folder, attn_implementation="eager", **fields).eval()


def engine_greedy(
    folder: Path, tokenizer, prompts: list[list[int]], n: int, scheduler: dict | None = None, **engine
) -> list[list[int]]:
    """Greedy ``n`` tokens of each prompt from pdserve's loader and engine (one batch, float32;
    ``scheduler``: ``SchedulerConfig`` fields)."""
    from engine.llm import LLM
    from engine.loader import load_for_engine

    ecfg = engine_cfg(dtype="float32", **engine)
    cfg, weights = load_for_engine(folder, ecfg)
    llm = LLM(ecfg, sched_cfg(**(scheduler or {})), loaded=(cfg, weights, tokenizer))
    out = llm.generate_ids(prompts, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    llm.scheduler.check_integrity()
    return [r.token_ids for r in out]


def reference_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy ``n`` tokens of each prompt (full recompute per token)."""
    return [hf_greedy(model, p, n) for p in prompts]


def random_prompts(count: int, length: int, vocab: int = 128, seed: int = 1) -> list[list[int]]:
    """``count`` prompts of distinct lengths ``length, length + 7, ...`` of random ids (not 0..2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 7 * i,), generator=g).tolist() for i in range(count)]
