"""The C decode stack on mixture-of-experts models (``cpu_decode_stack.c``'s expert block): a small
decode step's layers in one call, router, top-k, renormalization and the experts (``cpu_moe.c``)
included, and Qwen3's per-head Q/K norms, against the per-layer path on the same step. float32: the
same tokens and logits to float32 rounding (only the router's and the Q/K norms' summation orders
differ); bfloat16 and int8 experts: the same kernel on the same grouping, so the logits stay within a
bfloat16 rounding of the layer path's."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig, MoeSpec
from engine.decode_stack import ENV
from engine.kernels import cpu_moe
from engine.llm import LLM
from engine.model import LlamaModel
from engine.tensor_shapes import expected_tensor_shapes
from tests.support.cpu_kernels import needs_small_batch_kernels, portable_float32_panels
from tests.support.decode_stack_paths import BothPaths
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def _config(norm: bool = True, qk_norm: bool = True, hidden: int = 64) -> ModelConfig:
    """Three layers, 8 experts of 32 (top 2) on layers 0 and 2, layer 1 dense."""
    return ModelConfig("qwen3_moe", 128, hidden, 96, 3, 4, 2, 16, qk_norm=qk_norm, moe=MoeSpec(8, 2, 32, norm, (0, 2)))


def _weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        n: (1 + 0.2 * torch.randn(s, generator=g)) if n.endswith("norm.weight") else 0.2 * torch.randn(s, generator=g)
        for n, s in expected_tensor_shapes(cfg).items()
    }


@pytest.fixture(autouse=True)
def _stack_on(monkeypatch):
    """The stack on whatever the environment says (the suite may run with it off)."""
    monkeypatch.setenv(ENV, "1")


def _run_both(tokenizer, cfg: ModelConfig, dtype: str, **engine) -> list[tuple]:
    llm = LLM(engine_cfg(dtype=dtype, **engine), sched_cfg(), loaded=(cfg, _weights(cfg), tokenizer))
    assert llm.runner.model.stack is not None
    both = BothPaths(llm.runner.model)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3):
        prompts = [torch.randint(3, cfg.vocab_size, (7 + 5 * i,), generator=g).tolist() for i in range(rows)]
        llm.generate_ids(prompts, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    llm.scheduler.check_integrity()
    assert {s[0] for s in both.steps} == {1, 3}
    return both.steps


@pytest.mark.parametrize("norm", [True, False])
def test_float32_moe_step_through_the_stack_equals_the_layer_path(tokenizer, monkeypatch, norm):
    """Both renormalization settings: the stack follows ``norm_topk_prob`` as ``engine.moe`` does. (float32
    runs anywhere the kernels build: on the portable float32 panels without AVX-512F.)"""
    portable_float32_panels(monkeypatch)
    _assert_float32_equal(_run_both(tokenizer, _config(norm), "float32"))


# int8 builds its panels for seconds: slow tier
@needs_small_batch_kernels
@pytest.mark.parametrize("weights", ["bfloat16", pytest.param("int8", marks=pytest.mark.slow)])
def test_bfloat16_and_int8_moe_steps_through_the_stack_stay_at_the_layer_path(tokenizer, weights):
    _assert_low_precision_close(tokenizer, _config(), weights)


@needs_small_batch_kernels
def test_moe_and_qk_norm_models_build_the_stack_only_where_the_expert_kernel_runs():
    def built(cfg: ModelConfig, dtype=torch.float32) -> bool:
        model = LlamaModel(cfg, torch.device("cpu"), dtype)
        model.load_weights(_weights(cfg))
        return model.stack is not None

    assert built(_config()) and built(_config(qk_norm=False)) and built(_config(), torch.bfloat16)
    assert not built(_config(hidden=80))  # the expert kernel takes hidden sizes of multiples of 32
    assert built(_qwen2_moe()) and built(_qwen2_moe(), torch.bfloat16)
    # a float32 shared gate-up of 96 outputs is no float32 panel (out % 64): the per-layer path runs it
    assert not built(_qwen2_moe(48)) and built(_qwen2_moe(48), torch.bfloat16)


def _qwen2_moe(shared: int = 64) -> ModelConfig:
    """Qwen2-MoE's shape: q/k/v biases, 8 experts of 32 (top 2) and a shared expert of ``shared`` on
    layers 0 and 2, layer 1 dense (as ``mlp_only_layers``)."""
    spec = MoeSpec(8, 2, 32, False, (0, 2), shared)
    return ModelConfig("qwen2_moe", 128, 64, 96, 3, 4, 2, 16, attention_bias=True, moe=spec)


def test_qwen2_moe_shared_expert_step_through_the_stack_equals_the_layer_path(tokenizer, monkeypatch):
    """float32: the shared expert and its sigmoid gate run in the stack (breaking either moves the
    logits far beyond the router's float32 summation-order difference)."""
    portable_float32_panels(monkeypatch)
    _assert_float32_equal(_run_both(tokenizer, _qwen2_moe(), "float32"))


# int8 builds its panels for seconds: slow tier
@needs_small_batch_kernels
@pytest.mark.parametrize("weights", ["bfloat16", pytest.param("int8", marks=pytest.mark.slow)])
def test_bfloat16_and_int8_qwen2_moe_steps_through_the_stack_stay_at_the_layer_path(tokenizer, weights):
    _assert_low_precision_close(tokenizer, _qwen2_moe(), weights)


def _assert_float32_equal(runs) -> None:
    """float32: the stack's logits and KV equal the layer path's up to summation order."""
    for _, a, b, kv_a, kv_b in runs:
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv_a, kv_b, rtol=1e-5, atol=1e-5)


def _assert_low_precision_close(tokenizer, cfg: ModelConfig, weights: str) -> None:
    """bfloat16 activations with bfloat16 or int8 weights: the stack stays within bfloat16 rounding of
    the layer path (logits of order 1-10: a bfloat16 rounding of a Q/K norm or router sum moves them
    by < 0.1)."""
    if weights == "int8" and not cpu_moe.dot_available():
        pytest.skip("int8 experts take the kernel only with AVX512-BF16")
    extra = {"weight_dtype": "int8"} if weights == "int8" else {}
    for _, a, b, kv_a, kv_b in _run_both(tokenizer, cfg, "bfloat16", **extra):
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.1)
        torch.testing.assert_close(kv_a.float(), kv_b.float(), rtol=0.02, atol=0.02)
