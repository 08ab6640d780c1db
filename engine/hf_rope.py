"""The RoPE settings of a HF ``config.json`` as transformers 5 standardizes them, per model type:
base, scaling (``engine.rope_scaling``) and the number of rotary dims of each head."""

from __future__ import annotations

from engine.hf_fields import ARCH_ROPE_TYPES, PARTIAL_ROTARY_ARCHS
from engine.rope_scaling import RopeScaling, parse_rope_scaling

# RoPE bases of configs that write none, where the architecture's transformers default is not 10000.
_DEFAULT_THETA = {"mixtral": 1e6, "gpt_oss": 150000.0}
# GptOssConfig's rope_parameters when config.json writes none (YaRN, factor 32 over 4096 positions).
_GPT_OSS_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def hf_rope(cfg: dict, arch: str) -> tuple[float, RopeScaling | None, int]:
    """``(rope_theta, scaling, rotary_dim)`` of a config.json as transformers 5 standardizes them:
    the legacy ``rope_scaling`` dict wins over ``rope_parameters``; a theta in the dict over the
    top-level ``rope_theta`` (default 10000). A ``partial_rotary_factor`` of 1 in the dict is the
    default; another value is served only where the architecture implements it
    (:func:`_hf_rotary_dim`). ``ValueError`` names what is refused."""
    if arch == "gemma3_text":
        theta, scaling, _ = gemma3_rope(cfg)
        return theta, scaling, _head_dim(cfg)
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    if arch == "gpt_oss" and not params:
        params = dict(_GPT_OSS_DEFAULT_ROPE)
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if params.get("partial_rotary_factor") in (1, 1.0) or arch in PARTIAL_ROTARY_ARCHS:
        params.pop("partial_rotary_factor", None)
    if arch == "phi3":
        params = _phi3_rope_params(cfg, params)
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or _DEFAULT_THETA.get(arch, 10000.0))
    head_dim = _head_dim(cfg)
    rotary_dim = _hf_rotary_dim(head_dim, partial if arch in PARTIAL_ROTARY_ARCHS else None)
    scaling = parse_rope_scaling(params, int(cfg.get("max_position_embeddings", 4096)), rotary_dim)
    allowed, kind = ARCH_ROPE_TYPES.get(arch), scaling.rope_type if scaling else "default"
    if allowed and kind not in allowed:
        raise ValueError(
            f"config.json rope_type {kind!r} is not implemented by pdserve for model type {arch!r}; "
            f"it serves {', '.join(allowed)}"
        )
    return theta, scaling, rotary_dim


_GEMMA3_LAYER_KINDS = ("full_attention", "sliding_attention")


def gemma3_rope(cfg: dict) -> tuple[float, RopeScaling | None, float]:
    """``(full layers' theta, their scaling, sliding layers' theta)`` of a ``gemma3_text`` config.json
    as Gemma3TextConfig reads it: ``rope_parameters`` nested by layer kind, the legacy
    ``rope_scaling`` dict merged into the full layers' entry, their theta defaulting to
    ``rope_theta`` (else 1e6) and the sliding layers' to ``rope_local_base_freq`` (else 1e4). The
    full layers serve ``default`` and ``linear`` (the 4B+ models' factor 8), the sliding ones
    ``default`` only; ``ValueError`` names what is refused."""
    nested = dict(cfg.get("rope_parameters") or {})
    if not set(nested) <= set(_GEMMA3_LAYER_KINDS):
        raise ValueError(
            f"config.json rope_parameters for model type 'gemma3_text' must be nested by layer kind "
            f"({', '.join(_GEMMA3_LAYER_KINDS)}); got keys {', '.join(sorted(nested))}"
        )
    # as transformers: the legacy dict updates the full layers' entry (a bare "type" beside the
    # default rope_type is then refused as a key the default type does not read)
    full = dict(nested.get("full_attention") or {"rope_type": "default"}) | dict(cfg.get("rope_scaling") or {})
    local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    full.setdefault("rope_theta", cfg.get("rope_theta") or 1e6)
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or 1e4)
    mpe, head_dim = int(cfg.get("max_position_embeddings", 4096)), _head_dim(cfg)
    scaling = parse_rope_scaling(full, mpe, head_dim)
    for kind, got, allowed in (
        ("full", scaling, ARCH_ROPE_TYPES["gemma3_text"]),
        ("sliding", parse_rope_scaling(local, mpe, head_dim), ("default",)),
    ):
        name = got.rope_type if got else "default"
        if name not in allowed:
            raise ValueError(
                f"config.json rope_type {name!r} on the {kind} layers is not implemented by pdserve for model "
                f"type 'gemma3_text'; it serves {', '.join(allowed)} there"
            )
    return float(full["rope_theta"]), scaling, float(local["rope_theta"])


def _head_dim(cfg: dict) -> int:
    """``head_dim``, else ``hidden_size / num_attention_heads`` (as the loader reads it)."""
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def _phi3_rope_params(cfg: dict, params: dict) -> dict:
    """Phi-3's rope parameters as ``Phi3Config`` reads them: types ``su`` and ``yarn`` are its
    ``longrope``; only ``default`` and ``longrope`` are valid; the top-level
    ``original_max_position_embeddings`` (default 4096) wins over the dict's."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type not in ARCH_ROPE_TYPES["phi3"]:
        raise ValueError(
            f"config.json rope_type {rope_type!r} is not valid for model type 'phi3'; it reads "
            f"{', '.join(ARCH_ROPE_TYPES['phi3'])} (su and yarn as longrope)"
        )
    params = {k: v for k, v in params.items() if k != "type"} | {"rope_type": rope_type}
    if rope_type == "longrope":
        params["original_max_position_embeddings"] = int(cfg.get("original_max_position_embeddings") or 4096)
    return params


def _hf_rotary_dim(head_dim: int, partial: float | None) -> int:
    """``int(head_dim * partial_rotary_factor)`` as transformers computes it (``None``: all dims);
    ``ValueError`` naming the field unless it is even and in ``2 .. head_dim``."""
    if partial is None:
        return head_dim
    rotary = int(head_dim * float(partial))
    if rotary % 2 or not 2 <= rotary <= head_dim:
        raise ValueError(
            f"config.json field partial_rotary_factor={partial!r} gives {rotary} rotary dims of head_dim {head_dim}; "
            f"pdserve serves an even number in 2..{head_dim}"
        )
    return rotary
