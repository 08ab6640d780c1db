"""Checkpoints that store Q/K/V as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (Phi-3).

The loader splits them into the Llama names every model reads (``q_proj``, ``k_proj``, ``v_proj``,
``gate_proj``, ``up_proj``); the model fuses them again in the same order (``engine.model``), so the
torch path, the C decode stack and the Triton path all see the layout they already run.
transformers' Phi-3 splits ``qkv_proj``'s rows as ``[q | k | v]`` and ``gate_up_proj``'s as
``[gate | up]`` (``chunk(2)``): the same order.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig

_QKV = ".self_attn.qkv_proj.weight"
_GATE_UP = ".mlp.gate_up_proj.weight"


def unfused_names(names: set[str]) -> set[str]:
    """``names`` with each fused tensor name replaced by the names it splits into."""
    out = set()
    for n in names:
        if n.endswith(_QKV):
            p = n.removesuffix(_QKV)
            out |= {f"{p}.self_attn.{x}_proj.weight" for x in "qkv"}
        elif n.endswith(_GATE_UP):
            p = n.removesuffix(_GATE_UP)
            out |= {f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"}
        else:
            out.add(n)
    return out


def split_fused(tensors: dict, config: ModelConfig) -> dict:
    """``tensors`` with every fused projection split into its parts by its rows (``t.split(sizes)``:
    views of a torch tensor, byte ranges of an ``engine.checkpoint_tensors.StoredTensor``, which
    reads nothing). ``ValueError`` names a fused tensor whose row count is not the parts' sum."""
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(_QKV):
            p = name.removesuffix(_QKV)
            parts, sizes = [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"], [q_out, kv_out, kv_out]
        elif name.endswith(_GATE_UP):
            p = name.removesuffix(_GATE_UP)
            parts, sizes = [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"], [inter, inter]
        else:
            out[name] = t
            continue
        if t.shape[0] != sum(sizes):
            raise ValueError(f"tensor {name!r} has {t.shape[0]} rows, expected {' + '.join(map(str, sizes))}")
        out.update(zip(parts, t.split(sizes)))
    return out
