"""Partial rotary (Phi-4-mini's ``partial_rotary_factor``): pdserve's rotary paths (the C kernel and
the torch reference, on Q/K in :func:`engine.rope.rotary_order`) give transformers' Phi-3 rotation of
the first ``rotary_dim`` dims of each head and leave the others bit for bit, and the C decode stack
takes a partial-rotary model (its greedy tokens: tests/engine/test_hf_architectures.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_native, fused
from engine.rope import RotaryEmbedding, permute_heads, rotary_order
from tests.support.cpu_kernels import needs_small_batch_kernels

pytestmark = pytest.mark.unit


def _hf_rotate(x: torch.Tensor, positions: torch.Tensor, head_dim: int, factor: float, longrope: bool):
    """transformers' Phi-3 rotation of ``x`` ``[tokens, heads, head_dim]`` (natural dim order)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    heads = x.shape[1]
    rot = int(head_dim * factor)
    rope = {"rope_type": "default", "rope_theta": 1e4}
    if longrope:
        short = [1.0 + 0.5 * i for i in range(rot // 2)]
        rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short, "long_factor": short}
    cfg = Phi3Config(
        hidden_size=head_dim * heads,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        original_max_position_embeddings=128,
        partial_rotary_factor=factor,
        rope_parameters=rope,
        pad_token_id=0,
        vocab_size=8,
    )
    cos, sin = Phi3RotaryEmbedding(cfg)(x, positions[None])
    q = x.transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
    out, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return out[0].transpose(0, 1), cfg


def test_rotary_order_pairs_rotary_dims_across_the_halves():
    order = rotary_order(16, 12).tolist()
    assert order == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    assert sorted(order) == list(range(16)) and rotary_order(16, 16).tolist() == list(range(16))
    w = torch.arange(32.0).reshape(32, 1)  # two heads of 16 rows
    assert permute_heads(w, 16, rotary_order(16, 12))[16:, 0].tolist() == [16 + i for i in order]


@pytest.mark.parametrize("head_dim,factor", [(16, 0.75), (128, 0.75), (32, 0.5)])
@pytest.mark.parametrize("longrope", [False, True], ids=["default", "longrope"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_rotation_equals_transformers_phi3(head_dim, factor, longrope, path):
    if path == "kernel" and cpu_native.load() is None:
        pytest.skip("no C kernel library here")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, head_dim, generator=g)
    positions = torch.tensor([0, 1, 5, 17, 64, 100, 127])
    ref, cfg = _hf_rotate(x, positions, head_dim, factor, longrope)
    from engine.hf_rope import hf_rope

    _, scaling, rot = hf_rope(cfg.to_dict(), "phi3")
    assert rot == int(head_dim * factor)
    rope = RotaryEmbedding(head_dim, 512, 1e4, "cpu", scaling, rot)
    order = rotary_order(head_dim, rot)
    mine = x[..., order].contiguous()
    if path == "kernel":
        got = fused.rope(mine, positions, rope.cos, rope.sin)
    else:
        got = fused.rope_ref(mine, positions, rope.cos, rope.sin)
    torch.testing.assert_close(got, ref[..., order], rtol=1e-5, atol=1e-5)
    # the pass-through dims come back bit for bit
    passes = [j for j, d in enumerate(order.tolist()) if d >= rot]
    assert torch.equal(got[..., passes], x[..., order][..., passes])


@needs_small_batch_kernels
def test_decode_stack_takes_a_partial_rotary_model(tmp_path):
    from engine.loader import load_model_weights
    from engine.model import LlamaModel
    from tests.support.hf_folders import PHI3_PARTIAL, save_small_model

    save_small_model("phi3", tmp_path, **PHI3_PARTIAL)
    cfg, weights = load_model_weights(tmp_path)
    model = LlamaModel(cfg, torch.device("cpu"), torch.float32)
    model.load_weights(weights)
    assert cfg.rotary_dim == 12 and model.stack is not None
