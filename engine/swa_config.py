"""Which layers of a checkpoint use sliding-window attention, and how wide the window is.

One place for the per-format rules (HF ``config.json`` per model type, following transformers 5.x;
GGUF metadata, following llama.cpp), the experiment overrides (``--sliding-window``,
``--layer-types``) and the start-up checks that need the model. A window ``W`` always means what
transformers means: the query at position ``i`` attends to keys ``i-W+1 .. i`` (``W`` keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from configs.sliding_window import FULL, SLIDING, parse_layer_types

# transformers' dataclass defaults, used when config.json leaves the key out.
_HF_DEFAULT_WINDOW = 4096
_GPT_OSS_DEFAULT_WINDOW = 128  # GptOssConfig's sliding_window default
_HF_DEFAULT_MAX_WINDOW_LAYERS = 28
_HF_DEFAULT_GEMMA3_PATTERN = 6  # Gemma3TextConfig: five sliding layers, then a full one
_LEGACY_KINDS = {"attention": FULL}  # transformers' remap_legacy_layer_types
# HF model types with sliding-window (or other local) attention that pdserve does not implement.
UNSUPPORTED_SLIDING_ARCHS = (
    "gemma3",
    "cohere2",
    "starcoder2",
    "olmo3",
    "exaone4",
    "mistral3",
)


@dataclass(frozen=True)
class SlidingSpec:
    """``layer_types[i]`` is ``full_attention`` or ``sliding_attention``; ``window`` is the width of
    every sliding layer (``None`` when no layer slides, possibly ``None`` before :func:`finalize`)."""

    window: int | None
    layer_types: tuple[str, ...]


@dataclass(frozen=True)
class SlidingOverrides:
    """The experiment flags: ``sliding_window`` (``--sliding-window``), ``layer_types``
    (``--layer-types``: ``alternate`` or ``sliding,full,...``). ``None`` keeps the checkpoint's."""

    sliding_window: int | None = None
    layer_types: str | None = None


def _all(kind: str, n: int) -> tuple[str, ...]:
    return (kind,) * n


def _config_kinds(raw: Sequence[Any], num_layers: int) -> tuple[str, ...]:
    """config.json ``layer_types`` checked like transformers' ``validate_layer_type``."""
    kinds = tuple(_LEGACY_KINDS.get(str(k), str(k)) for k in raw)
    bad = sorted({k for k in kinds if k not in (FULL, SLIDING)})
    if bad:
        raise ValueError(
            f"config.json layer_types has {', '.join(map(repr, bad))}: pdserve implements only "
            f"{FULL!r} and {SLIDING!r} layers; override them with --layer-types or choose another --model"
        )
    if len(kinds) != num_layers:
        raise ValueError(
            f"config.json layer_types has {len(kinds)} entries for {num_layers} layers: "
            f"override them with --layer-types"
        )
    return kinds


def hf_sliding_spec(cfg: dict, arch: str, num_layers: int) -> SlidingSpec:
    """Sliding layers of a HF ``config.json`` of model type ``arch``, as transformers 5.x builds them.

    - ``ministral``: ``sliding_window`` (default 4096; ``null`` = none) and ``layer_types``
      (default: every layer sliding if there is a window, else every layer full).
    - ``mistral``: one window for every layer (MistralConfig drops ``layer_types``), except that a
      config.json with a ``layer_types`` key is read as ``ministral``, as transformers' AutoConfig
      does ("mistral model with layer_types, treating as ministral").
    - ``qwen2`` / ``qwen3``: nothing slides unless ``use_sliding_window``; then ``layer_types`` if
      given, else layers ``i >= max_window_layers`` (default 28) slide. With sliding off a
      ``layer_types`` list is ignored (transformers would fail at the first forward on one that
      lists sliding layers: its window is forced to ``None``).
    - ``phi3``: one window for every layer when ``sliding_window`` is set (default ``None``); a window
      of at least ``max_position_embeddings`` keys never hides one (Phi-4-mini's 262144), so it is
      dropped rather than refused as wider than the context.
    - ``gemma2``: ``layer_types`` if given, else alternating layers, sliding first (Gemma2Config's
      default), each sliding layer with ``sliding_window`` (default 4096).
    - ``gemma3_text``: ``layer_types`` if given, else layer ``i`` slides unless ``(i + 1) %
      sliding_window_pattern == 0`` (default 6: five sliding, one full), each sliding layer with
      ``sliding_window`` (default 4096). A pattern (``sliding_window_pattern``, or the
      ``_sliding_window_pattern`` newer exports write beside ``layer_types``) that disagrees with
      ``layer_types`` is refused: transformers would follow the list, the author may have meant either.
    - ``gpt_oss``: ``layer_types`` if given, else alternating layers, sliding first (GptOssConfig's
      default), each sliding layer with ``sliding_window`` (default 128).
    - ``mixtral``: full attention (a ``sliding_window`` other than ``null`` is refused by ``engine.hf_fields``).
    - ``qwen3_moe`` / ``qwen2_moe``: full attention (``use_sliding_window`` true is refused by
      ``engine.hf_fields``; Qwen2-MoE's ``layer_types`` is served only all ``full_attention``).
    - ``llama`` / ``smollm``: full attention (transformers' Llama has no sliding window).
    """
    window = cfg.get("sliding_window", _HF_DEFAULT_WINDOW)
    raw_types = cfg.get("layer_types")
    if arch == "mistral" and "layer_types" in cfg:
        arch = "ministral"
    if arch == "mistral":
        return SlidingSpec(window, _all(SLIDING if window is not None else FULL, num_layers))
    if arch == "ministral":
        if raw_types is None:
            return SlidingSpec(window, _all(SLIDING if window is not None else FULL, num_layers))
        return SlidingSpec(window, _config_kinds(raw_types, num_layers))
    if arch == "phi3":
        window = cfg.get("sliding_window")
        if window is None or int(window) >= int(cfg.get("max_position_embeddings", 4096)):
            return SlidingSpec(None, _all(FULL, num_layers))
        return SlidingSpec(int(window), _all(SLIDING, num_layers))
    if arch == "gemma2":
        if raw_types is not None:
            return SlidingSpec(window, _config_kinds(raw_types, num_layers))
        return SlidingSpec(window, tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers)))
    if arch == "gemma3_text":
        return SlidingSpec(window, _gemma3_kinds(cfg, num_layers))
    if arch == "gpt_oss":
        window = cfg.get("sliding_window", _GPT_OSS_DEFAULT_WINDOW)
        if raw_types is not None:
            return SlidingSpec(window, _config_kinds(raw_types, num_layers))
        return SlidingSpec(window, tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers)))
    if arch == "qwen2_moe":
        return SlidingSpec(None, _qwen2_moe_kinds(raw_types, num_layers))
    if arch in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False) or window is None:
            return SlidingSpec(None, _all(FULL, num_layers))
        if raw_types is not None:
            return SlidingSpec(window, _config_kinds(raw_types, num_layers))
        first = cfg.get("max_window_layers", _HF_DEFAULT_MAX_WINDOW_LAYERS)
        return SlidingSpec(window, tuple(SLIDING if i >= first else FULL for i in range(num_layers)))
    return SlidingSpec(None, _all(FULL, num_layers))


def _qwen2_moe_kinds(raw: Sequence[Any] | None, num_layers: int) -> tuple[str, ...]:
    """Qwen2-MoE's layers: every one full attention. A ``layer_types`` naming a sliding layer is refused
    (its sliding attention is not implemented; Qwen2MoeConfig writes the list, all full, when
    ``use_sliding_window`` is false, the only value served)."""
    kinds = _all(FULL, num_layers) if raw is None else _config_kinds(raw, num_layers)
    if SLIDING in kinds:
        raise ValueError(
            f"config.json field layer_types={list(raw or ())!r} is not implemented by pdserve for model type "
            f"'qwen2_moe'; supported: every layer {FULL!r} (sliding attention is not implemented for it)"
        )
    return kinds


def gemma3_pattern_kinds(pattern: Any, num_layers: int) -> tuple[str, ...]:
    """Gemma3TextConfig's layers from ``sliding_window_pattern`` ``n`` (``None``: 6): layer ``i`` is
    full iff ``(i + 1) % n == 0``. ``ValueError`` naming the field for ``n < 1``."""
    n = _HF_DEFAULT_GEMMA3_PATTERN if pattern is None else int(pattern)
    if n < 1:
        raise ValueError(f"config.json sliding_window_pattern={pattern!r} must be >= 1 (one full layer in n)")
    return tuple(FULL if (i + 1) % n == 0 else SLIDING for i in range(num_layers))


def _gemma3_kinds(cfg: dict, num_layers: int) -> tuple[str, ...]:
    """A ``gemma3_text`` config's layer kinds (see :func:`hf_sliding_spec`)."""
    raw_types = cfg.get("layer_types")
    if raw_types is None:
        return gemma3_pattern_kinds(cfg.get("sliding_window_pattern"), num_layers)
    kinds = _config_kinds(raw_types, num_layers)
    for key in ("sliding_window_pattern", "_sliding_window_pattern"):
        if cfg.get(key) is not None and gemma3_pattern_kinds(cfg[key], num_layers) != kinds:
            raise ValueError(
                f"config.json {key}={cfg[key]!r} disagrees with its layer_types: pdserve serves a "
                f"pattern only where it gives the same layers; fix config.json or drop one of them"
            )
    return kinds


def gguf_sliding_spec(window: int | None, pattern: int | Sequence[bool] | None, num_layers: int) -> SlidingSpec:
    """Sliding layers from GGUF ``{arch}.attention.sliding_window`` (+ ``.sliding_window_pattern``).

    No window (absent or 0): every layer full. A window without a pattern: every layer slides (one
    window for the whole model, as Mistral). An integer pattern ``n`` follows llama.cpp's
    ``set_swa_pattern``: layer ``i`` slides iff ``n == 0`` or ``i % n < n - 1`` (``n = 4``: three
    sliding, then one full). A list pattern gives one bool per layer, true = sliding.
    """
    if not window:
        return SlidingSpec(None, _all(FULL, num_layers))
    if pattern is None:
        return SlidingSpec(int(window), _all(SLIDING, num_layers))
    if isinstance(pattern, (int, float)):
        n = int(pattern)
        return SlidingSpec(int(window), tuple(SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(num_layers)))
    flags = [bool(x) for x in pattern]
    if len(flags) != num_layers:
        raise ValueError(
            f"GGUF sliding_window_pattern has {len(flags)} entries for {num_layers} layers: "
            f"override it with --layer-types"
        )
    return SlidingSpec(int(window), tuple(SLIDING if f else FULL for f in flags))


def apply_overrides(spec: SlidingSpec, num_layers: int, overrides: SlidingOverrides | None) -> SlidingSpec:
    """The checkpoint's ``spec`` with the experiment flags applied, then :func:`finalize` d.

    ``--sliding-window W`` replaces the window of the sliding layers; if no layer slides and no
    ``--layer-types`` is given, every layer slides. ``--layer-types`` replaces the kinds (its length
    must be ``num_layers``); its sliding layers use ``--sliding-window`` or else the checkpoint's window.
    """
    o = overrides or SlidingOverrides()
    window = o.sliding_window if o.sliding_window is not None else spec.window
    if o.layer_types is not None:
        kinds = parse_layer_types(o.layer_types, num_layers)
    elif o.sliding_window is not None and SLIDING not in spec.layer_types:
        kinds = _all(SLIDING, num_layers)
    else:
        kinds = spec.layer_types
    return finalize(SlidingSpec(window, kinds))


def finalize(spec: SlidingSpec) -> SlidingSpec:
    """Enforce ``window`` set iff some layer slides; ``ValueError`` naming ``--sliding-window`` for
    sliding layers without a window or a window < 1."""
    sliding = [i for i, k in enumerate(spec.layer_types) if k == SLIDING]
    if not sliding:
        return SlidingSpec(None, spec.layer_types)
    if spec.window is None:
        raise ValueError(
            f"layers {sliding[:8]}{'...' if len(sliding) > 8 else ''} use sliding-window attention "
            f"but the model gives no window: set --sliding-window W (or make them full with "
            f"--layer-types)"
        )
    if int(spec.window) < 1:
        raise ValueError(f"sliding window must be >= 1, got {spec.window}: set --sliding-window")
    return SlidingSpec(int(spec.window), spec.layer_types)


def check_window_fits_context(window: int | None, max_model_len: int | None, max_position_embeddings: int) -> None:
    """Start-up check: a sliding window larger than the context the engine runs with is refused.

    The context is ``min(max_model_len or max_position_embeddings, max_position_embeddings)`` (as the
    model runner computes it). ``ValueError`` names ``--sliding-window`` and ``--max-model-len``.
    """
    if window is None:
        return
    context = min(max_model_len or max_position_embeddings, max_position_embeddings)
    if window > context:
        raise ValueError(
            f"sliding window {window} is larger than the context length {context} (--max-model-len, at "
            f"most the model's {max_position_embeddings}): set --sliding-window to at most {context}"
            + (f" or raise --max-model-len to at least {window}" if window <= max_position_embeddings else "")
        )


def unsupported_arch_message(arch: str, supported: Sequence[str]) -> str:
    """The error for a model type pdserve cannot run, naming ``--model`` for one with sliding windows."""
    base = f"unsupported architecture {arch!r}; supported: {', '.join(supported)}"
    if arch in UNSUPPORTED_SLIDING_ARCHS:
        return (
            base + f". Model type {arch!r} uses sliding-window attention that pdserve does not implement "
            f"(sliding windows are supported for gemma2, gemma3_text, ministral, mistral, phi3, qwen2, qwen3): "
            f"choose another --model"
        )
    return base
