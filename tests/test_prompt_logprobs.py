"""Prompt logprobs in the engine (tiny model): equal to transformers' log-softmax over the same
weights for every prompt token after the first, with the top-k and ranks; across chunked prefill,
with the prompt already in the radix cache (which must then not be used), colocated and through PD
(computed by the prefill worker, shipped in the manifest, sent once with the first token)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import engine_cfg, sched_cfg
from test_pd_inprocess import cfg as pd_cfg

from bench.harness.pd_harness import PDHarness
from engine.llm import run_batch
from engine.model_runner import ModelRunner
from engine.scheduler.colocated import ColocatedScheduler
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


# ---- the router's shapes, against scripted fake workers (tests/test_router_unit.py) -------------
from test_router_unit import completion, make_client, sse_events  # noqa: E402,F401 (fixture)


def test_echo_logprobs_max_tokens_0_is_the_prompt_alone(make_client, tokenizer):
    client, worker, ctx = make_client()
    prompt = "The capital of France"
    r = completion(client, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert r.status_code == 200, r.text
    (c,) = r.json()["choices"]
    ids = tokenizer.encode(prompt)
    assert c["text"] == prompt and c["finish_reason"] == "length"
    lp = c["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert lp["token_logprobs"] == [None] + [-float(j) for j in range(1, len(ids))]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {
        tokenizer.decode([ids[1]]): -1.0,
        tokenizer.decode([7]): -0.1,
    }
    assert lp["text_offset"][0] == 0
    assert r.json()["usage"]["completion_tokens"] == 0
    assert worker.requests[0][2].prompt_logprobs == 1 and len(ctx.table) == 0


def test_echo_logprobs_then_the_completion(make_client, tokenizer):
    client, _, _ = make_client()
    r = completion(client, prompt="The capital of France", echo=True, logprobs=0, max_tokens=2)
    n = len(tokenizer.encode("The capital of France"))
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == n + 2 and lp["token_logprobs"][n:] == [-0.5, -0.5]
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_prompt_logprobs_field_with_n(make_client, tokenizer):
    client, worker, _ = make_client()
    r = completion(client, prompt="The capital", prompt_logprobs=1, n=2, max_tokens=2)
    assert r.status_code == 200, r.text
    ids = tokenizer.encode("The capital")
    for c in r.json()["choices"]:
        pl = c["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(ids)
        assert pl[1][str(ids[1])] == {"logprob": -1.0, "rank": 2, "decoded_token": tokenizer.decode([ids[1]])}
        assert pl[1]["7"]["rank"] == 1
    assert [p.prompt_logprobs for _, _, p in worker.requests] == [1, None]  # the leader computes them once


def test_chat_prompt_logprobs_top_level_and_streamed(make_client):
    client, _, _ = make_client()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    r = client.post("/v1/chat/completions", json=body)
    pl = r.json()["prompt_logprobs"]
    assert pl[0] is None and all(len(e) == 1 for e in pl[1:]), pl
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    first = json.loads(sse_events(r.text)[0])
    assert first["prompt_logprobs"] == pl


def test_prompt_logprobs_out_of_range_is_400(make_client):
    client, worker, _ = make_client()
    r = completion(client, prompt_logprobs=21)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert worker.requests == []
