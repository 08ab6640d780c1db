"""RoPE scaling from HF folders: the frequencies equal transformers' own, and small random Llama
models with each rope_type give transformers' greedy tokens through pdserve's loader and engine."""

from __future__ import annotations

import pytest
import torch

from engine.loader import check_startup, read_model_config
from engine.rope import RotaryEmbedding
from engine.rope_scaling import parse_rope_scaling, scaled_inv_freq
from tests.support.hf_folders import SMALL, engine_greedy, random_prompts, reference_greedy, save_small_model
from tests.support.models import engine_cfg

pytestmark = pytest.mark.unit

SHORT = [1.0 + 0.25 * i for i in range(8)]  # head_dim 16: 8 factors
LONG = [2.0 + 0.5 * i for i in range(8)]
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": 256,
    },
}


def _hf_rope(params: dict):
    """transformers' (inv_freq, attention_scaling) for a SMALL Llama with ``params``."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(**SMALL, rope_parameters={**params, "rope_theta": 10000.0})
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_and_attention_factor_equal_transformers(name):
    params = SCALINGS[name]
    scaling = parse_rope_scaling({**params, "rope_theta": 10000.0}, SMALL["max_position_embeddings"], 16)
    inv_freq, factor = scaled_inv_freq(scaling, 16, 10000.0, SMALL["max_position_embeddings"])
    ref_freq, ref_factor = _hf_rope(params)
    assert torch.equal(inv_freq, ref_freq.float())
    assert factor == pytest.approx(ref_factor, rel=0, abs=0)
    if name != "dynamic":  # the others change the table: a test that ignored them would fail
        plain = RotaryEmbedding(16, 512, 10000.0, "cpu")
        scaled = RotaryEmbedding(16, 512, 10000.0, "cpu", scaling)
        assert not torch.allclose(plain.cos, scaled.cos)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_greedy_tokens_equal_transformers(tmp_path, tokenizer, name):
    """Prompts of 70..84 tokens, 12 new ones: past llama3's and yarn's original length."""
    model = save_small_model("llama", tmp_path, rope_parameters={**SCALINGS[name], "rope_theta": 10000.0})
    cfg = read_model_config(tmp_path)
    assert (cfg.rope_scaling.rope_type if cfg.rope_scaling else "default") == SCALINGS[name]["rope_type"]
    prompts = random_prompts(3, 70)
    extra = {"max_model_len": 256} if name == "longrope" else {}
    got = engine_greedy(tmp_path, tokenizer, prompts, 12, **extra)
    assert got == reference_greedy(model, prompts, 12)


def test_longrope_past_its_short_factors_is_refused(tmp_path):
    save_small_model("llama", tmp_path, rope_parameters={**SCALINGS["longrope"], "rope_theta": 10000.0})
    with pytest.raises(ValueError, match=r"longrope.*original_max_position_embeddings = 256.*--max-model-len 256"):
        check_startup(tmp_path, engine_cfg())
    check_startup(tmp_path, engine_cfg(max_model_len=256))


def test_legacy_rope_scaling_key_is_read(tmp_path):
    """Checkpoints saved before transformers 5 carry ``rope_scaling`` and a top-level ``rope_theta``."""
    import json

    save_small_model("llama", tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = 5e5
    cfg["rope_scaling"] = {**SCALINGS["llama3"], "type": "llama3"}
    path.write_text(json.dumps(cfg))
    got = read_model_config(tmp_path)
    assert got.rope_theta == 5e5 and got.rope_scaling.rope_type == "llama3" and got.rope_scaling.factor == 8.0
