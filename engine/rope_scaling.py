"""RoPE scaling of HF checkpoints: the inverse frequencies and the cos/sin factor of each type.

Every rotary path (torch, the C kernels, the C decode stack, Triton) reads one float32 cos/sin
table (``engine.rope.RotaryEmbedding``), so a scaling type only changes how that table is built:
the inverse frequencies ``inv_freq`` and the factor ``attention_factor`` both cos and sin are
multiplied by. The formulas follow transformers' ``modeling_rope_utils`` (5.x) line for line, in
float32 as it computes them, so the frequencies are the ones the reference model uses.

Sequence-length dependent types are served where they are static:
- ``dynamic`` (NTK) recomputes its base only for sequences longer than
  ``max_position_embeddings``; pdserve never runs past that length, so its table is the default one.
- ``longrope`` switches from ``short_factor`` to ``long_factor`` past
  ``original_max_position_embeddings``; pdserve serves it with the short factors and refuses a
  context longer than that length (:func:`check_context`), where transformers' choice would depend
  on each forward's longest sequence (and its cached keys would mix both). Within that length
  transformers uses the short factors too, with the attention factor of
  ``max_position_embeddings / original_max_position_embeddings`` (Phi-3's top-level
  ``original_max_position_embeddings``, engine.loader); the long factors are checked, not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# The keys each type reads (transformers' _validate_*_rope_parameters); any other key is refused.
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta"})
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": _COMMON_KEYS,
    "linear": _COMMON_KEYS | {"factor"},
    "dynamic": _COMMON_KEYS | {"factor", "original_max_position_embeddings"},
    "llama3": _COMMON_KEYS | {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": _COMMON_KEYS
    | {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow"}
    | {"mscale", "mscale_all_dim", "truncate"},
    "longrope": _COMMON_KEYS
    | {"factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"},
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
    "longrope": ("short_factor", "long_factor"),
}


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's ``rope_parameters`` (or legacy ``rope_scaling``) with transformers' defaults
    filled in. ``original_max_position_embeddings`` defaults to the model's
    ``max_position_embeddings`` (transformers' ``standardize_rope_params``). Factor lists are tuples
    of ``head_dim // 2`` numbers."""

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def parse_rope_scaling(params: dict, max_position_embeddings: int, head_dim: int) -> RopeScaling | None:
    """The :class:`RopeScaling` of a ``rope_parameters`` dict (``None`` for the default type);
    ``head_dim`` is the number of rotary dims of a head (less than the head with partial rotary).

    ``ValueError`` names the key and value for an unknown ``rope_type``, a key the type does not
    read, a missing required key or a factor list of the wrong length."""
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"config.json rope_type {rope_type!r} is not implemented; pdserve implements {', '.join(ROPE_TYPES)}"
        )
    extra = sorted(set(params) - ROPE_KEYS[rope_type])
    if extra:
        shown = ", ".join(f"{k}={params[k]!r}" for k in extra)
        raise ValueError(
            f"config.json rope parameters {shown} are not implemented for rope_type {rope_type!r}; "
            f"pdserve reads {', '.join(sorted(ROPE_KEYS[rope_type]))}"
        )
    if rope_type == "default":
        return None
    missing = [k for k in _REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise ValueError(f"config.json rope_type {rope_type!r} needs {', '.join(missing)}")
    opt = lambda k: None if params.get(k) is None else float(params[k])  # noqa: E731
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=opt("factor"),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings") or max_position_embeddings),
        low_freq_factor=opt("low_freq_factor"),
        high_freq_factor=opt("high_freq_factor"),
        attention_factor=opt("attention_factor"),
        beta_fast=opt("beta_fast"),
        beta_slow=opt("beta_slow"),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
    )
    for name in ("short_factor", "long_factor"):
        got = len(getattr(scaling, name))
        if rope_type == "longrope" and got != head_dim // 2:
            raise ValueError(f"config.json rope {name} has {got} entries, expected rotary dims // 2 = {head_dim // 2}")
    return scaling


def check_context(scaling: RopeScaling | None, context: int) -> None:
    """Start-up check: ``longrope`` runs only within ``original_max_position_embeddings`` (its short
    factors); ``ValueError`` names ``--max-model-len`` otherwise."""
    if scaling is None or scaling.rope_type != "longrope":
        return
    orig = scaling.original_max_position_embeddings or context
    if context > orig:
        raise ValueError(
            f"rope_type 'longrope' is served with its short factors only, up to original_max_position_embeddings "
            f"= {orig} tokens; the context would be {context}: set --max-model-len {orig} (or less)"
        )


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """transformers' default inverse frequencies, float32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))


def _llama3(s: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    inv_freq = _base_inv_freq(head_dim, theta)
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(s: RopeScaling, head_dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, float]:
    dim, orig = head_dim, s.original_max_position_embeddings
    factor = s.factor if s.factor is not None else max_pos / orig
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _longrope(s: RopeScaling, head_dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, float]:
    orig = s.original_max_position_embeddings
    factor = s.factor if s.factor is not None else max_pos / orig
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = torch.tensor(s.short_factor, dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta**shape), attention_factor


def scaled_inv_freq(s: RopeScaling, head_dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq float32 [head_dim // 2], attention_factor)`` of ``s`` for a model with
    ``max_position_embeddings = max_pos``, as transformers computes them at model start."""
    if s.rope_type == "linear":
        return _base_inv_freq(head_dim, theta) / s.factor, 1.0
    if s.rope_type == "dynamic":  # its base changes only past max_position_embeddings
        return _base_inv_freq(head_dim, theta), 1.0
    if s.rope_type == "llama3":
        return _llama3(s, head_dim, theta), 1.0
    if s.rope_type == "yarn":
        return _yarn(s, head_dim, theta, max_pos)
    if s.rope_type == "longrope":
        return _longrope(s, head_dim, theta, max_pos)
    raise ValueError(f"rope_type {s.rope_type!r} is not implemented")
