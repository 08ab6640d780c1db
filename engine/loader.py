"""Load Llama-family weights from a GGUF file or a HuggingFace folder.

Both paths return a :class:`ModelConfig` plus CPU tensors under HuggingFace Llama names
(``model.layers.{i}.self_attn.q_proj.weight`` ...), so the model code only ever sees one layout.
Tensors are read on access (``engine.checkpoint_tensors``): a HF folder's in their stored dtype, a
GGUF file's dequantized to float32 one tensor at a time. The model converts each to its serving
dtype as it takes it, so loading a bfloat16 checkpoint to serve in bfloat16 never holds a float32
copy, nor the whole checkpoint beside the model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from configs.sliding_window import check_swa_pool_holds_window, validate_swa_pool
from engine.checkpoint_tensors import CheckpointTensors, StoredTensor, shard_tensors
from engine.config import HF_ONLY_ARCHS, SUPPORTED_ARCHS, ModelConfig
from engine.fused_checkpoint import split_fused, unfused_names
from engine.gemma3 import Gemma3Config
from engine.gguf_cache import cached_sources
from engine.gguf_common import f32, gguf_meta, gguf_to_hf_name, open_gguf
from engine.gguf_source import GGUFSource
from engine.hf_fields import (
    FUSED_PROJ_ARCHS,
    GEMMA_ARCHS,
    MOE_ARCHS,
    QK_NORM_ARCHS,
    QKV_BIAS_ARCHS,
    SINK_ARCHS,
    check_hf_fields,
)
from engine.hf_rope import gemma3_rope, hf_rope
from engine.moe import hf_moe_spec, mixtral_name
from engine.rope_scaling import check_context
from engine.swa_config import (
    SlidingOverrides,
    SlidingSpec,
    apply_overrides,
    check_window_fits_context,
    gguf_sliding_spec,
    hf_sliding_spec,
    unsupported_arch_message,
)
from engine.tensor_shapes import expected_tensor_shapes

Tensors = Mapping[str, torch.Tensor]

# GGUF per-layer tensor suffix -> HF per-layer tensor suffix.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp's converter interleaves Q/K rows (rotary halves) only for these architectures.
_GGUF_PERMUTED_ARCHS = ("llama", "mistral")


def load_model_weights(path: str | Path, overrides: SlidingOverrides | None = None) -> tuple[ModelConfig, Tensors]:
    """Load ``path`` (a ``.gguf`` file or a HF folder) into ``(config, tensors)``.

    ``tensors`` is a :class:`~engine.checkpoint_tensors.CheckpointTensors` under HuggingFace Llama
    names: each lookup reads that tensor anew onto the CPU, from a HF folder's shard in the stored
    dtype (bfloat16 stays bfloat16), from a GGUF file dequantized to float32 (Q/K rows
    de-interleaved), so a consumer holds one tensor at a time and converts it itself. When
    embeddings are tied, ``tensors["lm_head.weight"]`` equals ``tensors["model.embed_tokens.weight"]``.
    (A Gemma 3 GGUF gives a dict of float32 tensors, the lm_head the embedding itself.) The config's
    ``layer_types`` / ``sliding_window`` follow the checkpoint (``engine.swa_config``) with
    ``overrides`` (``--sliding-window``, ``--layer-types``) applied. Raises ``FileNotFoundError``
    for a missing path, ``ValueError`` for an unsupported architecture, a corrupt file, a
    missing/misshapen tensor or inconsistent sliding-window settings (naming the flag to change).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    from engine.gguf_gemma3 import is_gemma3_gguf, load_gemma3_gguf  # Gemma 3 has its own layout

    if is_gemma3_gguf(path):
        if overrides is not None and (overrides.sliding_window is not None or overrides.layer_types is not None):
            raise ValueError(
                "--sliding-window / --layer-types are not supported for gemma3 (its windows come "
                "from the GGUF); drop them, or use --swa-pool-tokens 0 to keep every layer in the full pool"
            )
        return load_gemma3_gguf(path)
    config, sources = _load_hf_folder(path, overrides) if path.is_dir() else _load_gguf(path, overrides)
    return config, CheckpointTensors(_finalize_tensors(config, sources))


def load_for_engine(path: str | Path, engine) -> tuple[ModelConfig, Tensors]:
    """:func:`load_model_weights` with ``engine``'s (an ``EngineConfig``) overrides, then
    :func:`validate_startup`. What every worker and the offline engine load through."""
    overrides = SlidingOverrides(engine.sliding_window, engine.layer_types)
    config, tensors = load_model_weights(path, overrides)
    validate_startup(config, engine)
    return config, tensors


def read_model_config(path: str | Path, overrides: SlidingOverrides | None = None) -> ModelConfig:
    """The :class:`ModelConfig` :func:`load_model_weights` would return, without reading weights
    (config.json + safetensors headers, or GGUF metadata). Same errors."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if not path.is_dir():
        from engine.gguf_fast_reader import FastGGUF
        from engine.gguf_gemma3 import gemma3_config, is_gemma3_gguf

        if is_gemma3_gguf(path):
            return gemma3_config(FastGGUF(path), path)
        return _gguf_config(open_gguf(path), path, overrides)
    cfg, files = _hf_folder_files(path)
    sliding = _hf_sliding(cfg, overrides)
    sources = shard_tensors(files)
    return _hf_config(path, cfg, set(sources), sliding, _hf_stored_dtype(sources))


def check_startup(path: str | Path, engine) -> ModelConfig:
    """Start-up check of ``engine`` (an ``EngineConfig``) against the model at ``path``, reading no
    weights: the launcher runs it before it starts workers. ``ValueError`` names the flag to change."""
    config = read_model_config(path, SlidingOverrides(engine.sliding_window, engine.layer_types))
    validate_startup(config, engine)
    return config


def validate_startup(config: ModelConfig, engine) -> None:
    """Refuse model/engine combinations pdserve cannot run, naming the flag to change
    (``ValueError``): a sliding window larger than the context (``--sliding-window`` /
    ``--max-model-len``), an SWA pool that is not a multiple of the page size or smaller than one
    request's window (``--swa-pool-tokens``), a ``longrope`` context past its short factors
    (``--max-model-len``)."""
    check_window_fits_context(config.sliding_window, engine.max_model_len, config.max_position_embeddings)
    mpe = config.max_position_embeddings
    check_context(config.rope_scaling, min(engine.max_model_len or mpe, mpe))
    if config.sliding_window and engine.swa_pool_tokens:
        validate_swa_pool(engine.swa_pool_tokens, engine.page_size)
        check_swa_pool_holds_window(engine.swa_pool_tokens, config.sliding_window, engine.page_size)


def _finalize_tensors(config: ModelConfig, tensors: dict) -> dict:
    """Tie lm_head if needed, check names and shapes, drop tensors the model doesn't use. ``tensors``:
    torch tensors or ``StoredTensor`` sources (anything with a ``shape``; nothing is read)."""
    if config.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    out = {}
    for name, shape in expected_tensor_shapes(config).items():
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r} in model checkpoint")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
        out[name] = tensors[name]
    return out


def _check_arch(arch: str) -> str:
    """Return ``arch`` or raise the same ValueError ModelConfig would."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(unsupported_arch_message(arch, SUPPORTED_ARCHS))
    return arch


# ----------------------------------------------------------------------------- GGUF


def _gguf_sliding(reader, arch: str, num_layers: int, overrides: SlidingOverrides | None) -> SlidingSpec:
    """``{arch}.attention.sliding_window`` (+ ``_pattern``) where present, then the overrides."""
    window = gguf_meta(reader, f"{arch}.attention.sliding_window", None)
    pattern = gguf_meta(reader, f"{arch}.attention.sliding_window_pattern", None)
    return apply_overrides(gguf_sliding_spec(window, pattern, num_layers), num_layers, overrides)


def _gguf_config(reader, path: Path, overrides: SlidingOverrides | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata and the tensor name list."""
    arch = _check_arch(gguf_meta(reader, "general.architecture"))
    if arch in HF_ONLY_ARCHS:
        raise ValueError(f"model type {arch!r} is served from HF folders only (safetensors + config.json), not GGUF")
    names = {t.name for t in reader.tensors}
    layers = int(gguf_meta(reader, f"{arch}.block_count"))
    sliding = _gguf_sliding(reader, arch, layers, overrides)
    hidden = int(gguf_meta(reader, f"{arch}.embedding_length"))
    heads = int(gguf_meta(reader, f"{arch}.attention.head_count"))
    eos = [
        gguf_meta(reader, "tokenizer.ggml.eos_token_id", None),
        gguf_meta(reader, "tokenizer.ggml.eot_token_id", None),
    ]
    tokens = gguf_meta(reader, "tokenizer.ggml.tokens", None)
    vocab = len(tokens) if tokens else int(gguf_meta(reader, f"{arch}.vocab_size"))
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(gguf_meta(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(gguf_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(gguf_meta(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=f32(gguf_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=f32(gguf_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(gguf_meta(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=gguf_meta(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        sliding_window=sliding.window,
        layer_types=sliding.layer_types,
        name=str(gguf_meta(reader, "general.name", path.stem)),
        stored_dtype=_gguf_stored_dtype(reader),
    )


def _gguf_stored_dtype(reader) -> str:
    """How the first layer's Q projection is stored: float32 / bfloat16 / float16, else quantized."""
    kinds = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    for t in reader.tensors:
        if t.name == "blk.0.attn_q.weight":
            return kinds.get(getattr(t.tensor_type, "name", ""), "quantized")
    return "quantized"


def _hf_name(gguf_name: str) -> str | None:
    """HF name for a GGUF tensor name, or None for tensors the model does not use."""
    return gguf_to_hf_name(gguf_name, _GGUF_LAYER_NAMES, _GGUF_GLOBAL_NAMES)


def _load_gguf(path: Path, overrides: SlidingOverrides | None = None) -> tuple[ModelConfig, dict]:
    """Read config + the HF-named sources of a GGUF file's tensors (nothing read yet): the float32
    tensors of the weights cache (``engine.gguf_cache``) where it holds the file, else its GGUF tensors,
    dequantized when read."""
    reader = open_gguf(path)
    config = _gguf_config(reader, path, overrides)
    tag = f"llama-family:{config.arch}:{config.num_heads}:{config.num_kv_heads}"
    return config, cached_sources(path, tag, _gguf_sources(reader, path, config))


def _gguf_sources(reader, path: Path, config: ModelConfig) -> dict[str, GGUFSource]:
    """Every tensor of an opened GGUF as a float32 source under its HF name, Q/K de-interleaved."""
    permute = config.arch in _GGUF_PERMUTED_ARCHS
    sources: dict[str, GGUFSource] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        heads = None
        if permute and ".q_proj." in name:
            heads = config.num_heads
        elif permute and ".k_proj." in name:
            heads = config.num_kv_heads
        sources[name] = GGUFSource(t, path, heads)
    return sources


# ----------------------------------------------------------------------------- HF folder


def _read_json(path: Path) -> dict:
    """Parse a JSON file, raising ValueError naming it if it is malformed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON in {path}: {exc}") from exc


def _hf_arch(cfg: dict) -> str:
    """Architecture name from ``model_type`` (or ``architectures[0]``), validated."""
    arch = cfg.get("model_type")
    if not arch and cfg.get("architectures"):
        arch = cfg["architectures"][0].lower().removesuffix("forcausallm")
    return _check_arch(str(arch))


def _as_ids(value: Any) -> list[int]:
    """Normalize an int / list-of-int / None token id field to a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _hf_sliding(cfg: dict, overrides: SlidingOverrides | None) -> SlidingSpec:
    """Sliding layers of a config.json (per model type, as transformers) with the overrides applied.
    Refuses first any field pdserve does not implement (``engine.hf_fields``) and bad rope parameters."""
    arch = _hf_arch(cfg)
    check_hf_fields(cfg, arch)
    hf_rope(cfg, arch)
    layers = int(cfg["num_hidden_layers"])
    return apply_overrides(hf_sliding_spec(cfg, arch, layers), layers, overrides)


def _hf_config(
    folder: Path, cfg: dict, tensor_names: set[str], sliding: SlidingSpec, stored: str = "float32"
) -> ModelConfig:
    """Build a ModelConfig from a HF config.json dict (+ generation_config.json eos ids)."""
    arch = _hf_arch(cfg)
    heads, layers = int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    theta, scaling, rotary_dim = hf_rope(cfg, arch)
    gen_path = folder / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    eos = _as_ids(cfg.get("eos_token_id")) + _as_ids(gen.get("eos_token_id"))
    config_cls, extra = (Gemma3Config, _gemma_fields(cfg, arch, theta)) if arch in GEMMA_ARCHS else (ModelConfig, {})
    config = config_cls(
        **extra,
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if arch in GEMMA_ARCHS else 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA_ARCHS)),
        # q/k/v biases and Q/K norms as transformers builds them (a true attention_bias, which adds
        # an o_proj bias as well, is refused by engine.hf_fields)
        # gpt-oss: attention_bias (served true only) adds q/k/v and o_proj biases, and every layer has sinks
        attention_bias=arch in QKV_BIAS_ARCHS or arch in SINK_ARCHS,
        o_bias=arch in SINK_ARCHS,
        attention_sinks=arch in SINK_ARCHS,
        qk_norm=arch in QK_NORM_ARCHS,
        bos_token_id=next(iter(_as_ids(cfg.get("bos_token_id"))), None),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        sliding_window=sliding.window,
        layer_types=sliding.layer_types,
        name=folder.name,
        stored_dtype=stored,
        moe=hf_moe_spec(cfg, layers, arch) if arch in MOE_ARCHS else None,
    )
    names = unfused_names(tensor_names) if arch in FUSED_PROJ_ARCHS else tensor_names
    _check_no_unused_tensors(config, {mixtral_name(n) for n in names} if arch == "mixtral" else names)
    return config


def _gemma_fields(cfg: dict, arch: str, theta: float) -> dict:
    """The :class:`Gemma3Config` fields of a Gemma 2 / Gemma 3 text config.json, with their config
    classes' defaults: ``query_pre_attn_scalar`` 256; Gemma 2: one RoPE base for every layer, soft
    caps 50 (attention) and 30 (final logits); Gemma 3: the sliding layers' own base
    (``engine.hf_rope.gemma3_rope``), no caps (an attention cap is refused by ``engine.hf_fields``:
    its transformers attention never applies one). ``null`` is no cap."""
    gemma3 = arch == "gemma3_text"
    return {
        "rope_local_theta": gemma3_rope(cfg)[2] if gemma3 else theta,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": _cap(cfg.get("attn_logit_softcapping", None if gemma3 else 50.0)),
        "final_logit_softcapping": _cap(cfg.get("final_logit_softcapping", None if gemma3 else 30.0)),
    }


def _cap(value: Any) -> float | None:
    """A soft cap as a positive float (``None``: no cap); ``ValueError`` for 0 or a negative cap."""
    if value is None:
        return None
    if float(value) <= 0:
        raise ValueError(f"config.json soft cap {value!r} must be positive (null for none)")
    return float(value)


# Checkpoint tensors no model reads and that change nothing (older exports saved the rotary buffer).
_HARMLESS_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


def _check_no_unused_tensors(config: ModelConfig, tensor_names: set[str]) -> None:
    """Refuse a checkpoint with tensors the model would not read (a bias, a norm, an expert the
    engine does not implement): ``ValueError`` naming a few of them."""
    expected = set(expected_tensor_shapes(config))
    unused = sorted(n for n in tensor_names - expected if not n.endswith(_HARMLESS_TENSOR_SUFFIXES))
    if unused:
        raise ValueError(
            f"checkpoint has {len(unused)} tensor(s) pdserve's {config.arch!r} model does not implement, e.g. "
            f"{', '.join(unused[:4])}: refusing to serve it without them"
        )


_STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _hf_stored_dtype(sources: dict[str, StoredTensor]) -> str:
    """How the embedding is stored (the safetensors header's dtype): ``float32``, ``bfloat16``,
    ``float16``, else ``quantized``; ``float32`` if no shard has it."""
    embed = sources.get("model.embed_tokens.weight")
    return "float32" if embed is None else _STORED_DTYPES.get(embed.code, "quantized")


def _hf_folder_files(folder: Path) -> tuple[dict, list[Path]]:
    """(config.json dict, safetensors shards) of a HF folder; FileNotFoundError naming what is missing."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"HF model folder has no config.json: {cfg_path}")
    cfg = _read_json(cfg_path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        _hf_arch(cfg)  # an unsupported architecture is the better message
        raise FileNotFoundError(f"no *.safetensors files in HF model folder: {folder}")
    return cfg, files


def _load_hf_folder(
    folder: Path, overrides: SlidingOverrides | None = None
) -> tuple[ModelConfig, dict[str, StoredTensor]]:
    """Read config.json and the ``*.safetensors`` shards' headers of a HF model folder: the config and
    every tensor's source under the HF Llama names (fused projections split into row ranges), no
    tensor data read."""
    cfg, files = _hf_folder_files(folder)
    sliding = _hf_sliding(cfg, overrides)  # fail fast (architecture, windows) before reading headers
    sources = shard_tensors(files)
    config = _hf_config(folder, cfg, set(sources), sliding, _hf_stored_dtype(sources))
    if config.arch == "mixtral":
        sources = {mixtral_name(k): v for k, v in sources.items()}
    return config, split_fused(sources, config) if config.arch in FUSED_PROJ_ARCHS else sources
