"""A HF folder with a config.json field (or a tensor) pdserve does not implement is refused at load,
naming the field, its value and what is supported; harmless fields pass."""

from __future__ import annotations

import json

import pytest

from engine.hf_fields import HARMLESS, IMPLEMENTED
from engine.loader import load_model_weights, read_model_config
from tests.support.hf_folders import save_small_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One saved small model per architecture (config.json edited per test on a copy)."""
    out = {}
    for kind in ("llama", "qwen2", "qwen3"):
        out[kind] = tmp_path_factory.mktemp(kind)
        save_small_model(kind, out[kind])
    return out


def _edited(folders, tmp_path, kind: str, **fields):
    """A copy of ``kind``'s folder with ``fields`` set in config.json (a value ``...`` deletes it)."""
    import shutil

    dst = tmp_path / kind
    shutil.copytree(folders[kind], dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in fields.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


REFUSED = [
    # (architecture, field, value, what the message must say)
    ("llama", "hidden_act", "gelu_pytorch_tanh", r"hidden_act='gelu_pytorch_tanh'.*supported: 'silu' or 'swish'"),
    ("llama", "mlp_bias", True, r"mlp_bias=True.*supported: False"),
    ("llama", "attention_bias", True, r"attention_bias=True.*supported: False"),
    ("qwen3", "attention_bias", True, r"attention_bias=True.*supported: False"),
    ("llama", "partial_rotary_factor", 0.5, r"partial_rotary_factor=0.5.*supported: 1"),
    ("llama", "rope_interleaved", True, r"rope_interleaved=True"),
    ("qwen2", "use_mrope", True, r"use_mrope=True"),
    ("llama", "hidden_activation", "gelu_pytorch_tanh", r"hidden_activation='gelu_pytorch_tanh' is not implemented"),
    ("llama", "final_logit_softcapping", 30.0, r"final_logit_softcapping=30.0 is not implemented.*'llama'"),
    ("llama", "attn_logit_softcapping", 50.0, r"attn_logit_softcapping=50.0 is not implemented"),
    ("qwen3", "num_experts", 8, r"num_experts=8 is not implemented.*'qwen3'"),
    ("qwen3", "num_experts_per_tok", 2, r"num_experts_per_tok=2 is not implemented"),
    ("qwen2", "quantization_config", {"quant_method": "awq"}, r"quantization_config=.*awq.*not implemented"),
    ("llama", "sliding_window", 64, r"sliding_window=64 is not implemented.*'llama'"),
]


@pytest.mark.parametrize("kind, field, value, message", REFUSED, ids=[f"{r[0]}-{r[1]}" for r in REFUSED])
def test_an_unimplemented_field_is_refused_naming_it(folders, tmp_path, kind, field, value, message):
    folder = _edited(folders, tmp_path, kind, **{field: value})
    with pytest.raises(ValueError, match=message):
        read_model_config(folder)
    with pytest.raises(ValueError, match=message):  # before any weight is read
        load_model_weights(folder)


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "su", "rope_theta": 1e4}, r"rope_type 'su' is not implemented; pdserve implements default"),
        (
            {"rope_type": "linear", "factor": 2.0, "mrope_section": [2, 3, 3], "rope_theta": 1e4},
            r"mrope_section=\[2, 3, 3\] are not implemented for rope_type 'linear'",
        ),
        (
            {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4},
            r"'llama3' needs low_freq_factor, high_freq_factor",
        ),
        (
            {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "rope_theta": 1e4},
            r"short_factor has 1 entries, expected rotary dims // 2 = 8",
        ),
        ({"rope_type": "default", "partial_rotary_factor": 0.5, "rope_theta": 1e4}, r"partial_rotary_factor=0.5"),
    ],
    ids=["unknown-type", "unknown-key", "missing-key", "factor-length", "partial-rotary"],
)
def test_bad_rope_parameters_are_refused(folders, tmp_path, rope, message):
    folder = _edited(folders, tmp_path, "llama", rope_parameters=rope)
    with pytest.raises(ValueError, match=message):
        read_model_config(folder)


def test_harmless_and_null_fields_pass(folders, tmp_path):
    """Metadata, token ids, dropout, remote-code pointers (pdserve runs none) and null-valued unknown
    fields change nothing: accepted."""
    folder = _edited(
        folders,
        tmp_path,
        "llama",
        torch_dtype="bfloat16",
        pad_token_id=0,
        unk_token_id=0,
        _model_name_or_path="SmolLM2 135M",
        attention_dropout=0.1,
        pretraining_tp=1,
        is_llama_config=True,
        quantization_config=None,
        partial_rotary_factor=1.0,
        auto_map={"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"},
    )
    assert read_model_config(folder).arch == "llama"


def test_every_field_transformers_writes_is_classified():
    """What transformers saves for each served architecture is implemented or harmless (a field a
    new transformers version adds shows up here, not as a refused customer folder)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "ministral": transformers.MinistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "phi3": transformers.Phi3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "gpt_oss": transformers.GptOssConfig,
    }
    for arch, cls in classes.items():
        unknown = set(cls().to_dict()) - IMPLEMENTED[arch] - HARMLESS
        assert not unknown, (arch, unknown)


def test_a_tensor_the_model_does_not_read_is_refused(folders, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    folder = _edited(folders, tmp_path, "llama")
    shard = folder / "model.safetensors"
    tensors = load_file(str(shard))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    tensors["model.layers.0.rotary_emb.inv_freq"] = torch.zeros(8)  # an old export's buffer: harmless
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) .*'llama' model does not implement.*o_proj\.bias"):
        load_model_weights(folder)
