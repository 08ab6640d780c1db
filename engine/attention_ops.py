"""Attention arithmetic of the torch backend (``engine.attention``): prefill SDPA with grouped KV
heads, the causal / sliding-window mask of an extend chunk, and soft-capped attention, which
``scaled_dot_product_attention`` cannot compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def capped_attention(q, k, v, scale: float, cap: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``[..., H, E, D]`` queries over ``[..., Hkv, S, D]`` keys/values (H a multiple of
    Hkv) with soft-capped scores, as transformers' eager Gemma 2: ``s = cap * tanh(q.k * scale / cap)``,
    then the boolean ``mask`` (broadcast to ``[..., H, E, S]``, True = visible; every query sees a
    key), then a float32 softmax. Returns ``[..., H, E, D]`` in ``q``'s dtype."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / cap) * cap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


def sink_attention(q, k, v, scale: float, sinks: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``[..., H, E, D]`` queries over ``[..., Hkv, S, D]`` keys/values with a learned sink
    logit per head, as transformers' eager gpt-oss: the scores ``q.k * scale``, masked by the boolean
    ``mask`` (broadcast to ``[..., H, E, S]``, True = visible), get ``sinks[h]`` (``[H]``) as one more
    logit in each row's float32 softmax, whose probability is then dropped (the sink attends to no
    value: the row's weights sum below 1). Returns ``[..., H, E, D]`` in ``q``'s dtype."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = (torch.matmul(q, k.transpose(-1, -2)) * scale).float()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(*s.shape[:-1], 1)
    logits = torch.cat((s, sink), dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def sdpa_4d(q, k, v, scale: float, is_causal: bool = False, mask=None) -> torch.Tensor:
    """Prefill attention ``[H, E, D]`` x ``[Hkv, S, D]``. KV heads are repeated and a batch dim added:
    that takes torch's flash CPU kernel (several times faster than ``enable_gqa`` on 3-D inputs at
    prompt lengths); decode keeps ``enable_gqa``, which is faster for one query token."""
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=is_causal, scale=scale)[
        0
    ]


def extend_mask(prefix: int, ext: int, key_start: int, seq: int, window: int | None, device) -> torch.Tensor:
    """[ext, seq - key_start] bool: the query at absolute position prefix+i sees keys
    ``key_start + j <= prefix + i`` (and inside the window)."""
    qpos = torch.arange(prefix, prefix + ext, device=device).unsqueeze(1)
    kpos = torch.arange(key_start, seq, device=device).unsqueeze(0)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask
