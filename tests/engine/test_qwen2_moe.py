"""Qwen2-MoE's config contract: its MoE settings read with Qwen2MoeConfig's defaults, and every field
value it does not implement (sliding windows, no q/k/v biases, a bad sparse step) refused at load naming
the field, its value and what is supported, before any weight is read; a checkpoint without the shared
expert's tensors is refused."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.loader import load_model_weights, read_model_config
from engine.moe import hf_moe_spec
from tests.support.hf_folders import QWEN2_MOE, save_small_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A small random Qwen2-MoE saved by transformers (config.json edited per test on a copy)."""
    out = tmp_path_factory.mktemp("qwen2_moe")
    save_small_model("qwen2_moe", out, **QWEN2_MOE)
    return out


def _edited(folder, tmp_path, **fields):
    """A copy of ``folder`` with ``fields`` set in config.json."""
    dst = tmp_path / "edited"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | fields))
    return dst


def test_the_saved_folder_reads_its_moe_settings(folder):
    cfg = read_model_config(folder)
    spec = cfg.moe
    assert (cfg.arch, cfg.attention_bias, cfg.qk_norm, cfg.sliding_window) == ("qwen2_moe", True, False, None)
    assert (spec.num_experts, spec.top_k, spec.expert_size, spec.shared_expert_size) == (8, 2, 32, 48)
    assert (spec.sparse_layers, spec.norm_topk_prob) == ((1,), False)
    assert set(cfg.layer_types) == {"full_attention"}


def test_defaults_are_qwen2_moe_configs():
    spec = hf_moe_spec({"intermediate_size": 96}, 3, "qwen2_moe")
    assert (spec.num_experts, spec.top_k, spec.expert_size, spec.shared_expert_size) == (60, 4, 1408, 5632)
    assert (spec.norm_topk_prob, spec.sparse_layers) == (False, (0, 1, 2))
    assert hf_moe_spec({"num_experts": 0}, 3, "qwen2_moe") is None  # every layer dense
    assert hf_moe_spec({}, 3, "qwen3_moe").shared_expert_size == 0  # Qwen3-MoE has none


REFUSED = [
    ("use_sliding_window", True, r"use_sliding_window=True is not implemented.*'qwen2_moe'; supported: False"),
    ("qkv_bias", False, r"qkv_bias=False is not implemented.*'qwen2_moe'; supported: True"),
    (
        "layer_types",
        ["full_attention", "sliding_attention", "full_attention", "full_attention"],
        r"layer_types=\['full_attention', 'sliding_attention'.*'qwen2_moe'; supported: every layer 'full_attention'",
    ),
    ("decoder_sparse_step", 0, r"decoder_sparse_step=0 must be at least 1"),
    ("norm_topk_prob", "yes", r"norm_topk_prob='yes' must be true or false"),
    ("hidden_act", "gelu", r"hidden_act='gelu'.*supported: 'silu' or 'swish'"),
    ("attention_bias", True, r"attention_bias=True is not implemented by pdserve for model type 'qwen2_moe'"),
    ("router_jitter_noise", 0.1, r"router_jitter_noise=0.1 is not implemented.*'qwen2_moe'"),
]


@pytest.mark.parametrize("field, value, message", REFUSED, ids=[r[0] for r in REFUSED])
def test_an_unimplemented_value_is_refused_naming_it(folder, tmp_path, field, value, message):
    edited = _edited(folder, tmp_path, **{field: value})
    with pytest.raises(ValueError, match=message):
        read_model_config(edited)
    with pytest.raises(ValueError, match=message):  # before any weight is read
        load_model_weights(edited)


def test_a_checkpoint_without_the_shared_expert_is_refused(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    edited = _edited(folder, tmp_path)
    shard = edited / "model.safetensors"
    tensors = load_file(str(shard))
    del tensors["model.layers.1.mlp.shared_expert_gate.weight"]
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.shared_expert_gate.weight'"):
        load_model_weights(edited)
