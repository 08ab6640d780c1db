"""Gemma 2 and Gemma 3 text decoders (e.g. Gemma 3 270M) over the paged KV cache.

What differs from ``engine.model.LlamaModel``:
- RMSNorm scales by ``1 + weight`` (weights are stored HF-style, i.e. without the 1);
- four norms per layer: before and after attention, before and after the MLP (the "after" norms
  apply to the branch output, before the residual add), plus RMSNorm on each head of q and k;
- GeGLU MLP with tanh-approximated GELU;
- embeddings multiplied by ``sqrt(hidden_size)``;
- attention scale ``query_pre_attn_scalar ** -0.5`` (the runner passes it to the backend);
- sliding layers rotate with ``rope_local_theta`` (plain RoPE), full layers with ``rope_theta`` and
  ``rope_scaling`` (Gemma 3 4B and larger: linear, factor 8).
Per-layer windows reach the attention backend through ``layer_types`` / ``sliding_window``.
Gemma 2 is the same block without the Q/K norms (``qk_norm`` False), one RoPE base for every layer,
attention logits soft-capped (``attn_logit_softcapping``: the runner passes it to the backend) and
the final logits soft-capped (``cap * tanh(logits / cap)``, ``final_logit_softcapping``).

On CPU the norms (float32 ``1 + weight`` scales kept at load, ``norm_scale``) and the GELU-tanh MLP run
the fused kernels (``engine.kernels.fused``; their torch references elsewhere), and a small decode step
runs all layers in one C call where ``engine.decode_stack`` takes it: the same kernels in the same order,
bitwise the layer path's output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.cpu_linear import linear, warm_up
from engine.cpu_linear import pack as pack_weight
from engine.decode_stack import DecodeStack
from engine.forward_batch import ForwardBatch
from engine.kernels import fused
from engine.model import checkpoint_getter
from engine.rope import RotaryEmbedding

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """``ModelConfig`` plus the Gemma specifics. ``arch`` is ``"gemma3"`` (GGUF), ``"gemma3_text"`` (HF
    folder) or ``"gemma2"``; a soft cap of ``None`` is no cap; ``rope_scaling`` applies to the full
    layers only."""

    query_pre_attn_scalar: float = 256.0
    rope_local_theta: float = 10000.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * (1 + weight)`` computed in float32, returned in ``x.dtype`` (as HF Gemma 3): the
    reference of what the model runs (``norm_scale`` and ``fused.rms_norm_f32w``)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def norm_scale(weight: torch.Tensor) -> torch.Tensor:
    """The float32 ``1 + weight`` a Gemma norm multiplies by (exactly the factor ``gemma_rms_norm``
    computes; bfloat16 could not hold it), contiguous: what ``fused.rms_norm_f32w`` and the C decode
    stack read."""
    return (1.0 + weight.float()).contiguous()


class Gemma3Layer(nn.Module):
    """One Gemma 3 block; ``w`` holds its tensors (set by ``Gemma3Model.load_weights``)."""

    def __init__(self, cfg: Gemma3Config, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.sliding = cfg.layer_types[layer_id] == "sliding_attention"
        self.sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        self.w: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}  # each norm's float32 1 + weight (``norm_scale``)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, rope: RotaryEmbedding, attn) -> torch.Tensor:
        """The block on rows ``h``; its norms and GELU by the fused kernels (``engine.kernels.fused``, the
        references on other devices), which the C decode stack runs in the same order."""
        cfg, w, s, eps = self.cfg, self.w, self.scales, self.cfg.rms_norm_eps
        x = fused.rms_norm_f32w(h, s["input_layernorm"], eps)
        q, k, v = linear(x, w["qkv"]).split(self.sizes, dim=-1)
        q, k = q.view(-1, cfg.num_heads, cfg.head_dim), k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = fused.rms_norm_f32w(q, s["q_norm"], eps), fused.rms_norm_f32w(k, s["k_norm"], eps)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope.apply(q, batch.positions), rope.apply(k, batch.positions)
        o = linear(attn.forward(q, k, v, self.layer_id, batch), w["o"])
        h = h + fused.rms_norm_f32w(o, s["post_attention_layernorm"], eps)
        x = fused.rms_norm_f32w(h, s["pre_feedforward_layernorm"], eps)
        x = linear(fused.gelu_tanh_mul(linear(x, w["gate_up"])), w["down"])
        return h + fused.rms_norm_f32w(x, s["post_feedforward_layernorm"], eps)


class Gemma3Model(nn.Module):
    """Gemma 2 / Gemma 3 decoder stack with tied LM head; same ``load_weights`` / ``forward`` contract as
    ``LlamaModel`` (HF-named float tensors in, float32 logits of each last new token out)."""

    def __init__(self, cfg: Gemma3Config, device: torch.device, dtype: torch.dtype, int8: bool = False) -> None:
        super().__init__()
        if not isinstance(cfg, Gemma3Config):
            raise TypeError(f"Gemma3Model needs a Gemma3Config, got {type(cfg).__name__}")
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.int8 = int8  # weight-only int8 layer matmuls (the 262k-row LM head stays plain)
        self.layers = nn.ModuleList(Gemma3Layer(cfg, i) for i in range(cfg.num_layers))
        n = cfg.max_position_embeddings
        self.rope_global = RotaryEmbedding(cfg.head_dim, n, cfg.rope_theta, device, cfg.rope_scaling)
        self.rope_local = RotaryEmbedding(cfg.head_dim, n, cfg.rope_local_theta, device)
        self.embed_scale = cfg.hidden_size**0.5
        self.embed: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.norm_scale: torch.Tensor | None = None  # the final norm's float32 1 + weight
        self.stack: DecodeStack | None = None  # small decode steps' layers in one C call (set at load)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Take HF Gemma names; fuse q/k/v and gate/up, cast and move. Raises on a missing tensor."""
        get = checkpoint_getter(state, self.device, self.dtype)
        pack = functools.partial(pack_weight, int8=self.int8)

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if self.cfg.tie_word_embeddings else get("lm_head.weight")
        self.norm = get("model.norm.weight")
        for i, layer in enumerate(self.layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            w = {n: get(p + n + ".weight") for n in _NORMS}
            # matmul weights prepared for the device (engine.cpu_linear); the 262k-row LM head (the
            # embedding) stays plain: a packed copy would double its 670 MB
            w["qkv"] = pack(torch.cat([get(a + "q_proj.weight"), get(a + "k_proj.weight"), get(a + "v_proj.weight")]))
            w["o"] = pack(get(a + "o_proj.weight"))
            if self.cfg.qk_norm:
                w["q_norm"], w["k_norm"] = get(a + "q_norm.weight"), get(a + "k_norm.weight")
            w["gate_up"] = pack(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
            w["down"] = pack(get(p + "mlp.down_proj.weight"))
            layer.w = w
            layer.scales = {n: norm_scale(w[n]) for n in (*_NORMS, "q_norm", "k_norm") if n in w}
        self.norm_scale = norm_scale(self.norm)
        self.warm_up()
        self.stack = DecodeStack.build(self)

    def rope_of(self, layer: Gemma3Layer) -> RotaryEmbedding:
        """The rotary tables ``layer`` rotates with: the local base for sliding layers."""
        return self.rope_local if layer.sliding else self.rope_global

    def linear_weights(self) -> list[tuple]:
        """Every layer matmul's ``(weight, None)``, in forward order (the LM head apart)."""
        return [(layer.w[n], None) for layer in self.layers for n in ("qkv", "o", "gate_up", "down")]

    def warm_up(self) -> None:
        """Build the packed matmuls' kernels for the current torch thread count (``cpu_linear.warm_up``)."""
        warm_up(self.linear_weights())

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn) -> torch.Tensor:
        """Run all new tokens of ``batch``; return float32 logits ``[batch_size, vocab]``."""
        attn.prepare(batch)
        scale = torch.tensor(self.embed_scale, dtype=self.dtype)
        h = F.embedding(batch.input_ids, self.embed) * scale.to(self.device)
        if self.stack is not None and self.stack.takes(batch, attn):
            h = self.stack.run(h, batch, attn)
        else:
            for layer in self.layers:
                h = layer(h, batch, self.rope_of(layer), attn)
        h = fused.rms_norm_f32w(h[batch.logit_indices()], self.norm_scale, self.cfg.rms_norm_eps)
        logits = F.linear(h, self.lm_head).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
