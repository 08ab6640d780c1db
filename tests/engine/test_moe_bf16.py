"""A Qwen3-MoE folder served in bfloat16 (--dtype bfloat16) and with weight-only int8 weights
(--weight-dtype int8), experts by the C kernel, against the same folder in float32 (the exact mode,
equal to transformers): prompt logprobs of random prompts within each mode's tolerance and the top-1
tokens agreeing. Skipped where the CPU has no native bfloat16 (the engine runs float32 there).
Figures of this test's four prompts (40-61 tokens, each prefill through the expert GEMM, experts of
64) on the development host, mean / max |delta logprob|, top-1 agreement: bfloat16 0.047 / 0.95,
0.965; int8 0.107 / 1.51, 0.894 (with experts of 32 through the dot-product kernel: bfloat16 0.050 /
0.72, 0.934; int8 0.132 / 2.46, 0.848; the torch path with the same int8 experts dequantized: 0.123 /
2.44, 0.874). Random weights over a 128-token vocabulary have many near-ties."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_features import has_fast_bf16
from engine.kernels import cpu_moe
from engine.llm import LLM, run_batch
from engine.loader import load_for_engine
from engine.moe import KERNEL_MAX_ROWS
from tests.support.hf_folders import QWEN3_MOE, random_prompts, save_small_model
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.skipif(has_fast_bf16() is not True, reason="no native bfloat16")]


def _logprobs(folder, tokenizer, dtype: str, prompts: list[list[int]], weight_dtype: str | None = None):
    """(prompt logprobs after the first token, top-1 tokens) over all prompts, in ``dtype``."""
    ecfg = engine_cfg(dtype=dtype, **({"weight_dtype": weight_dtype} if weight_dtype else {}))
    cfg, weights = load_for_engine(folder, ecfg)
    llm = LLM(ecfg, sched_cfg(), loaded=(cfg, weights, tokenizer))
    assert llm.runner.dtype == getattr(torch, dtype)
    sp = SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True)
    # one prompt a step: each prefill is at most KERNEL_MAX_ROWS rows, one kernel call (a batched
    # prefill of more rows takes the kernel in chunks of LARGE_STEP_ROWS)
    outs = [run_batch(llm.scheduler, [p], [sp])[0] for p in prompts]
    llm.scheduler.check_integrity()
    entries = [e for o in outs for e in o.prompt_logprobs[1:]]
    return torch.tensor([e[0] for e in entries]), [e[1][0][0] for e in entries]


@pytest.fixture(scope="module")
def moe_float32(tmp_path_factory, tokenizer):
    """(folder, prompts, float32 prompt logprobs and top-1 tokens)."""
    folder = tmp_path_factory.mktemp("qwen3_moe_bf16")
    # experts of 64: the sizes the expert GEMM takes (multiples of 64), so prefills run through it
    save_small_model("qwen3_moe", folder, **{**QWEN3_MOE, "moe_intermediate_size": 64})
    prompts = random_prompts(4, 40)
    assert max(map(len, prompts)) <= KERNEL_MAX_ROWS
    return folder, prompts, *_logprobs(folder, tokenizer, "float32", prompts)


@pytest.mark.parametrize(
    "weight_dtype, expert_dtype, bounds",
    # (mean and max |delta logprob|, top-1 agreement); int8: the whole model's weights quantized, as
    # far from float32 on the torch path (dequantized experts) as through the kernel
    [(None, torch.bfloat16, (0.1, 1.0, 0.85)), pytest.param("int8", torch.int8, (0.2, 3.0, 0.8), id="int8")],
)
def test_bfloat16_and_int8_experts_stay_close_to_float32(
    moe_float32, tokenizer, monkeypatch, weight_dtype, expert_dtype, bounds
):
    if weight_dtype == "int8" and not cpu_moe.dot_available():
        pytest.skip("int8 experts take the kernel only with AVX512-BF16")
    folder, prompts, want_lp, want_top = moe_float32
    calls = []
    for name in ("expert_ffn", "expert_gemm"):  # the second argument: gate/up (or laid out: both)
        real = getattr(cpu_moe, name)
        monkeypatch.setattr(cpu_moe, name, _spy(real, name, calls))
    got_lp, got_top = _logprobs(folder, tokenizer, "bfloat16", prompts, weight_dtype)
    # the experts ran in the kernels, in that dtype: the prefills by the expert GEMM where it is built
    assert calls and {dt for _, dt in calls} == {expert_dtype}
    assert ("expert_gemm", expert_dtype) in calls or not cpu_moe.gemm_available()
    delta = (got_lp - want_lp).abs()
    agree = sum(a == b for a, b in zip(got_top, want_top)) / len(want_top)
    assert 0 < delta.mean() < bounds[0] and delta.max() < bounds[1], (delta.mean(), delta.max())
    assert agree >= bounds[2], agree


def _spy(real, name: str, calls: list):
    """``real`` recording ``(name, the experts' dtype)`` of each call in ``calls``."""

    def call(*a, **k):
        experts = a[1][0] if isinstance(a[1], tuple) else a[1]
        calls.append((name, experts.dtype))
        return real(*a, **k)

    return call
