"""Router units without a model: the HTTP layer against scripted fake workers (FastAPI TestClient),
and stop strings. (The registry, PD routing and the launcher's startup failure path:
tests/router/test_router_registry.py.)"""

from __future__ import annotations

import json

import pytest

from server.router.detok import TextStream
from tests.support.fake_worker import CAPACITY, PIECES, completion, sse_events


# ---- HTTP layer --------------------------------------------------------------------------------
def test_completion_and_usage(make_client):
    client, worker, ctx = make_client()
    r = completion(client, return_token_ids=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "".join(PIECES)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(body["choices"][0]["token_ids"])
    assert len(ctx.table) == 0 and worker.aborted == []


def test_batch_prompts_run_concurrently(make_client):
    client, worker, _ = make_client()
    r = completion(client, prompt=["a", "b", "c"], max_tokens=3)
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert len(worker.requests) == 3 and r.json()["usage"]["completion_tokens"] == 9


def test_api_key(make_client):
    client, _, _ = make_client(api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = completion(client, headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers=headers).status_code == 401
    assert completion(client, {"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_body_limit(make_client):
    client, worker, _ = make_client(max_body_bytes=2048)
    r = completion(client, prompt="x" * 4000)
    assert r.status_code == 413 and "2048 bytes" in r.json()["error"]["message"]

    def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}'

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and worker.requests == []


@pytest.mark.parametrize(
    "status,msg", [(500, "KV cache pool is too small for this request"), (400, "prompt (5 tokens) exceeds something")]
)
def test_worker_error_is_passed_on(make_client, status, msg):
    client, _, ctx = make_client({"error": (status, msg)})
    for stream in (False, True):
        r = completion(client, stream=stream)
        assert r.status_code == status and r.json()["error"]["message"] == msg
    assert len(ctx.table) == 0


def test_router_checks_capacity_before_sending(make_client):
    client, worker, _ = make_client()
    r = completion(client, max_tokens=CAPACITY)
    assert r.status_code == 400 and f"KV cache pool capacity of {CAPACITY} tokens" in r.json()["error"]["message"]
    assert worker.requests == []


def test_unreachable_worker_is_503(make_client):
    client, _, ctx = make_client({"unreachable": True})
    r = completion(client)
    assert r.status_code == 503 and "not accepting" in r.json()["error"]["message"]
    assert len(ctx.table) == 0


def test_timeout_aborts_in_worker(make_client):
    client, worker, ctx = make_client({"hang": True}, request_timeout_s=0.3)
    r = completion(client)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert worker.aborted == [worker.requests[0][0]] and len(ctx.table) == 0


def test_chat_stream_shape_and_stop_string(make_client):
    client, worker, _ = make_client()
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stop": ["capital of"],
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == " Paris is the "
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 4
    assert worker.aborted == [worker.requests[0][0]]  # the stop string ended it in the worker too


def test_validation_and_model_errors(make_client):
    client, _, _ = make_client()
    r = completion(client, temperature=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = completion(client, model="other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1, "max_tokens": 2},
    )
    lp = r.json()["choices"][0]["logprobs"]["content"]
    assert len(lp) == 2 and lp[0]["top_logprobs"][0]["logprob"] == -0.5
    assert client.get("/nope").json()["error"]["type"] == "not_found_error"


def test_metrics_exposition(make_client):
    client, _, _ = make_client()
    completion(client)
    completion(client, max_tokens=0)
    text = client.get("/metrics").text
    for needle in (
        'pdserve_requests_total{status="200"} 1.0',
        'pdserve_requests_total{status="400"} 1.0',
        "pdserve_ttft_seconds_count 1.0",
        'pdserve_kv_pool_pages{state="used",worker="w0"} 0.0',
        'pdserve_retractions_total{worker="w0"}',
        'pdserve_worker_up{role="colocated",worker="w0"} 1.0',
    ):
        assert needle in text


def test_health_503_while_worker_silent(make_client):
    client, _, _ = make_client({"silent": True})
    r = client.get("/health")
    assert r.status_code == 503 and "waiting for its first heartbeat" in r.json()["workers"]
    r = completion(client)
    assert r.status_code == 503 and "no worker available" in r.json()["error"]["message"]


# ---- stop strings --------------------------------------------------------------------------------
def test_text_stream_stop_across_tokens(tokenizer):
    ids = [tokenizer.encode(p) for p in PIECES]
    s = TextStream(tokenizer, stop=["the capital"])
    out = "".join(s.push(i) for i in ids[:4])
    assert s.stopped and out == " Paris is "
    assert s.push(ids[4]) == "" and s.finish() == ""
    s = TextStream(tokenizer, stop=["nowhere", ""])
    out = "".join(s.push(i) for i in ids) + s.finish()
    assert out == "".join(PIECES) and not s.stopped
