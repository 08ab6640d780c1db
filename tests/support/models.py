"""Tiny random models and their transformers references, config shorthands, and what the
engine references leave out (``strip_eos``): plain helpers that tests import; the fixtures built on
them live in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import torch

from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.config import ModelConfig


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        arch="llama",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_ids=(96,),
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    w = {
        "model.embed_tokens.weight": r(cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": 1 + r(cfg.hidden_size),
        "lm_head.weight": r(cfg.vocab_size, cfg.hidden_size),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w.update(
            {
                p + "self_attn.q_proj.weight": r(q, cfg.hidden_size),
                p + "self_attn.k_proj.weight": r(kv, cfg.hidden_size),
                p + "self_attn.v_proj.weight": r(kv, cfg.hidden_size),
                p + "self_attn.o_proj.weight": r(cfg.hidden_size, q),
                p + "mlp.gate_proj.weight": r(cfg.intermediate_size, cfg.hidden_size),
                p + "mlp.up_proj.weight": r(cfg.intermediate_size, cfg.hidden_size),
                p + "mlp.down_proj.weight": r(cfg.hidden_size, cfg.intermediate_size),
                p + "input_layernorm.weight": 1 + r(cfg.hidden_size),
                p + "post_attention_layernorm.weight": 1 + r(cfg.hidden_size),
            }
        )
    return w


def hf_tiny(cfg: ModelConfig, weights: dict[str, torch.Tensor]):
    """transformers LlamaForCausalLM with the same random weights (reference for tiny models)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
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
        bos_token_id=0,
        eos_token_id=cfg.eos_token_ids[0],
    )
    model = LlamaForCausalLM(hf_cfg).eval()
    model.load_state_dict(weights, strict=True)
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by a full (no cache) recompute each step: the plainest reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def engine_cfg(**kw) -> EngineConfig:
    """An engine config for tests: 4096 KV tokens and the exact float32 mode unless given (``auto``
    would run a quantized or bfloat16 checkpoint in bfloat16 on a CPU with native bf16)."""
    kw.setdefault("kv_pool_tokens", 4096)
    kw.setdefault("dtype", "float32")
    return EngineConfig(**kw)


def sched_cfg(**kw) -> SchedulerConfig:
    return SchedulerConfig(**kw)


def strip_eos(ids: list[int], eos_token_ids) -> list[int]:
    """API ``token_ids`` without the EOS that ended the generation: the API returns and counts it,
    as vLLM does, while engine references (``LLM.generate_ids``, transformers minus EOS) leave it out."""
    return list(ids[:-1]) if ids and ids[-1] in eos_token_ids else list(ids)


def hf_from_gguf(model_class, path: Path):
    """``model_class.from_pretrained(folder, gguf_file=...)`` in float32, eval mode: transformers' own
    GGUF reader, name mapping and dequantization (the reference, independent of pdserve's loader).
    transformers opens the file twice (the config, then the weights), and gguf's reader parses every
    metadata field element by element (Gemma 3's 262k-token vocabulary: about 20 s a parse on a CPU);
    both opens here share one parsed reader."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(file, *args, **kwargs):
        key = (str(file), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(file, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        model = model_class.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    finally:
        gguf.GGUFReader = real
    return model.eval()
