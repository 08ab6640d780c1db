"""Gemma 3 text (``gemma3_text``, Gemma3ForCausalLM) from HF folders: a small random model (every
weight and norm drawn at random) gives transformers' float32 greedy tokens and logits through
pdserve's loader and engine, colocated, on the torch attention backend and the C kernels, at page
sizes 1 and 16, with forced retracts. The sliding window, the local RoPE base of the sliding layers
and the linear scaling of the full layers each change what transformers computes (checked against
the same weights without them), so a path that ignored any of them would fail here. Every config
field pdserve does not implement for Gemma 3 is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.forward_batch import ForwardMode
from engine.llm import LLM
from engine.loader import load_for_engine, read_model_config
from engine.model_runner import ModelRunner, SeqChunk
from tests.support.hf_folders import (
    GEMMA3,
    engine_greedy,
    random_prompts,
    reference_greedy,
    reference_variant,
    small_reference,
)
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

NEW = 12
FULL_ROPE = {"rope_type": "default", "rope_theta": 1e6}
IDS = random_prompts(1, 37)[0]  # the logit tests' prompt: 37 tokens, past the window of 8


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, prompts, transformers' greedy tokens, the transformers model) of a small random Gemma 3."""
    folder, prompts, ref, model = small_reference("gemma3_text", tmp_path_factory.mktemp("gemma3_text"), NEW, **GEMMA3)
    # the window, the sliding layers' base and the full layers' scaling each change transformers'
    # tokens (of the second prompt, enough to show it): a path that ignored one of them would fail here
    one, local = prompts[1:2], model.config.rope_parameters["sliding_attention"]
    assert reference_greedy(reference_variant("gemma3_text", folder, sliding_window=4096), one, NEW) != ref[1:2]
    same_base = {"full_attention": model.config.rope_parameters["full_attention"], "sliding_attention": FULL_ROPE}
    assert reference_greedy(reference_variant("gemma3_text", folder, rope_parameters=same_base), one, NEW) != ref[1:2]
    unscaled = {"full_attention": FULL_ROPE, "sliding_attention": local}
    assert reference_greedy(reference_variant("gemma3_text", folder, rope_parameters=unscaled), one, NEW) != ref[1:2]
    return folder, prompts, ref, model


def test_the_config_reads_as_transformers_builds_it(gemma3):
    cfg = read_model_config(gemma3[0])
    assert cfg.arch == "gemma3_text" and cfg.qk_norm and cfg.tie_word_embeddings
    kinds = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    assert cfg.layer_types == tuple(gemma3[3].config.layer_types) == kinds
    assert cfg.sliding_window == 8 and cfg.query_pre_attn_scalar == 12.0
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 100.0)
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 8.0
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_equal_transformers(gemma3, tokenizer, backend, page_size):
    folder, prompts, ref, _ = gemma3
    assert engine_greedy(folder, tokenizer, prompts, NEW, page_size=page_size, attention_backend=backend) == ref


@pytest.mark.slow
@pytest.mark.parametrize("backend, page_size", [("torch", 16), ("cpu", 1), ("cpu", 16)])
def test_forced_retracts_keep_transformers_tokens(gemma3, tokenizer, backend, page_size):
    """A retract every third step (the full KV and the window parked on the host, then resumed),
    the sliding layers in the SWA pool, whose pages are freed as they leave the window."""
    folder, prompts, ref, _ = gemma3
    ecfg = engine_cfg(page_size=page_size, attention_backend=backend)
    cfg, weights = load_for_engine(folder, ecfg)
    llm = LLM(ecfg, sched_cfg(retract_test_interval=3), loaded=(cfg, weights, tokenizer))
    out = llm.generate_ids(prompts, SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True))
    assert llm.scheduler.stats.retractions > 0 and llm.scheduler.kv.swa_pages_released > 0
    assert [r.token_ids for r in out] == ref
    llm.scheduler.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_logits_equal_transformers(gemma3, backend):
    folder = gemma3[0]
    ecfg = engine_cfg(page_size=16, attention_backend=backend, swa_pool_tokens=0)
    cfg, weights = load_for_engine(folder, ecfg)
    runner = ModelRunner(ecfg, cfg, weights)
    got = runner.forward(ForwardMode.EXTEND, [SeqChunk(IDS, 0, list(range(3)))])[0]
    with torch.no_grad():
        want = gemma3[3](torch.tensor([IDS])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_final_cap_when_set_equals_transformers(gemma3, tmp_path, backend):
    """Gemma 3 releases set no cap; a folder that sets final_logit_softcapping gets it after the LM
    head, as transformers applies it (the cap of 2 bounds these logits, which reach past it uncapped)."""
    folder = _edited(gemma3[0], tmp_path, final_logit_softcapping=2.0)
    ecfg = engine_cfg(page_size=16, attention_backend=backend, swa_pool_tokens=0)
    cfg, weights = load_for_engine(folder, ecfg)
    got = ModelRunner(ecfg, cfg, weights).forward(ForwardMode.EXTEND, [SeqChunk(IDS, 0, list(range(3)))])[0]
    with torch.no_grad():
        want = reference_variant("gemma3_text", folder)(torch.tensor([IDS])).logits[0, -1]
        uncapped = gemma3[3](torch.tensor([IDS])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert uncapped.abs().max() > 2.0 >= want.abs().max()


def _edited(src, tmp_path, drop=(), **fields):
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    for key in drop:
        cfg.pop(key, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_activation": "gelu"}, r"hidden_activation='gelu'.*'gemma3_text'; supported: 'gelu_pytorch_tanh'"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True.*supported: False"),
        ({"attention_bias": True}, r"attention_bias=True.*supported: False"),
        ({"final_logit_softcapping": 0}, r"soft cap 0 must be positive"),
        # transformers' Gemma 3 reads it and never applies it
        ({"attn_logit_softcapping": 1.5}, r"attn_logit_softcapping=1.5 .*'gemma3_text'; supported: None"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
            r"rope_type 'yarn' on the full layers .*'gemma3_text'; it serves default, linear",
        ),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            r"rope_type 'linear' on the sliding layers .*it serves default there",
        ),
        ({"rope_parameters": {"rope_type": "linear", "factor": 8.0}}, r"must be nested by layer kind"),
        # transformers merges a bare "type" into the default entry and ignores it: refused here
        (
            {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 8.0}},
            r"factor=8.0 are not implemented for rope_type 'default'",
        ),
        ({"sliding_window_pattern": 2}, r"sliding_window_pattern=2 disagrees with its layer_types"),
        ({"_sliding_window_pattern": 6}, r"_sliding_window_pattern=6 disagrees with its layer_types"),
        ({"num_experts": 4}, r"num_experts=4 is not implemented.*'gemma3_text'"),
    ],
    ids=[
        "activation",
        "bidirectional",
        "bias",
        "zero-cap",
        "attention-cap",
        "full-rope-type",
        "sliding-rope-type",
        "flat-rope",
        "legacy-bare-type",
        "pattern",
        "hidden-pattern",
        "unknown",
    ],
)
def test_what_gemma3_does_not_implement_is_refused(gemma3, tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        read_model_config(_edited(gemma3[0], tmp_path, **fields))


def test_the_legacy_rope_fields_read_as_the_nested_ones(gemma3, tmp_path):
    """rope_theta, rope_local_base_freq and rope_scaling at the top (the released configs' form)."""
    folder = _edited(
        gemma3[0],
        tmp_path,
        drop=("rope_parameters",),
        rope_theta=1e6,
        rope_local_base_freq=100.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        cache_implementation="hybrid",
    )
    want = read_model_config(gemma3[0])
    assert read_model_config(folder) == read_model_config(gemma3[0]).__class__(**{**want.__dict__, "name": "edited"})


@pytest.mark.parametrize(
    "pattern, full_layers",
    [(None, ()), (3, (2,)), (2, (1, 3)), (1, (0, 1, 2, 3))],
)
def test_without_layer_types_the_pattern_sets_the_full_layers(gemma3, tmp_path, pattern, full_layers):
    """Gemma3TextConfig's rule: layer i is full iff (i + 1) % sliding_window_pattern == 0 (default 6)."""
    folder = _edited(
        gemma3[0], tmp_path, drop=("layer_types", "_sliding_window_pattern"), sliding_window_pattern=pattern
    )
    cfg = read_model_config(folder)
    assert tuple(i for i, k in enumerate(cfg.layer_types) if k == "full_attention") == full_layers


# The fields of google/gemma-3-1b-it's config.json (transformers 4.50), without the sizes, and those
# 270M's export (transformers 4.55) writes beside them.
RELEASED_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
}
SIZES = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "vocab_size": 128}


@pytest.mark.parametrize(
    "fields, full_layers, scaling",
    [
        ({"num_hidden_layers": 26}, (5, 11, 17, 23), None),
        (
            {  # 270M's export: the list and the pattern it came from
                "num_hidden_layers": 18,
                "_sliding_window_pattern": 6,
                "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
                "use_bidirectional_attention": False,
                "sliding_window_pattern": None,
            },
            (5, 11, 17),
            None,
        ),
        ({"num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}, (5, 11, 17, 23, 29), 8.0),
    ],
    ids=["1b", "270m", "4b-text"],
)
def test_the_released_configs_load(tmp_path, fields, full_layers, scaling):
    """The released configs' fields (sizes shrunk; no weights: the loader reads headers only)."""
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({**RELEASED_1B, **SIZES, **fields}))
    save_file({}, str(tmp_path / "model.safetensors"))
    cfg = read_model_config(tmp_path)
    assert tuple(i for i, k in enumerate(cfg.layer_types) if k == "full_attention") == full_layers
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (512, 1e6, 1e4)
    assert (cfg.rope_scaling.factor if cfg.rope_scaling else None) == scaling
    assert cfg.eos_token_ids == (1, 106) and cfg.query_pre_attn_scalar == 256.0 and cfg.tie_word_embeddings
