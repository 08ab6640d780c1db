"""Prompt logprobs at the router, against the scripted fake worker (tests/support/fake_worker.py):
``echo`` with ``logprobs`` (the prompt alone at ``max_tokens=0``, then the completion), vLLM's
``prompt_logprobs`` field with ``n`` (computed once, by the leader), in chat (top level and
streamed), and its range check. The engine's side: tests/engine/test_prompt_logprobs.py."""

from __future__ import annotations

import json

from tests.support.fake_worker import completion, sse_events


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
