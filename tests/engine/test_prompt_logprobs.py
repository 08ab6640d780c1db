"""Prompt logprobs in the engine (tiny model): equal to transformers' log-softmax over the same
weights for every prompt token after the first, with the top-k and ranks; across chunked prefill,
with the prompt already in the radix cache (which must then not be used), colocated and through PD
(computed by the prefill worker, shipped in the manifest, sent once with the first token). The
router's response shapes: tests/router/test_prompt_logprobs_api.py."""

from __future__ import annotations

import pytest
import torch

from bench.harness.pd_harness import PDHarness
from engine.llm import run_batch
from engine.model_runner import ModelRunner
from engine.scheduler.colocated import ColocatedScheduler
from tests.support.models import engine_cfg, sched_cfg
from tests.support.pd import pd_cfg
from transfer.wire.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 2, 80, 41, 9, 9, 12, 60, 3, 71, 44, 18, 27, 90, 6, 1, 55], [7, 7, 21, 64, 30, 11]]
K = 3
ATOL = 2e-4


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]``: log-softmax at positions 0..n-2 (each scores the next token)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1)


def check(entries, ids: list[int], ref: torch.Tensor) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for j, (lp, top, rank) in enumerate(entries[1:]):
        row = ref[j]
        assert lp == pytest.approx(row[ids[j + 1]].item(), abs=ATOL)
        t = row[ids[j + 1]]
        assert int((row > t + ATOL).sum()) + 1 <= rank <= int((row > t - ATOL).sum()) + 1  # ties within tolerance
        vals, want = row.topk(K)
        assert [t for t, _ in top] == want.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=ATOL)


def test_colocated_chunked_and_cached_prompt(tiny):
    cfg, weights, hf = tiny
    runner = ModelRunner(engine_cfg(kv_pool_tokens=2048, page_size=4), cfg, weights)
    sched = ColocatedScheduler(runner, sched_cfg(chunked_prefill_size=8), (96,))
    plain = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    run_batch(sched, PROMPTS, [plain, plain])  # both prompts now sit in the radix cache
    asked = plain.model_copy(update={"prompt_logprobs": K})
    outs = run_batch(sched, PROMPTS, [asked, plain])
    check(outs[0].prompt_logprobs, PROMPTS[0], hf_prompt_logprobs(hf, PROMPTS[0]))
    assert outs[0].cached_tokens == 0 and outs[1].cached_tokens > 0  # the cache is skipped only when asked
    assert outs[1].prompt_logprobs is None
    assert outs[0].token_ids == run_batch(sched, PROMPTS[:1], [plain])[0].token_ids  # the output is unchanged
    sched.check_integrity()
    assert sched.kv.usage([]).used == 0


def test_pd_prefill_worker_computes_and_ships_them(tiny):
    h = PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1])
    try:
        for i, p in enumerate(PROMPTS):
            h.submit(f"r{i}", p, SamplingParams(max_new_tokens=4, temperature=0, prompt_logprobs=K if i == 0 else None))
        out = h.run()
        check(out["r0"]["prompt_logprobs"], PROMPTS[0], hf_prompt_logprobs(tiny[2], PROMPTS[0]))
        assert "prompt_logprobs" not in out["r1"]
        h.check_clean()
    finally:
        h.close()
