"""Phi-3 / Phi-4-mini folders load as transformers' Phi3Config reads them (rope types, Phi-3's
top-level original_max_position_embeddings, partial rotary, one window for every layer, fused
projections split by rows) and what pdserve does not implement is refused naming it."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.loader import check_startup, load_model_weights, read_model_config
from tests.support.hf_folders import (
    PHI3_LONGROPE,
    PHI3_PARTIAL,
    engine_greedy,
    random_prompts,
    reference_greedy,
    save_small_model,
)
from tests.support.models import engine_cfg

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def phi3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi3")
    save_small_model("phi3", folder, **PHI3_LONGROPE)
    return folder


def _edited(src, tmp_path, name: str = "edited", **fields):
    """A copy of ``src`` named ``name`` with ``fields`` set in config.json (a value ``...`` deletes it)."""
    dst = tmp_path / name
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in fields.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_reads_partial_rotary_longrope_and_the_top_level_original_length(phi3_folder, tmp_path):
    cfg = read_model_config(phi3_folder)
    assert (cfg.arch, cfg.head_dim, cfg.rotary_dim, cfg.sliding_window) == ("phi3", 16, 12, None)
    assert cfg.rope_scaling.rope_type == "longrope" and len(cfg.rope_scaling.short_factor) == 6
    assert cfg.rope_scaling.original_max_position_embeddings == 128
    # Phi3Config: the top-level original_max_position_embeddings wins over the dict's
    rope = json.loads((phi3_folder / "config.json").read_text())["rope_parameters"]
    folder = _edited(phi3_folder, tmp_path, rope_parameters={**rope, "original_max_position_embeddings": 256})
    assert read_model_config(folder).rope_scaling.original_max_position_embeddings == 128


def test_legacy_su_rope_scaling_is_longrope(phi3_folder, tmp_path):
    rope = json.loads((phi3_folder / "config.json").read_text())["rope_parameters"]
    legacy = {"type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    folder = _edited(phi3_folder, tmp_path, rope_parameters=..., rope_scaling=legacy)
    assert read_model_config(folder).rope_scaling.rope_type == "longrope"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"partial_rotary_factor": 0.7, "rope_parameters": ...}, r"partial_rotary_factor=0.7 gives 11 rotary dims"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, r"'linear' is not valid for model type 'phi3'"),
        ({"lm_head_bias": True}, r"lm_head_bias=True is not implemented.*'phi3'; supported: False"),
        ({"full_attn_mod": 4}, r"full_attn_mod=4 is not implemented.*supported: 1"),
        ({"interpolate_factor": 2}, r"interpolate_factor=2 is not implemented.*supported: 1 or 1.0"),
        ({"rope_local_base_freq": 1e4}, r"rope_local_base_freq=10000.0 is not implemented.*'phi3'"),
        ({"attention_bias": True}, r"attention_bias=True.*supported: False"),
    ],
    ids=[
        "odd-rotary-dims",
        "rope-type",
        "lm-head-bias",
        "full-attn-mod",
        "interpolate",
        "unknown-field",
        "attention-bias",
    ],
)
def test_what_phi3_does_not_implement_is_refused(phi3_folder, tmp_path, fields, message):
    folder = _edited(phi3_folder, tmp_path, **fields)
    with pytest.raises(ValueError, match=message):
        read_model_config(folder)


# What a Phi-4-mini config.json carries beyond transformers' Phi3Config, at its values.
PHI4_MINI_EXTRAS = {
    "auto_map": {
        "AutoConfig": "configuration_phi3.Phi3Config",
        "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
    },
    "full_attn_mod": 1,
    "interpolate_factor": 1,
    "lm_head_bias": False,
}


def test_a_phi4_mini_config_loads_and_serves_transformers_tokens(tmp_path, tokenizer):
    """auto_map (remote code pdserve never runs) and the remote code's fields at their no-op values
    are accepted, and the model still gives transformers' greedy tokens."""
    model = save_small_model("phi3", tmp_path / "src", **PHI3_PARTIAL)
    folder = _edited(tmp_path / "src", tmp_path, **PHI4_MINI_EXTRAS)
    assert read_model_config(folder).rotary_dim == 12
    prompts = random_prompts(2, 20)
    assert engine_greedy(folder, tokenizer, prompts, 8) == reference_greedy(model, prompts, 8)


def test_one_window_for_every_layer_and_a_window_past_the_context_is_none(phi3_folder, tmp_path):
    cfg = read_model_config(_edited(phi3_folder, tmp_path, sliding_window=64))
    assert cfg.sliding_window == 64 and set(cfg.layer_types) == {"sliding_attention"}
    cfg = read_model_config(_edited(phi3_folder, tmp_path, "wide", sliding_window=262144))  # Phi-4-mini's
    assert cfg.sliding_window is None and set(cfg.layer_types) == {"full_attention"}


def test_a_context_past_the_short_factors_is_refused(phi3_folder):
    assert check_startup(phi3_folder, engine_cfg(max_model_len=128)).rotary_dim == 12
    with pytest.raises(ValueError, match=r"--max-model-len 128"):
        check_startup(phi3_folder, engine_cfg())


def test_fused_projections_split_by_rows(phi3_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    ref = load_file(str(phi3_folder / "model.safetensors"))
    _, tensors = load_model_weights(phi3_folder)
    qkv = ref["model.layers.1.self_attn.qkv_proj.weight"]
    assert tensors["model.layers.1.self_attn.q_proj.weight"].equal(qkv[:64])
    assert tensors["model.layers.1.self_attn.v_proj.weight"].equal(qkv[96:])
    gate_up = ref["model.layers.0.mlp.gate_up_proj.weight"]
    assert tensors["model.layers.0.mlp.up_proj.weight"].equal(gate_up[96:])
    folder = _edited(phi3_folder, tmp_path)
    shard = folder / "model.safetensors"
    ref["model.layers.0.self_attn.qkv_proj.weight"] = qkv[:120].clone()
    save_file(ref, str(shard))
    with pytest.raises(ValueError, match=r"qkv_proj.weight.* has 120 rows, expected 64 \+ 32 \+ 32"):
        load_model_weights(folder)


def test_a_phi3_gguf_is_refused(tmp_path):
    """llama.cpp's Phi-3 layout (fused attn_qkv / ffn_up, rope.dimension_count) is not read."""
    import gguf
    import numpy as np

    path = tmp_path / "phi3.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for read in (read_model_config, load_model_weights):
        with pytest.raises(ValueError, match=r"'phi3' is served from HF folders only"):
            read(path)
