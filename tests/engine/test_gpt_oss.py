"""gpt-oss from a HF folder: a small random model (attention sinks, q/k/v/o biases, alternating
sliding and full layers, a biased router, clamped SwiGLU experts with biases, YaRN) gives transformers'
greedy tokens (float32, eager attention) through pdserve's loader and engine, colocated in one process,
on prompts longer than the sliding window; quantized checkpoints are refused; the sinks change the
attention output, and the kernels that cannot compute them are kept off."""

from __future__ import annotations

import dataclasses
import json
import logging

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


def test_openai_config_spelling_reads_the_same(gpt_oss, tmp_path):
    """openai's config.json writes the legacy rope_scaling with a top-level rope_theta, and
    experts_per_token / initial_context_length, which transformers reads into nothing: the same config."""
    folder, _ = gpt_oss
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    theta = rope.pop("rope_theta")
    cfg.update(rope_scaling=rope, rope_theta=theta, experts_per_token=4, initial_context_length=4096)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    assert read_model_config(tmp_path) == dataclasses.replace(read_model_config(folder), name=tmp_path.name)


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


def test_decode_stack_is_off(gpt_oss, caplog):
    """The C decode stack computes neither sinks nor gpt-oss's experts: it is not built, for that reason
    (checked before whether this CPU builds its kernels at all)."""
    from engine.model import LlamaModel

    folder, _ = gpt_oss
    cfg, weights = load_model_weights(folder)
    model = LlamaModel(cfg, torch.device("cpu"), torch.float32)
    with caplog.at_level(logging.DEBUG, logger="engine.decode_stack"):
        model.load_weights(weights)
    assert model.stack is None
    assert "decode stack off: attention sinks" in caplog.text


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


def _pool_case(seed: int):
    """A tiny runner with random KV in its pool, decode rows (one new token over prefixes of 5-30) and
    extend rows (a fresh prompt, a prefix hit, a one-token chunk) on shuffled pages, and random q/k/v
    per layer for the step's tokens: ``(runner, decode seqs, extend seqs, qkv)``."""
    from engine.model_runner import ModelRunner, SeqChunk
    from tests.support.models import engine_cfg, tiny_config, tiny_weights

    cfg = tiny_config()
    runner = ModelRunner(engine_cfg(kv_pool_tokens=512, page_size=4, attention_backend="torch"), cfg, tiny_weights(cfg))
    g = torch.Generator().manual_seed(seed)
    runner.pools.units.copy_(torch.randn(runner.pools.units.shape, generator=g))
    free = torch.randperm(runner.pools.full.num_pages, generator=g).tolist()

    def seq(prefix: int, new: int) -> SeqChunk:
        pages = [free.pop() for _ in range(-(-(prefix + new) // 4))]
        return SeqChunk(torch.randint(0, cfg.vocab_size, (new,), generator=g).tolist(), prefix, pages)

    dec = [seq(p, 1) for p in (5, 17, 30)]
    ext = [seq(p, n) for p, n in ((0, 9), (12, 7), (3, 1))]
    T, H, Hkv, D = len(dec) + 17, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = [
        (torch.randn(T, H, D, generator=g), torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g))
        for _ in range(cfg.num_layers)
    ]
    return runner, dec, ext, qkv


@pytest.mark.parametrize("kind", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 6])
def test_backends_attend_with_sinks_over_the_pool(kind, window):
    """A MIXED step (decode and extend rows, layer 1 sliding when ``window``) with sinks on each backend:
    -inf sinks give the backend's plain attention, real ones change it, and the C backend's output is the
    torch backend's (its kernels, which have no sinks, are bypassed)."""
    from engine.attention import CpuBackend, TorchBackend
    from engine.forward_batch import ForwardMode
    from engine.kernels import cpu_native

    if kind == "cpu" and cpu_native.load() is None:
        pytest.skip("no C compiler for the CPU kernel")
    runner, dec, ext, qkv = _pool_case(seed=11)
    windows, heads, start = [None, window], runner.model_config.num_heads, runner.pools.units.clone()
    batch = runner.build_batch(ForwardMode.MIXED, dec + ext, num_decode=len(dec))
    sinks = torch.linspace(-1.0, 1.5, heads)

    def run(backend, sink) -> list[torch.Tensor]:
        runner.pools.units.copy_(start)
        backend.prepare(batch)
        kw = {} if sink is None else {"sinks": sink}
        return [backend.forward(q, k, v, layer, batch, **kw) for layer, (q, k, v) in enumerate(qkv)]

    make = TorchBackend if kind == "torch" else lambda *a: CpuBackend(*a, threads=2)
    backend = make(runner.pools, heads, 0.25, windows)
    plain, none_ = run(backend, None), run(backend, torch.full((heads,), float("-inf")))
    with_sinks = run(backend, sinks)
    reference = run(TorchBackend(runner.pools, heads, 0.25, windows), sinks)
    for layer in range(len(qkv)):
        torch.testing.assert_close(none_[layer], plain[layer], rtol=1e-5, atol=1e-5)
        assert (with_sinks[layer] - plain[layer]).abs().max() > 1e-2
        assert torch.equal(with_sinks[layer], reference[layer])
