"""Gemma 2 from HF folders: small random models (every weight and norm drawn at random) give
transformers' float32 greedy tokens and logits through pdserve's loader and engine, colocated, on
the torch attention backend (its soft-capped path) and the C kernels (decode, per-row and tiled
extend), with the sliding layers in the SWA pool; the soft caps are small enough to change what
transformers computes (checked against the same weights without them)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.forward_batch import ForwardMode
from engine.loader import load_for_engine, read_model_config
from engine.model_runner import ModelRunner, SeqChunk
from tests.support.hf_folders import (
    GEMMA2,
    engine_greedy,
    random_prompts,
    reference_greedy,
    reference_variant,
    save_small_model,
    small_reference,
)
from tests.support.models import engine_cfg

pytestmark = pytest.mark.unit

NEW = 12


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """(folder, prompts, transformers' greedy tokens, the transformers model) of a small random Gemma 2."""
    folder, prompts, ref, model = small_reference("gemma2", tmp_path_factory.mktemp("gemma2"), NEW, **GEMMA2)
    # the attention cap changes transformers' tokens: a path that ignored it would fail here
    assert reference_greedy(reference_variant("gemma2", folder, attn_logit_softcapping=None), prompts, NEW) != ref
    # and so does the window: a path that let the sliding layers see every key would fail too
    assert reference_greedy(reference_variant("gemma2", folder, sliding_window=4096), prompts, NEW) != ref
    return folder, prompts, ref, model


def test_the_config_reads_as_transformers_builds_it(gemma2):
    cfg = read_model_config(gemma2[0])
    assert cfg.arch == "gemma2" and not cfg.qk_norm and not cfg.tie_word_embeddings
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == 8
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (1.5, 2.0)
    assert cfg.query_pre_attn_scalar == 12.0 and cfg.rope_local_theta == cfg.rope_theta


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_equal_transformers(gemma2, tokenizer, backend, page_size):
    folder, prompts, ref, _ = gemma2
    assert engine_greedy(folder, tokenizer, prompts, NEW, page_size=page_size, attention_backend=backend) == ref


@pytest.mark.slow
def test_tied_head_dim_64_on_the_tiled_extend_kernel(tmp_path, tokenizer):
    """head_dim 64 takes the tiled C extend kernel; a tied LM head (Gemma2Config's default)."""
    overrides = {**GEMMA2, "head_dim": 64, "tie_word_embeddings": True, "attn_logit_softcapping": 3.0}
    model = save_small_model("gemma2", tmp_path, **overrides)
    prompts = random_prompts(2, 40)
    ref = reference_greedy(model, prompts, NEW)
    assert reference_greedy(reference_variant("gemma2", tmp_path, attn_logit_softcapping=None), prompts, NEW) != ref
    assert engine_greedy(tmp_path, tokenizer, prompts, NEW, page_size=16, attention_backend="cpu") == ref


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_logits_equal_transformers_with_the_final_cap(gemma2, backend):
    """The final soft cap bounds the logits (it never changes the argmax, so the tokens cannot show it)."""
    folder = gemma2[0]
    ecfg = engine_cfg(dtype="float32", page_size=16, attention_backend=backend, swa_pool_tokens=0)
    cfg, weights = load_for_engine(folder, ecfg)
    runner = ModelRunner(ecfg, cfg, weights)
    ids = random_prompts(1, 37)[0]
    got = runner.forward(ForwardMode.EXTEND, [SeqChunk(ids, 0, list(range(3)))])[0]
    with torch.no_grad():
        want = gemma2[3](torch.tensor([ids])).logits[0, -1]
        uncapped = reference_variant("gemma2", folder, final_logit_softcapping=None)(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert uncapped.abs().max() > 2.0 >= want.abs().max()


def _edited(src, tmp_path, **fields):
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"hidden_activation": "gelu"}, r"hidden_activation='gelu'.*'gemma2'; supported: 'gelu_pytorch_tanh'"),
        ({"hidden_act": "silu"}, r"hidden_act='silu'.*supported: 'gelu_pytorch_tanh'"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True.*supported: False"),
        ({"attention_bias": True}, r"attention_bias=True.*supported: False"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            r"rope_type 'linear'.*'gemma2'; it serves default",
        ),
        ({"attn_logit_softcapping": 0}, r"soft cap 0 must be positive"),
        ({"num_experts": 4}, r"num_experts=4 is not implemented.*'gemma2'"),
    ],
    ids=["activation", "hidden-act", "bidirectional", "bias", "rope-type", "zero-cap", "unknown"],
)
def test_what_gemma2_does_not_implement_is_refused(gemma2, tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        read_model_config(_edited(gemma2[0], tmp_path, **fields))


def test_null_caps_and_legacy_fields_load(gemma2, tmp_path):
    """null caps are no caps; what older exports wrote (hidden_act beside hidden_activation, the
    generate() cache class, rope_theta at the top) passes at its Gemma 2 values."""
    folder = _edited(
        gemma2[0],
        tmp_path,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        hidden_act="gelu_pytorch_tanh",
        cache_implementation="hybrid",
        rope_theta=10000.0,
    )
    cfg = read_model_config(folder)
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None


def test_without_layer_types_the_layers_alternate_sliding_first(gemma2, tmp_path):
    """Gemma2Config's default when config.json has no layer_types (older exports)."""
    cfg = read_model_config(_edited(gemma2[0], tmp_path, layer_types=None))
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == 8
