"""What the loader serves, per architecture, computed from the loader's own tables.

``pdserve models`` prints it and ``tools/gen_reference.py`` writes it into
``docs/usage/supported-models.md``; both read :func:`supported_models` and :func:`refused`, which
derive every cell from the tables the loader enforces (``engine.config``, ``engine.hf_fields``,
``engine.rope_scaling``, ``engine.swa_config``), so an architecture or field added to those tables
appears here with nothing else to edit. Only :data:`CHECKED_BY` (which test checks each
architecture against transformers) is written by hand, and a test requires an entry for each
architecture the loader accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import HF_ONLY_ARCHS, MODEL_ARCHS
from engine.hf_fields import (
    ARCH_ROPE_TYPES,
    ATTN_SOFTCAP_ARCHS,
    FUSED_PROJ_ARCHS,
    GEMMA_ARCHS,
    IMPLEMENTED,
    MOE_ARCHS,
    PARTIAL_ROTARY_ARCHS,
    QK_NORM_ARCHS,
    QKV_BIAS_ARCHS,
    SINK_ARCHS,
    allowed_text,
    restricted_fields,
)
from engine.rope_scaling import ROPE_TYPES
from engine.swa_config import UNSUPPORTED_SLIDING_ARCHS

HF_FOLDER = "HF folder"
GGUF = "GGUF"
# Architectures served by a model of their own, from GGUF only (engine.gguf_gemma3): its
# (rope, sliding, attention) cells.
GGUF_ONLY_TRAITS: dict[str, tuple[str, str, str]] = {
    "gemma3": (
        "GGUF: rope.freq_base on full layers, 10 000 on sliding ones",
        "GGUF: attention.sliding_window, llama.cpp's pattern 6 (five sliding layers to each full one)",
        "(1 + w) RMSNorm before and after attention and the MLP, Q/K RMSNorm, GeGLU (tanh GELU), embedding scale",
    ),
}
# The tests that check each architecture's greedy tokens (float32) against transformers
# (tests/e2e/test_hf_architectures_pd.py: in PD mode, with retracts).
CHECKED_BY: dict[str, tuple[str, ...]] = {
    "llama": (
        "tests/engine/test_hf_architectures.py",
        "tests/e2e/test_hf_architectures_pd.py",
        "tests/engine/test_rope_scaling.py",
        "tests/engine/test_engine_hf.py",
    ),
    "smollm": ("tests/engine/test_engine_hf.py",),
    "mistral": ("tests/engine/test_loader_swa.py",),
    "ministral": ("tests/engine/test_loader_swa.py", "tests/engine/test_swa_embedded.py", "tests/e2e/test_swa_pd.py"),
    "qwen2": (
        "tests/engine/test_hf_architectures.py",
        "tests/e2e/test_hf_architectures_pd.py",
        "tests/engine/test_loader_swa.py",
    ),
    "qwen3": (
        "tests/engine/test_hf_architectures.py",
        "tests/e2e/test_hf_architectures_pd.py",
        "tests/engine/test_loader_swa.py",
    ),
    "phi3": ("tests/engine/test_hf_architectures.py", "tests/e2e/test_hf_architectures_pd.py"),
    "mixtral": (
        "tests/engine/test_hf_architectures.py",
        "tests/e2e/test_hf_architectures_pd.py",
        "tests/engine/test_moe.py",
    ),
    "qwen2_moe": ("tests/engine/test_hf_architectures.py", "tests/e2e/test_hf_architectures_pd.py"),
    "qwen3_moe": (
        "tests/engine/test_hf_architectures.py",
        "tests/e2e/test_hf_architectures_pd.py",
        "tests/engine/test_moe.py",
        "tests/engine/test_cpu_moe.py",
        "tests/engine/test_moe_bf16.py",
    ),
    "gemma2": ("tests/engine/test_gemma2.py", "tests/e2e/test_hf_architectures_pd.py"),
    "gemma3": ("tests/engine/test_gemma3.py",),
    "gemma3_text": ("tests/engine/test_gemma3_text.py", "tests/e2e/test_hf_architectures_pd.py"),
    "gpt_oss": ("tests/engine/test_gpt_oss.py", "tests/e2e/test_hf_architectures_pd.py"),
}


@dataclass(frozen=True)
class ModelSupport:
    """One architecture (``model_type`` or GGUF ``general.architecture``) the loader accepts.

    ``formats`` are the checkpoint formats it loads from; ``rope`` the RoPE types per format;
    ``sliding`` how its sliding layers are configured (``none`` when it has none); ``attention``
    its biases and norms beyond the Llama block; ``restricted`` the implemented fields served
    with some values only (field: supported values); ``checked_by`` the tests against transformers.
    """

    arch: str
    formats: tuple[str, ...]
    rope: str
    sliding: str
    attention: str
    restricted: tuple[str, ...]
    checked_by: tuple[str, ...]


def _rope(arch: str, fields: frozenset[str]) -> str:
    types = ARCH_ROPE_TYPES.get(arch, ROPE_TYPES) if "rope_scaling" in fields else ("default",)
    text = f"HF: {', '.join(types)}"
    if "longrope" in types:
        text += " (longrope: short factors, contexts up to original_max_position_embeddings)"
    if arch in PARTIAL_ROTARY_ARCHS:
        text += ", partial rotary (partial_rotary_factor)"
    if arch in _LOCAL_ROPE_ARCHS:
        text += " on full layers; sliding layers: default with rope_local_base_freq"
    return text if arch in HF_ONLY_ARCHS else text + "; GGUF: default (rope.freq_base)"


# Architectures whose sliding layers rotate with a base of their own (engine.hf_rope.gemma3_rope).
_LOCAL_ROPE_ARCHS = frozenset({"gemma3_text"})
# Which layers slide by default in the HF-only architectures (engine.swa_config.hf_sliding_spec).
_HF_ONLY_SLIDING = {
    "phi3": "every layer",
    "gemma2": "default: alternating, sliding first",
    "gemma3_text": "default: sliding_window_pattern 6, five sliding layers to each full one",
    "qwen3_moe": "none slides: use_sliding_window true is refused",
    "qwen2_moe": "none slides: use_sliding_window true or a sliding layer in layer_types is refused",
    "mixtral": "none slides: a window other than null is refused",
    "gpt_oss": "default: alternating, sliding first, window 128",
}


def _sliding(arch: str, fields: frozenset[str]) -> str:
    keys = ("sliding_window", "layer_types", "sliding_window_pattern", "use_sliding_window", "max_window_layers")
    read = [f for f in keys if f in fields]
    if not read:
        return "none"
    if arch in HF_ONLY_ARCHS:
        return f"HF: {', '.join(read)} ({_HF_ONLY_SLIDING[arch]})"
    return f"HF: {', '.join(read)}; GGUF: attention.sliding_window (+ sliding_window_pattern)"


def _attention(arch: str) -> str:
    named = (
        ("q/k/v bias", QKV_BIAS_ARCHS),
        ("Q/K RMSNorm", QK_NORM_ARCHS),
        ("fused qkv_proj and gate_up_proj (split at load)", FUSED_PROJ_ARCHS),
        (
            "(1 + w) RMSNorm before and after attention and the MLP, GeGLU (tanh GELU), embedding scale, "
            "query_pre_attn_scalar",
            GEMMA_ARCHS,
        ),
        ("attention logit soft-capping", ATTN_SOFTCAP_ARCHS),
        (
            "q/k/v and o_proj biases, a learned sink logit per head in each softmax (torch attention paths on "
            "CPU; refused on CUDA, no C decode stack)",
            SINK_ARCHS,
        ),
        ("final logit soft-capping", GEMMA_ARCHS),
        (
            "mixture of experts (top-k of the experts by the router's softmax; Qwen3-MoE: renormalized where "
            "norm_topk_prob, decoder_sparse_step and mlp_only_layers keep dense layers; Qwen2-MoE: the same plus a "
            "shared expert gated by sigmoid(shared_expert_gate), in the C decode stack where its matmuls take the "
            "small-batch kernels; Mixtral: every layer, "
            "renormalized); on CPU decode-sized steps the C expert kernel (float32, bfloat16), torch matmuls elsewhere",
            MOE_ARCHS - SINK_ARCHS,
        ),
        (
            "mixture of experts in every layer (a router with a bias, the softmax over its top-k logits; experts with "
            "biases, gate/up interleaved, the clamped SwiGLU of swiglu_alpha and swiglu_limit), torch matmuls",
            SINK_ARCHS,
        ),
    )
    traits = [name for name, archs in named if arch in archs]
    return ", ".join(traits) or "none"


def _restricted(arch: str, fields: frozenset[str]) -> tuple[str, ...]:
    return tuple(f"{key}: {allowed_text(key, arch)}" for key in sorted(fields & set(restricted_fields(arch))))


def supported_models() -> list[ModelSupport]:
    """Every architecture the loader accepts, in name order: the HF/GGUF Llama family of
    ``engine.hf_fields.IMPLEMENTED`` and the GGUF-only ones of ``engine.config.MODEL_ARCHS``."""
    rows = []
    for arch in sorted(set(IMPLEMENTED) | set(MODEL_ARCHS)):
        checked = CHECKED_BY.get(arch, ())
        if arch in IMPLEMENTED:
            fields = IMPLEMENTED[arch]
            rows.append(
                ModelSupport(
                    arch,
                    (HF_FOLDER,) if arch in HF_ONLY_ARCHS else (HF_FOLDER, GGUF),
                    _rope(arch, fields),
                    _sliding(arch, fields),
                    _attention(arch),
                    _restricted(arch, fields),
                    checked,
                )
            )
        else:
            rope, sliding, attention = GGUF_ONLY_TRAITS[arch]
            rows.append(ModelSupport(arch, (GGUF,), rope, sliding, attention, (), checked))
    return rows


def refused() -> list[tuple[str, str]]:
    """(what, how it is refused) for what the loader refuses at load, before any weight is read."""
    names = [a + (" (from HF folders)" if a in MODEL_ARCHS else "") for a in sorted(UNSUPPORTED_SLIDING_ARCHS)]
    return [
        ("any other model type", "refused naming the supported ones; among them " + ", ".join(names)),
        (
            "a config.json field outside the architecture's list",
            "refused naming the field, its value and the fields implemented (soft-capping, MoE settings, "
            "quantization_config, ...); fields that change nothing at inference pass (auto_map among them: "
            "pdserve runs its own implementation, never checkpoint code)",
        ),
        (
            "a config.json with quantization_config (gpt-oss's MXFP4 experts, GPTQ, AWQ, ...)",
            "refused naming its quant_method: HF folders are served from unquantized bfloat16, float16 or float32 "
            "checkpoints",
        ),
        ("an implemented field with another value", "refused naming the values served (the restricted fields)"),
        ("a rope_type outside " + ", ".join(ROPE_TYPES), "refused naming the types implemented"),
        ("a checkpoint tensor the model would not read", "refused naming the tensor"),
    ]


def models_text() -> str:
    """The plain-text listing ``pdserve models`` prints: one block per architecture, then the refusals."""
    lines = []
    for m in supported_models():
        lines += [
            f"{m.arch}",
            f"  formats:    {', '.join(m.formats)}",
            f"  rope:       {m.rope}",
            f"  sliding:    {m.sliding}",
            f"  attention:  {m.attention}",
        ]
        lines += [f"  restricted: {r}" for r in m.restricted]
        lines += [f"  checked by: {', '.join(m.checked_by) or 'nothing'}", ""]
    lines.append("refused at load:")
    lines += [f"  {what}: {how}" for what, how in refused()]
    return "\n".join(lines) + "\n"
