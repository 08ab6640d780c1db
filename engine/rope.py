"""Rotary position embedding (HF rotate_half convention; GGUF Q/K rows are de-interleaved at load)."""

from __future__ import annotations

import torch

from engine.kernels import fused
from engine.rope_scaling import RopeScaling, scaled_inv_freq


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[max_positions, head_dim]`` in float32, the one input of every
    rotary path. ``scaling`` (``engine.rope_scaling``) changes only how the tables are built: its
    inverse frequencies, and cos and sin multiplied by its ``attention_factor``."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, device, scaling: RopeScaling | None = None
    ) -> None:
        factor = 1.0
        if scaling is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        else:
            inv32, factor = scaled_inv_freq(scaling, head_dim, theta, max_positions)
            inv_freq = inv32.to(torch.float64)
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * factor).to(torch.float32).to(device)
        self.sin = (emb.sin() * factor).to(torch.float32).to(device)
        self._checked: torch.Tensor | None = None  # the positions last range-checked (every layer reuses them)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[tokens, heads, head_dim]`` by ``positions`` ``[tokens]``; on the CPU kernel
        path in place (``engine.kernels.fused.rope``), so callers pass tensors they own."""
        out = fused.rope(x, positions, self.cos, self.sin, check=positions is not self._checked)
        self._checked = positions  # reached only if the check passed (or the torch path ran)
        return out
