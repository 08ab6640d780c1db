"""Llama-family decoder (Llama, Mistral, Qwen2/3, SmolLM, Phi-3, the MoE models, gpt-oss) over a paged KV cache.

Weights come in HF naming from ``engine.loader``; Q/K/V and gate/up projections are fused at load
time so each layer runs three matmuls for attention projections fewer, and every matmul weight is
prepared for its device (``engine.cpu_linear``: oneDNN-packed on CPU float32). The forward pass returns
logits only for each request's last new token (what sampling needs), and for the prompt tokens a
batch names in ``extra_logit_rows`` (prompt logprobs).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.cpu_linear import int8_supported, linear, warm_up
from engine.cpu_linear import pack as pack_weight
from engine.decode_stack import DecodeStack
from engine.forward_batch import ForwardBatch
from engine.kernels import fused
from engine.moe import gpt_oss_mlp, load_experts, load_gpt_oss_experts, moe_mlp, shared_expert
from engine.rope import RotaryEmbedding, permute_heads, rotary_order


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x``'s last dim times ``weight`` (fused kernel on CPU, torch elsewhere)."""
    return fused.rms_norm(x, weight, eps)


def checkpoint_getter(state: Mapping[str, torch.Tensor], device, dtype):
    """``get(name)``: tensor ``name`` of ``state`` on ``device`` in ``dtype``; ``ValueError`` if absent.
    One lookup of ``state`` per call and one conversion of that tensor alone: with the loader's
    ``CheckpointTensors`` (read on access, stored dtype) a load holds one checkpoint tensor at a time,
    and a bfloat16 one served in bfloat16 is never widened."""

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return state[name].to(device=device, dtype=dtype)

    return get


class DecoderLayer(nn.Module):
    """One transformer block; parameters are plain tensors set by ``LlamaModel.load_weights``."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.sparse = cfg.moe is not None and layer_id in cfg.moe.sparse_layers  # MLP: engine.moe's experts
        self.w: dict[str, torch.Tensor] = {}

    def forward(self, h: torch.Tensor, batch: ForwardBatch, rope: RotaryEmbedding, attn) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        x = rms_norm(h, w["input_norm"], cfg.rms_norm_eps)
        qkv = linear(x, w["qkv"], w.get("qkv_bias"))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
        q = rope.apply(q, batch.positions)
        k = rope.apply(k, batch.positions)
        if "sinks" in w:
            o = attn.forward(q, k, v, self.layer_id, batch, sinks=w["sinks"])
        else:
            o = attn.forward(q, k, v, self.layer_id, batch)
        h, x = fused.add_rms_norm(h, linear(o, w["o"], w.get("o_bias")), w["post_norm"], cfg.rms_norm_eps)
        if self.sparse and cfg.moe.swiglu is not None:
            return h + gpt_oss_mlp(x, w, cfg.moe)
        if self.sparse:
            out = moe_mlp(x, w, cfg.moe)
            return h + (out + shared_expert(x, w, linear) if "shared_down" in w else out)
        return h + linear(fused.silu_mul(linear(x, w["gate_up"])), w["down"])


class LlamaModel(nn.Module):
    """Decoder stack + tied/untied LM head. ``forward`` needs an attention backend per call."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, int8: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.int8 = int8  # weight-only int8 matmul weights, LM head included (engine.cpu_linear)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, device, cfg.rope_scaling, cfg.rotary_dim
        )
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.stack: DecodeStack | None = None  # small decode steps' layers in one C call (set at load)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take HF-named float tensors (``engine.loader``'s mapping); fuse, cast and move them one
        tensor or one fused group at a time (``checkpoint_getter``). Raises on a missing tensor."""
        get = checkpoint_getter(state, self.device, self.dtype)
        pack = functools.partial(pack_weight, int8=self.int8)
        cfg = self.cfg
        order = rotary_order(cfg.head_dim, cfg.rotary_dim) if cfg.rotary_dim < cfg.head_dim else None

        def get_qk(name: str) -> torch.Tensor:
            """Q/K rows (weights, biases, norm weights) in the head order of ``self.rope``'s tables."""
            t = get(name)
            return t if order is None else permute_heads(t, cfg.head_dim, order.to(t.device))

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        tied = self.cfg.tie_word_embeddings or "lm_head.weight" not in state
        head = self.embed if tied else get("lm_head.weight")
        # a vocabulary the int8 kernel cannot block (not a multiple of 8 rows) keeps a bfloat16 head
        self.lm_head = pack_weight(head, int8=self.int8 and int8_supported(head) is None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            w = {
                "qkv": pack(
                    torch.cat([get_qk(a + "q_proj.weight"), get_qk(a + "k_proj.weight"), get(a + "v_proj.weight")])
                ),
                "o": pack(get(a + "o_proj.weight")),
                "input_norm": get(p + "input_layernorm.weight"),
                "post_norm": get(p + "post_attention_layernorm.weight"),
            }
            if layer.sparse and cfg.moe.swiglu is not None:
                w.update(load_gpt_oss_experts(get, p + "mlp."))
            elif layer.sparse:
                w.update(load_experts(get, p + "mlp.", cfg.moe, int8=self.int8))
                if cfg.moe.shared_expert_size:
                    s = p + "mlp.shared_expert."
                    w["shared_gate_up"] = pack(torch.cat([get(s + "gate_proj.weight"), get(s + "up_proj.weight")]))
                    w["shared_down"] = pack(get(s + "down_proj.weight"))
                    w["shared_gate"] = get(p + "mlp.shared_expert_gate.weight")
            else:
                w["gate_up"] = pack(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
                w["down"] = pack(get(p + "mlp.down_proj.weight"))
            if a + "q_proj.bias" in state:
                w["qkv_bias"] = torch.cat(
                    [get_qk(a + "q_proj.bias"), get_qk(a + "k_proj.bias"), get(a + "v_proj.bias")]
                )
            if cfg.o_bias:
                w["o_bias"] = get(a + "o_proj.bias")
            if cfg.attention_sinks:
                w["sinks"] = checkpoint_getter(state, self.device, torch.float32)(a + "sinks")  # float32 softmax
            if self.cfg.qk_norm:
                w["q_norm"], w["k_norm"] = get_qk(a + "q_norm.weight"), get_qk(a + "k_norm.weight")
            layer.w = w
        self.warm_up()
        self.stack = DecodeStack.build(self)

    def linear_weights(self) -> list[tuple]:
        """Every packed layer matmul's ``(weight, bias)``, in forward order (the LM head and the MoE
        layers' router and experts, plain tensors, apart)."""
        names = ("qkv", "o", "gate_up", "down", "shared_gate_up", "shared_down")
        return [(layer.w[n], layer.w.get(n + "_bias")) for layer in self.layers for n in names if n in layer.w]

    def warm_up(self) -> None:
        """Build the packed matmuls' kernels for the current torch thread count (``cpu_linear.warm_up``)."""
        warm_up(self.linear_weights())
        # the LM head sees one row per request of a step: warmed up to the default decode batch cap
        # (64); larger steps build their primitives when they first occur
        warm_up([(self.lm_head, None)], max_rows=64)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn) -> torch.Tensor:
        """Run all new tokens of ``batch``; return float32 logits ``[batch_size + extra rows, vocab]``
        (``ForwardBatch.logit_indices``)."""
        attn.prepare(batch)
        h = F.embedding(batch.input_ids, self.embed)
        if self.stack is not None and self.stack.takes(batch, attn):
            h = self.stack.run(h, batch, attn)
        else:
            for layer in self.layers:
                h = layer(h, batch, self.rope, attn)
        h = h[batch.logit_indices()]
        h = rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        return linear(h, self.lm_head).float()
