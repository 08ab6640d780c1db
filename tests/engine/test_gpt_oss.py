"""gpt-oss from a HF folder: a small random model (attention sinks, q/k/v/o biases, alternating
sliding and full layers, a biased router, clamped SwiGLU experts with biases, YaRN) gives transformers'
greedy tokens (float32, eager attention) through pdserve's loader and engine, colocated in one process,
on prompts longer than the sliding window; quantized checkpoints are refused; the sinks change the
attention output, and the kernels that cannot compute them are kept off."""

from __future__ import annotations

import json

import pytest
import torch

from engine.attention_ops import sink_attention
from engine.loader import load_model_weights, read_model_config
from tests.support.hf_folders import GPT_OSS, engine_greedy, random_prompts, reference_greedy, save_small_model

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """``(folder, transformers model)`` of the small random gpt-oss."""
    folder = tmp_path_factory.mktemp("gpt_oss")
    return folder, save_small_model("gpt_oss", folder, **GPT_OSS)


def test_config_reads_sinks_biases_layers_and_experts(gpt_oss):
    folder, _ = gpt_oss
    cfg = read_model_config(folder)
    assert (cfg.arch, cfg.attention_bias, cfg.o_bias, cfg.attention_sinks) == ("gpt_oss", True, True, True)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == 8
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_size) == (8, 2, 96)
    assert cfg.moe.swiglu == (1.702, 1.0) and cfg.moe.sparse_layers == (0, 1, 2, 3)
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_theta == 150000.0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_equal_transformers(gpt_oss, tokenizer, backend, page_size):
    """Prompts of 30-44 tokens (past the window of 8) and 16 new tokens each, in one batch: prefill,
    then decode over the full and SWA pools."""
    folder, model = gpt_oss
    prompts = random_prompts(3, 30)
    got = engine_greedy(folder, tokenizer, prompts, 16, page_size=page_size, attention_backend=backend)
    assert got == reference_greedy(model, prompts, 16)


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_in_chunks(gpt_oss, tokenizer):
    """Prefill in chunks of 16 (extend over a prefix read back from both pools) and mixed batches (one
    request decodes while the next prefills)."""
    folder, model = gpt_oss
    prompts = random_prompts(2, 37, seed=3)
    sched = {"chunked_prefill_size": 16, "max_num_batched_tokens": 16}
    got = engine_greedy(folder, tokenizer, prompts, 10, scheduler=sched, page_size=4)
    assert got == reference_greedy(model, prompts, 10)


@pytest.mark.slow
def test_tokens_need_the_sinks(gpt_oss, tokenizer, monkeypatch):
    """The same run with every sink at -inf (attention as a kernel ignoring them computes it) gives
    other tokens: the greedy test above would catch a path that dropped them."""
    import engine.attention

    folder, model = gpt_oss
    prompts = random_prompts(3, 30)
    real = engine.attention.sink_attention

    def without_sinks(q, k, v, scale, sinks, mask):
        return real(q, k, v, scale, torch.full_like(sinks, float("-inf")), mask)

    monkeypatch.setattr(engine.attention, "sink_attention", without_sinks)
    assert engine_greedy(folder, tokenizer, prompts, 16) != reference_greedy(model, prompts, 16)


def test_decode_stack_is_off(gpt_oss):
    """The C decode stack computes neither sinks nor gpt-oss's experts: it is not built."""
    from engine.model import LlamaModel

    folder, _ = gpt_oss
    cfg, weights = load_model_weights(folder)
    model = LlamaModel(cfg, torch.device("cpu"), torch.float32)
    model.load_weights(weights)
    assert model.stack is None


def test_quantized_checkpoint_is_refused(gpt_oss, tmp_path):
    folder, _ = gpt_oss
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"quantization_config=.*mxfp4.*bfloat16, float16 or float32"):
        read_model_config(tmp_path)


def test_cuda_is_refused():
    from engine.model_runner import _check_device_serves

    cfg = type("Cfg", (), {"attention_sinks": True, "arch": "gpt_oss"})()
    with pytest.raises(ValueError, match="served on CPU only"):
        _check_device_serves(cfg, torch.device("cuda"))
    _check_device_serves(cfg, torch.device("cpu"))


def test_sinks_change_attention_and_match_the_reference_softmax():
    """A sink adds exp(sink) to each row's softmax denominator: the output shrinks by the sink's share,
    so a kernel that ignored it would fail; -inf sinks give plain attention."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 5, 8, generator=g) for _ in range(3))
    k, v = k[:2], v[:2]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = sink_attention(q, k, v, 0.3, sinks, mask)
    kk, vv = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    s = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    plain = torch.softmax(s, -1) @ vv
    assert torch.allclose(sink_attention(q, k, v, 0.3, torch.full((4,), float("-inf")), mask), plain, atol=1e-6)
    denom = torch.logsumexp(s, -1, keepdim=True)
    share = torch.sigmoid(denom - sinks.view(4, 1, 1))  # the keys' part of the softmax mass
    assert torch.allclose(out, plain * share, atol=1e-5)
    assert (out - plain).abs().max() > 0.1
