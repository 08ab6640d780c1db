"""A tiny random Llama saved as a launchable HF folder (config.json + safetensors + the embedded
model's tokenizer.json), so ``pdserve launch`` serves real text through a real tokenizer at a speed
that lets chaos and soak runs fit in CI. Outputs are checked against the same server's own greedy
outputs before the faults (and the tiny model against transformers elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Write the folder (2 layers, hidden 64, the embedded tokenizer's 49152-token vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model_paths import resolve_model_path
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_model_path("default"))
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=list(tok.eos_token_ids),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok._tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
    return folder
