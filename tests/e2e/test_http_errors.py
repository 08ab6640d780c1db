"""Error paths of a real launched server: every error has its status, OpenAI's error shape and a
message naming the problem, and none leaves KV allocated. Ends with the worker going silent
(SIGSTOP: heartbeat timeout) and then dying (SIGKILL), so those tests run last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from bench.harness.subprocess_server import fresh_metrics, metric_sum, wait_idle

pytestmark = pytest.mark.process

HEARTBEAT_S = 0.2
WORKER_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 6.0
POOL, CONTEXT = 1024, 2048
LONG = {
    "prompt": "Count slowly:",
    "max_tokens": 450,
    "temperature": 0,
    "ignore_eos": True,
}  # two fit the pool (ignore_eos reserves all)
# LONG must outlast REQUEST_TIMEOUT_S on any host: one token per step (its greedy text repeats, so n-gram
# drafts would emit several) and a pause after each step, 450 steps of at least STEP_DELAY_S
STEP_DELAY_S = 0.03


@pytest.fixture(scope="module")
def server(launched_server):
    srv = launched_server(
        "colocated",
        "--kv-pool-tokens",
        str(POOL),
        "--max-model-len",
        str(CONTEXT),
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--worker-timeout-s",
        str(WORKER_TIMEOUT_S),
        "--request-timeout-s",
        str(REQUEST_TIMEOUT_S),
        "--speculative-method",
        "off",
        "--test-step-delay-s",
        str(STEP_DELAY_S),
        "--log-level",
        "WARNING",
    )
    yield srv
    for pid in srv.worker_pids():  # the SIGSTOP test may fail half way; launched_server stops it after this
        os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def url(server):
    return server.url


def post(url: str, path: str, body, timeout: float = 60.0) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{url}/v1/{path}", content=content, headers={"content-type": "application/json"}, timeout=timeout
    )


def assert_error(r: httpx.Response, status: int, param: str | None, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    for n in needles:
        assert n in err["message"], err
    return err


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BAD_REQUESTS = [
    ("completions", b'{"prompt": "hi",', 400, None, ["not valid JSON"]),
    ("completions", b'["hi"]', 400, None, ["JSON object"]),
    ("completions", {"max_tokens": 4}, 400, "prompt", ["Field required"]),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", ["integer"]),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", ["number"]),
    ("completions", {"prompt": 5}, 400, "prompt", ["string", "list"]),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", [">= 1", "0"]),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature", [">= 0", "-0.5"]),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", ["(0, 1]", "1.5"]),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n", ["n must be in", "got 0"]),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 3, "stream": True}, 400, "best_of", ["cannot be streamed"]),
    ("completions", {"prompt": "hi", "bogus": 1}, 400, "bogus", ["unknown field"]),
    ("completions", {"prompt": [1, 10**6]}, 400, "prompt", ["token ids", "1000000"]),
    ("completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model", ["gpt-9"]),
    ("completions", {"prompt": "hi", "max_tokens": 1500}, 400, "max_tokens", ["1500", f"{POOL} tokens", "KV"]),
    (
        "completions",
        {"prompt": "hi", "max_tokens": 3000, "stream": True},
        400,
        "max_tokens",
        ["3000", f"{CONTEXT} tokens", "context"],
    ),
    ("completions", {"prompt": "hi", "logit_bias": {"the": 5}}, 400, "logit_bias", ["token ids", "'the'"]),
    ("completions", {"prompt": "hi", "logit_bias": {"99999999": 5}}, 400, "logit_bias", ["token ids", "99999999"]),
    ("completions", {"prompt": "hi", "logit_bias": {"7": 150}}, 400, "logit_bias", ["[-100, 100]"]),
    ("chat/completions", {"messages": []}, 400, "messages", ["at least 1"]),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", ["'user'"]),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", [">= 1"]),
    ("chat/completions", {**CHAT, "top_p": 2}, 400, "top_p", ["(0, 1]"]),
    ("chat/completions", {**CHAT, "max_tokens": 5000, "stream": True}, 400, "max_tokens", ["5000", "context"]),
]


@pytest.mark.parametrize("path,body,status,param,needles", BAD_REQUESTS)
def test_bad_request(url, path, body, status, param, needles):
    assert_error(post(url, path, body), status, param, *needles)


def test_openai_client_sees_errors(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="exceeds the KV cache pool capacity of 1024"):
        client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=1200, messages=[{"role": "user", "content": "hi"}]
        )


def test_unknown_route_has_error_shape(url):
    assert_error(httpx.get(f"{url}/v1/nothing"), 404, None, "/v1/nothing")


def test_request_timeout_aborts(url):
    out = {}

    def streamed():
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            out["stream"] = (r.status_code, [ln for ln in r.iter_lines() if ln.startswith("data: ")])

    t = threading.Thread(target=streamed)
    t.start()
    start = time.monotonic()
    r = post(url, "completions", LONG)
    t.join(60)
    assert REQUEST_TIMEOUT_S - 0.5 < time.monotonic() - start < REQUEST_TIMEOUT_S + 5
    assert_error(r, 504, None, "timed out", f"{REQUEST_TIMEOUT_S:g}s")
    status, events = out["stream"]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "timeout"
    wait_idle(url, HEARTBEAT_S)


def test_client_disconnect_non_stream_frees_kv(url):
    before = fresh_metrics(url, HEARTBEAT_S)
    with pytest.raises(httpx.ReadTimeout):
        post(url, "completions", LONG, timeout=1.0)
    m = wait_idle(url, HEARTBEAT_S)
    name = "pdserve_worker_aborted_requests_total"
    assert metric_sum(m, name) == metric_sum(before, name) + 1
    assert metric_sum(m, "pdserve_requests_total", status="499") >= 1


def test_errors_left_no_kv_and_were_counted(url):
    m = wait_idle(url, HEARTBEAT_S)
    assert metric_sum(m, "pdserve_kv_pool_pages", state="used") == 0
    assert metric_sum(m, "pdserve_inflight_requests") == 0
    assert metric_sum(m, "pdserve_requests_total", status="400") >= 15
    assert metric_sum(m, "pdserve_requests_total", status="504") >= 2


def test_silent_worker_fails_requests_with_503_then_recovers(server, url):
    (pid,) = server.worker_pids()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", post(url, "completions", LONG)))
    t.start()
    time.sleep(0.5)
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        t.join(WORKER_TIMEOUT_S + 3)
        assert time.monotonic() - stopped < WORKER_TIMEOUT_S + 2
        assert_error(out["r"], 503, None, "colocated-0", "no heartbeat")
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "no heartbeat" in health.json()["workers"]
        assert_error(post(url, "completions", {"prompt": "hi"}), 503, None, "no worker available")
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "worker did not come back"
        time.sleep(HEARTBEAT_S)
    wait_idle(url, HEARTBEAT_S)  # the router's abort reached the worker: its KV is free


def test_dead_worker_gives_503(server, url):
    (pid,) = server.worker_pids()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while (health := httpx.get(f"{url}/health")).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "exited with code -9" in health.json()["workers"]
    assert_error(post(url, "completions", {"prompt": "hi"}), 503, None, "exited with code -9")
