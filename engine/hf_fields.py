"""Which ``config.json`` fields pdserve implements, per architecture; every other field is refused.

A checkpoint is served only if each of its fields is either implemented (the model computes what
transformers computes with that value), harmless (metadata, token ids, training-only settings that
change nothing at inference) or unset (``null``). Anything else is refused at load with the field,
its value and what is supported, so no model is served with a field the engine silently ignores.
The table is explicit: a field transformers adds in a later version is refused until it is listed.
"""

from __future__ import annotations

from typing import Any

# Fields that never change the computation of a served model.
HARMLESS = frozenset(
    {
        "_name_or_path",
        "_model_name_or_path",  # the checkpoint's name, as some exporters spell it
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",  # a tokenizer id: the forward pass never reads it
        "id2label",
        "label2id",
        "problem_type",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "is_encoder_decoder",
        "chunk_size_feed_forward",
        "use_cache",
        "initializer_range",
        "attention_dropout",  # dropout is off at inference
        "resid_pdrop",
        "embd_pdrop",
        "pretraining_tp",  # a training-time matmul split; the same product (transformers 5 ignores it)
        "is_llama_config",  # SmolLM2 metadata
        "transformers.js_config",
        "tokenizer_class",
        # remote-code pointers (trust_remote_code): pdserve runs its own implementation of the
        # model type and never imports or runs checkpoint code, so they name nothing it executes
        "auto_map",
        "cache_implementation",  # the generate() cache class (Gemma 2's "hybrid"): pdserve has its own pools
    }
)

# Fields each architecture reads (engine.loader._hf_config, engine.swa_config.hf_sliding_spec).
_LLAMA_CORE = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "partial_rotary_factor",
    }
)

# The Gemma block's fields (Gemma 2 and Gemma 3 text): hidden_activation, query_pre_attn_scalar, the
# soft caps, the sliding layers, and the attention bias / bidirectional flags refused when set
_GEMMA_CORE = _LLAMA_CORE | {
    "hidden_activation",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
    "layer_types",
    "attention_bias",
    "use_bidirectional_attention",
}
_QWEN_SLIDING = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})
IMPLEMENTED: dict[str, frozenset[str]] = {
    "llama": _LLAMA_CORE | {"attention_bias", "mlp_bias", "rope_interleaved"},
    "smollm": _LLAMA_CORE | {"attention_bias", "mlp_bias", "rope_interleaved"},
    "mistral": _LLAMA_CORE | {"sliding_window", "layer_types"},
    "ministral": _LLAMA_CORE | {"sliding_window", "layer_types"},
    "qwen2": _LLAMA_CORE | _QWEN_SLIDING | {"use_mrope"},
    "qwen3": _LLAMA_CORE | _QWEN_SLIDING | {"attention_bias"},
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj (split at load, engine.fused_checkpoint), one window
    # for every layer, partial rotary; attention_bias / mlp_bias are read by no transformers Phi-3
    # layer (served as False only, the bias tensors would be refused anyway)
    # Phi-4-mini configs also carry full_attn_mod, interpolate_factor and lm_head_bias (read by its
    # remote code only, not by transformers' Phi3): accepted at the values that change nothing
    "phi3": _LLAMA_CORE
    | {
        "original_max_position_embeddings",
        "sliding_window",
        "attention_bias",
        "mlp_bias",
        "full_attn_mod",
        "interpolate_factor",
        "lm_head_bias",
    },
    # Qwen3-MoE: Qwen3's attention (Q/K norms) and, on the sparse layers, the expert mixture of
    # engine.moe; num_local_experts is how transformers writes num_experts back. The router's
    # auxiliary loss (output_router_logits, router_aux_loss_coef) is training-only and changes no logit.
    # (sliding_window and max_window_layers are read by nothing while use_sliding_window is false)
    "qwen3_moe": _LLAMA_CORE
    | {
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "attention_bias",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "output_router_logits",
        "router_aux_loss_coef",
    },
    # Qwen2-MoE: Qwen2's attention (q/k/v biases: qkv_bias, served true only) and, on the sparse layers,
    # Qwen3-MoE's expert mixture plus a shared expert of shared_expert_intermediate_size gated by
    # sigmoid(shared_expert_gate(x)); sliding windows are not implemented (use_sliding_window false
    # only, layer_types all full_attention only: engine.swa_config.hf_sliding_spec)
    "qwen2_moe": _LLAMA_CORE
    | {
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "qkv_bias",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "output_router_logits",
        "router_aux_loss_coef",
    },
    # Mixtral: Llama attention, every layer's MLP a mixture of num_local_experts experts of
    # intermediate_size (engine.moe), top-k renormalized; router_jitter_noise acts in training only.
    # Its sliding_window (one for every layer) is not implemented: served only as null.
    "mixtral": _LLAMA_CORE
    | {
        "num_local_experts",
        "num_experts_per_tok",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "sliding_window",
    },
    # gpt-oss: attention with q/k/v/o biases and per-head sinks, alternating sliding layers, every
    # layer's MLP num_local_experts experts of intermediate_size behind a router with a bias (the top
    # num_experts_per_tok logits softmaxed), each a clamped SwiGLU (swiglu_alpha, swiglu_limit) with
    # biases (engine.moe.gpt_oss_mlp); hidden_act is read by no transformers gpt-oss layer (served
    # "silu" only). quantization_config (MXFP4 experts) is refused by check_hf_fields. openai's exports also
    # write experts_per_token and initial_context_length, which transformers' GptOssConfig reads into
    # nothing (num_experts_per_tok and the rope dict's original_max_position_embeddings are what compute):
    # accepted at any value, as transformers computes the same without them
    "gpt_oss": _LLAMA_CORE
    | {
        "sliding_window",
        "layer_types",
        "attention_bias",
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "swiglu_alpha",
        "swiglu_limit",
        "experts_per_token",
        "initial_context_length",
        "output_router_logits",
        "router_aux_loss_coef",
    },
    # Gemma 2 (engine/gemma3.py's model without Q/K norms): (1 + w) pre/post norms, GeGLU with tanh
    # GELU, embedding scale, query_pre_attn_scalar, attention and final logit soft-capping,
    # alternating sliding layers; hidden_act is what older exports wrote beside hidden_activation
    "gemma2": _GEMMA_CORE,
    # Gemma 3 text (Gemma3ForCausalLM): Gemma 2's block with Q/K RMSNorm, a sliding pattern (five
    # sliding layers to each full one by default), the local RoPE base rope_local_base_freq on the
    # sliding layers and rope_theta with rope_scaling (or the nested rope_parameters) on the full
    # ones (engine.hf_rope); soft caps default to none, and only the final one is applied
    "gemma3_text": _GEMMA_CORE | {"sliding_window_pattern", "_sliding_window_pattern", "rope_local_base_freq"},
}

# Architecture traits no config field switches, as transformers builds them: Qwen2 always has q/k/v
# biases (no o_proj bias), Qwen3 always has per-head Q/K RMSNorm; no other architecture reads either.
QKV_BIAS_ARCHS = frozenset({"qwen2", "qwen2_moe"})
QK_NORM_ARCHS = frozenset({"qwen3", "qwen3_moe", "gemma3_text"})
# Architectures whose sparse layers' MLP is a mixture of experts (engine.moe).
MOE_ARCHS = frozenset({"gpt_oss", "mixtral", "qwen2_moe", "qwen3_moe"})
# Architectures whose attention adds a learned sink logit per head (gpt-oss; engine.attention).
SINK_ARCHS = frozenset({"gpt_oss"})
# Checkpoints storing Q/K/V as one qkv_proj and gate/up as one gate_up_proj.
FUSED_PROJ_ARCHS = frozenset({"phi3"})
# Architectures served by the Gemma model (engine/gemma3.py) rather than the Llama one.
GEMMA_ARCHS = frozenset({"gemma2", "gemma3_text"})
# Architectures whose attention applies attn_logit_softcapping (Gemma 3's transformers attention does not).
ATTN_SOFTCAP_ARCHS = frozenset({"gemma2"})
# RoPE types an architecture's transformers config accepts, where fewer than all of
# engine.rope_scaling.ROPE_TYPES (Phi3Config also reads "su" and "yarn" as its longrope; Gemma 3's
# are those of its full layers, the sliding ones serve default only).
ARCH_ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "phi3": ("default", "longrope"),
    "gemma2": ("default",),
    "gemma3_text": ("default", "linear"),
}
# Architectures whose transformers attention rotates only the first partial_rotary_factor of each head.
PARTIAL_ROTARY_ARCHS = frozenset({"phi3"})


# Implemented fields that pdserve runs with these values only (the others change the computation
# in ways the model does not implement). attention_bias adds an o_proj bias too in transformers'
# Llama and Qwen3 (Qwen2's q/k/v biases are built in, without the o_proj one).
ALLOWED_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", "swish"),
    "mlp_bias": (False,),
    "attention_bias": (False,),
    "partial_rotary_factor": (1, 1.0),
    "rope_interleaved": (False,),
    "use_mrope": (False,),
    "full_attn_mod": (1,),  # every layer full attention (the remote code's period of full layers)
    "interpolate_factor": (1, 1.0),  # no position interpolation
    "lm_head_bias": (False,),
    "use_bidirectional_attention": (False,),  # Gemma 2 and 3 are causal; true is their encoder use
}
# Per-architecture values that replace :data:`ALLOWED_VALUES`' (Gemma 2's MLP is GeGLU with tanh GELU;
# the MoE models' sliding windows, one for every layer, are not implemented).
ARCH_ALLOWED_VALUES: dict[str, dict[str, tuple[Any, ...]]] = {
    "gemma2": {"hidden_act": ("gelu_pytorch_tanh",), "hidden_activation": ("gelu_pytorch_tanh",)},
    # transformers' Gemma 3 reads attn_logit_softcapping but never passes it to its attention (null
    # in every release): a value is refused rather than served either way
    "gemma3_text": {
        "hidden_act": ("gelu_pytorch_tanh",),
        "hidden_activation": ("gelu_pytorch_tanh",),
        "attn_logit_softcapping": (None,),
    },
    "qwen3_moe": {"use_sliding_window": (False,)},
    "qwen2_moe": {"use_sliding_window": (False,), "qkv_bias": (True,)},
    "mixtral": {"sliding_window": (None,)},
    "gpt_oss": {"attention_bias": (True,), "hidden_act": ("silu",)},
}


def restricted_fields(arch: str) -> dict[str, tuple[Any, ...]]:
    """:data:`ALLOWED_VALUES` for ``arch``: ``partial_rotary_factor`` is free where the architecture
    implements it (its value is checked by ``engine.hf_rope``)."""
    free = {"partial_rotary_factor"} if arch in PARTIAL_ROTARY_ARCHS else set()
    return {k: v for k, v in ALLOWED_VALUES.items() if k not in free} | ARCH_ALLOWED_VALUES.get(arch, {})


def allowed_text(key: str, arch: str = "") -> str:
    """The values of ``key`` pdserve serves for ``arch``, as the refusal names them: ``'silu' or 'swish'``."""
    return " or ".join(map(repr, restricted_fields(arch)[key]))


def check_hf_fields(cfg: dict, arch: str) -> None:
    """Refuse a ``config.json`` with a field that changes the computation and is not implemented
    for ``arch``: ``ValueError`` naming the field, its value and what is supported. ``null`` values
    set nothing and pass; ``arch`` must be a key of :data:`IMPLEMENTED`."""
    known, restricted = IMPLEMENTED[arch], restricted_fields(arch)
    _check_not_quantized(cfg, arch)
    for key in sorted(cfg):
        value = cfg[key]
        if value is None or key in HARMLESS:
            continue
        if key not in known:
            raise ValueError(
                f"config.json field {key}={_short(value)} is not implemented by pdserve for model type "
                f"{arch!r} (it may change the computation); pdserve implements: {', '.join(sorted(known))}"
            )
        if key in restricted and value not in restricted[key]:
            raise ValueError(
                f"config.json field {key}={_short(value)} is not implemented by pdserve for model type {arch!r}; "
                f"supported: {allowed_text(key, arch)}"
            )


def _check_not_quantized(cfg: dict, arch: str) -> None:
    """Refuse a checkpoint whose config.json declares a ``quantization_config`` (gpt-oss's MXFP4
    experts, GPTQ, AWQ, bitsandbytes ...): ``ValueError`` naming the field and its method."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
    raise ValueError(
        f"config.json field quantization_config={_short(quant)} is not implemented by pdserve for model type "
        f"{arch!r} (quantized weights, quant_method {method!r}): HF folders are served from unquantized "
        "bfloat16, float16 or float32 checkpoints only (dequantize it first, e.g. a bfloat16 export of the model)"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
