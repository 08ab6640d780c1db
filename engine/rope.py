"""Rotary position embedding (HF rotate_half convention; GGUF Q/K rows are de-interleaved at load).

Partial rotary (transformers' ``partial_rotary_factor``: only the first ``rotary_dim`` dims of each
head rotate, as pairs ``(i, i + rotary_dim / 2)``) runs on the same full-width kernels: the model
computes Q and K with each head's dims in :func:`rotary_order` (its Q/K projection rows permuted at
load), which puts every rotary pair at ``(j, j + head_dim / 2)``, and the tables hold cos 1, sin 0 at
the pass-through dims, which the rotation then leaves bit for bit. Attention scores are dot products
over a head's dims, so the same order on Q and K changes none of them; the KV cache holds K in that
order (the same on every worker of a model).
"""

from __future__ import annotations

import torch

from engine.kernels import fused
from engine.rope_scaling import RopeScaling, scaled_inv_freq


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """int64 ``[head_dim]``: position ``j`` of a head as pdserve computes it holds transformers' dim
    ``order[j]``. First half: rotary dims ``0 .. r/2``, then pass dims ``r .. r + p``; second half:
    rotary dims ``r/2 .. r``, then pass dims ``r + p .. head_dim`` (``r = rotary_dim``,
    ``p = (head_dim - r) / 2``). The identity when ``rotary_dim == head_dim``."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    parts = [(0, r), (rotary_dim, rotary_dim + p), (r, rotary_dim), (rotary_dim + p, head_dim)]
    return torch.cat([torch.arange(a, b) for a, b in parts])


def permute_heads(w: torch.Tensor, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    """Rows of a Q/K projection weight ``[heads * head_dim, in]`` (or bias / norm weight) reordered
    within each head by ``order`` (:func:`rotary_order`)."""
    rest = w.shape[1:]
    return w.reshape(-1, head_dim, *rest)[:, order].reshape(w.shape).contiguous()


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[max_positions, head_dim]`` in float32, the one input of every
    rotary path. ``scaling`` (``engine.rope_scaling``) changes only how the tables are built: its
    inverse frequencies, and cos and sin multiplied by its ``attention_factor``. ``rotary_dim <
    head_dim``: the tables are in :func:`rotary_order` with cos 1, sin 0 at the pass-through dims."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        device,
        scaling: RopeScaling | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        rot = rotary_dim or head_dim
        factor = 1.0
        if scaling is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
        else:
            inv32, factor = scaled_inv_freq(scaling, rot, theta, max_positions)
            inv_freq = inv32.to(torch.float64)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        passes = (head_dim - rot) // 2
        cos_half = torch.cat([freqs.cos() * factor, torch.ones(max_positions, passes, dtype=torch.float64)], dim=-1)
        sin_half = torch.cat([freqs.sin() * factor, torch.zeros(max_positions, passes, dtype=torch.float64)], dim=-1)
        self.cos = torch.cat([cos_half, cos_half], dim=-1).to(torch.float32).to(device)
        self.sin = torch.cat([sin_half, sin_half], dim=-1).to(torch.float32).to(device)
        self._checked: torch.Tensor | None = None  # the positions last range-checked (every layer reuses them)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[tokens, heads, head_dim]`` by ``positions`` ``[tokens]``; on the CPU kernel
        path in place (``engine.kernels.fused.rope``), so callers pass tensors they own."""
        out = fused.rope(x, positions, self.cos, self.sin, check=positions is not self._checked)
        self._checked = positions  # reached only if the check passed (or the torch path ran)
        return out
