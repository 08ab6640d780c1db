"""The tensor names and shapes a Llama-family model needs (checked by the loaders)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.moe import expert_shapes

# Architectures with a norm before and after the MLP too (Gemma's four norms per layer).
_FOUR_NORM_ARCHS = ("gemma2", "gemma3", "gemma3_text")


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a model with ``config`` needs, mapped to its [out, in] shape."""
    c = config
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q_out, c.hidden_size),
                p + "self_attn.k_proj.weight": (kv_out, c.hidden_size),
                p + "self_attn.v_proj.weight": (kv_out, c.hidden_size),
                p + "self_attn.o_proj.weight": (c.hidden_size, q_out),
                p + "input_layernorm.weight": (c.hidden_size,),
                p + "post_attention_layernorm.weight": (c.hidden_size,),
            }
        )
        if c.moe is not None and i in c.moe.sparse_layers:
            shapes.update(expert_shapes(c.hidden_size, c.moe, p + "mlp."))
        else:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                    p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                    p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                }
            )
        if c.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q_out,),
                    p + "self_attn.k_proj.bias": (kv_out,),
                    p + "self_attn.v_proj.bias": (kv_out,),
                }
            )
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        if c.attention_sinks:
            shapes[p + "self_attn.sinks"] = (c.num_heads,)
        if c.arch in _FOUR_NORM_ARCHS:
            shapes.update(
                {p + "pre_feedforward_layernorm.weight": (c.hidden_size,)}
                | {p + "post_feedforward_layernorm.weight": (c.hidden_size,)}
            )
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
    return shapes
