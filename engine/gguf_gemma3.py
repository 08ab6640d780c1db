"""Load a Gemma 3 GGUF (``general.architecture == "gemma3"``) into HF-named float32 tensors.

Conventions of llama.cpp's Gemma 3 files that we undo or fill in:
- RMSNorm weights are stored as ``1 + w``; we subtract the 1 (HF's layout, ``engine.gemma3``
  adds it back), as transformers does when it reads these files;
- Q/K rows are *not* interleaved for Gemma (only llama/mistral are), so they load as they are;
- which layers slide is not in the metadata of most files: llama.cpp fixes the pattern at 6
  (five sliding layers, then one full) unless ``gemma3.attention.sliding_window_pattern`` says
  otherwise; the local RoPE base is 10000 unless ``gemma3.rope.local_freq_base`` is present;
- ``query_pre_attn_scalar`` is ``head_dim``, except for the 27B model (62 layers), where it is
  ``hidden_size / num_heads`` (as llama.cpp and the HF configs have it);
- ``<end_of_turn>`` ends a chat turn, so it is an EOS id next to ``<eos>``.
Quantized tensors (Q4_K, Q5_0, Q6_K, Q8_0 ...) are dequantized with ``gguf``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.gemma3 import Gemma3Config
from engine.gguf_cache import cached_tensors
from engine.gguf_common import dequantize_tensor, f32, gguf_to_hf_name, progress
from engine.gguf_fast_reader import FastGGUF

Tensors = dict[str, torch.Tensor]
ARCH = "gemma3"
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
_DEFAULT_SWA_PATTERN = 6
_END_OF_TURN = "<end_of_turn>"


def is_gemma3_gguf(path: Path) -> bool:
    """True when ``path`` is a readable GGUF file whose architecture is ``gemma3`` (a broken file
    gives False here and its usual error from ``engine.loader``)."""
    if not path.is_file():
        return False
    try:
        return FastGGUF(path).meta("general.architecture", None) == ARCH
    except (OSError, ValueError):
        return False


def load_gemma3_gguf(path: Path) -> tuple[Gemma3Config, Tensors]:
    """``(config, tensors)`` of a Gemma 3 GGUF; tensors float32 CPU under HF Gemma 3 names.

    Raises ``ValueError`` for another architecture, unsupported RoPE scaling, or a missing or
    misshapen tensor.
    """
    reader = FastGGUF(path)
    config = gemma3_config(reader, path)
    tensors = cached_tensors(path, "gemma3", lambda: _tensors(reader, path))
    _check_shapes(config, tensors)
    return config, tensors


def _tensors(reader: FastGGUF, path: Path) -> Tensors:
    """Every tensor of an opened Gemma 3 GGUF dequantized to float32 under its HF name (norms as HF's
    ``weight``, GGUF storing ``1 + weight``)."""
    tensors: Tensors = {}
    for t in progress(reader.tensors, f"loading {path.name}", len(reader.tensors)):
        name = _hf_name(t.name)
        if name is None:
            continue
        w = dequantize_tensor(t, path)
        if name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    return tensors


def gemma3_config(reader: FastGGUF, path: Path) -> Gemma3Config:
    """Gemma3Config from the GGUF metadata (see the module docstring for the filled-in values)."""
    arch = reader.meta("general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path} is a {arch!r} GGUF, not {ARCH!r}")
    if reader.meta(f"{ARCH}.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{path}: RoPE scaling {reader.meta(f'{ARCH}.rope.scaling.type')!r} is not supported")
    m = lambda key, *default: reader.meta(f"{ARCH}.{key}", *default)  # noqa: E731
    hidden, heads, layers = int(m("embedding_length")), int(m("attention.head_count")), int(m("block_count"))
    head_dim = int(m("attention.key_length", hidden // heads))
    tokens = reader.meta("tokenizer.ggml.tokens")
    eos = [reader.meta("tokenizer.ggml.eos_token_id", None), reader.meta("tokenizer.ggml.eot_token_id", None)]
    if _END_OF_TURN in tokens:
        eos.append(tokens.index(_END_OF_TURN))
    window = int(m("attention.sliding_window"))
    return Gemma3Config(
        arch=ARCH,
        vocab_size=len(tokens),
        hidden_size=hidden,
        intermediate_size=int(m("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(m("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=f32(m("rope.freq_base", 1_000_000.0)),
        rope_local_theta=f32(m("rope.local_freq_base", 10_000.0)),
        rms_norm_eps=f32(m("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(m("context_length", 32768)),
        tie_word_embeddings=True,
        qk_norm=True,
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        bos_token_id=reader.meta("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        sliding_window=window,
        layer_types=_layer_types(m("attention.sliding_window_pattern", None), layers),
        name=str(reader.meta("general.name", path.stem)),
    )


def _layer_types(pattern, num_layers: int) -> tuple[str, ...]:
    """Per-layer kinds from a pattern period (int) or per-layer sliding flags (list of bool)."""
    if isinstance(pattern, (list, tuple)):
        flags = [bool(p) for p in pattern]
    else:
        period = int(pattern or _DEFAULT_SWA_PATTERN)
        flags = [i % period < period - 1 for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"sliding_window_pattern has {len(flags)} entries for {num_layers} layers")
    return tuple("sliding_attention" if f else "full_attention" for f in flags)


def _hf_name(gguf_name: str) -> str | None:
    """HF Gemma 3 name of a GGUF tensor, or None for tensors the model does not use."""
    return gguf_to_hf_name(gguf_name, _LAYER_NAMES, _GLOBAL_NAMES)


def expected_gemma3_shapes(c: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Gemma 3 model with config ``c`` needs, mapped to its shape."""
    q, kv, hid, ffn = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hid), "model.norm.weight": (hid,)}
    per_layer = {
        "self_attn.q_proj.weight": (q, hid),
        "self_attn.k_proj.weight": (kv, hid),
        "self_attn.v_proj.weight": (kv, hid),
        "self_attn.o_proj.weight": (hid, q),
        "self_attn.q_norm.weight": (c.head_dim,),
        "self_attn.k_norm.weight": (c.head_dim,),
        "mlp.gate_proj.weight": (ffn, hid),
        "mlp.up_proj.weight": (ffn, hid),
        "mlp.down_proj.weight": (hid, ffn),
        **{
            f"{n}.weight": (hid,)
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        },
    }
    for i in range(c.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def _check_shapes(config: Gemma3Config, tensors: Tensors) -> None:
    """Raise ValueError naming the first missing or misshapen tensor."""
    for name, shape in expected_gemma3_shapes(config).items():
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r} in Gemma 3 checkpoint")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
