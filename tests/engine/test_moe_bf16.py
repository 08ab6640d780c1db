"""A Qwen3-MoE folder served in bfloat16 (--dtype bfloat16), experts by the C kernel, against the
same folder in float32 (the exact mode, equal to transformers): prompt logprobs of random prompts
within bfloat16's tolerance and the top-1 tokens agreeing. Skipped where the CPU has no native
bfloat16 (the engine runs float32 there). Figures of this test's four prompts (40-61 tokens, each
prefill through the kernel) on the development host: mean |delta logprob| 0.050 (per prompt 0.020-0.092),
max 0.72, top-1 agreement 0.934; greedy prefixes 8, 16, 14, 11 of 16 (random weights over a
128-token vocabulary: many near-ties)."""

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


def _logprobs(folder, tokenizer, dtype: str, prompts: list[list[int]]):
    """(prompt logprobs after the first token, top-1 tokens) over all prompts, in ``dtype``."""
    ecfg = engine_cfg(dtype=dtype)
    cfg, weights = load_for_engine(folder, ecfg)
    llm = LLM(ecfg, sched_cfg(), loaded=(cfg, weights, tokenizer))
    assert llm.runner.dtype == getattr(torch, dtype)
    sp = SamplingParams(max_new_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True)
    # one prompt a step: each prefill is at most KERNEL_MAX_ROWS rows, so the prompt logprobs come
    # through the kernel too (a batched prefill of more rows takes the torch matmuls)
    outs = [run_batch(llm.scheduler, [p], [sp])[0] for p in prompts]
    llm.scheduler.check_integrity()
    entries = [e for o in outs for e in o.prompt_logprobs[1:]]
    return torch.tensor([e[0] for e in entries]), [e[1][0][0] for e in entries]


def test_bfloat16_experts_stay_close_to_float32(tmp_path, tokenizer, monkeypatch):
    save_small_model("qwen3_moe", tmp_path, **QWEN3_MOE)
    prompts = random_prompts(4, 40)
    assert max(map(len, prompts)) <= KERNEL_MAX_ROWS
    want_lp, want_top = _logprobs(tmp_path, tokenizer, "float32", prompts)
    calls = []
    real = cpu_moe.expert_ffn
    monkeypatch.setattr(cpu_moe, "expert_ffn", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    got_lp, got_top = _logprobs(tmp_path, tokenizer, "bfloat16", prompts)
    assert calls and set(calls) == {torch.bfloat16}  # the experts ran in the kernel, in bfloat16
    delta = (got_lp - want_lp).abs()
    agree = sum(a == b for a, b in zip(got_top, want_top)) / len(want_top)
    assert 0 < delta.mean() < 0.1 and delta.max() < 1.0, (delta.mean(), delta.max())
    assert agree >= 0.85, agree
