"""Rotary position embedding (HF rotate_half convention; GGUF Q/K rows are de-interleaved at load)."""

from __future__ import annotations

import torch

from engine.kernels import fused


class RotaryEmbedding:
    """Precomputed cos/sin tables ``[max_positions, head_dim]`` in float32."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, device) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(torch.float32).to(device)
        self.sin = emb.sin().to(torch.float32).to(device)
        self._checked: torch.Tensor | None = None  # the positions last range-checked (every layer reuses them)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[tokens, heads, head_dim]`` by ``positions`` ``[tokens]``; on the CPU kernel
        path in place (``engine.kernels.fused.rope``), so callers pass tensors they own."""
        out = fused.rope(x, positions, self.cos, self.sin, check=positions is not self._checked)
        self._checked = positions  # reached only if the check passed (or the torch path ran)
        return out
