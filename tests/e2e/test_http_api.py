"""The OpenAI API of a real launched server (``pdserve launch``), driven by the ``openai`` client.

One server for the module (embedded model, 1024-token KV pool, low initial new_token_ratio so
admission overcommits and the 32-stream test forces retractions) and one ``pdserve generate``
batch run as the greedy reference, started in parallel.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

from bench.harness.subprocess_server import REPO_ROOT, fresh_metrics, metric_sum, wait_idle

pytestmark = pytest.mark.process

MAX_TOKENS = 40
CONCURRENT_MAX_TOKENS = 40
HEARTBEAT_S = 0.2
SUBJECTS = [
    "a lighthouse keeper",
    "a young baker",
    "an old sailor",
    "a clever fox",
    "a lonely robot",
    "a travelling musician",
    "a curious scientist",
    "a brave knight",
]
PROMPTS = [
    f"Here is a short story about {s}. Once upon a time, in a small village by the sea, there lived {s} who"
    for s in SUBJECTS
]
CHAT_QUESTION = "What is the capital of France? Answer in one sentence."


def _reference_cmd(prompts: list[str]) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "server.launch.cli",
        "generate",
        "--json",
        "--max-tokens",
        str(MAX_TOKENS),
        "--kv-pool-tokens",
        "4096",
        "--temperature",
        "0",
    ]
    for p in prompts:
        cmd += ["--prompt", p]
    return cmd


@pytest.fixture(scope="module")
def stack(tokenizer, launched_server):
    """(server url, {prompt text: pdserve generate result}) — server and reference run in parallel."""
    chat_text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}])
    ref = subprocess.Popen(
        _reference_cmd([*PROMPTS, chat_text]),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = launched_server(
            "colocated",
            "--kv-pool-tokens",
            "1024",
            "--page-size",
            "16",
            "--max-model-len",
            "2048",
            "--init-new-token-ratio",
            "0.05",
            "--health-interval-s",
            str(HEARTBEAT_S),
            "--worker-timeout-s",
            "60",  # a 32-request step is slow on a busy CPU
            "--log-level",
            "WARNING",
        ).url
        out, _ = ref.communicate(timeout=600)
        results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert ref.returncode == 0 and len(results) == len(PROMPTS) + 1, out
        refs = dict(zip([*PROMPTS, CHAT_QUESTION], results))
        yield url, refs
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.wait()


@pytest.fixture(scope="module")
def url(stack):
    return stack[0]


@pytest.fixture(scope="module")
def refs(stack):
    return stack[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def output_ids(ref: dict) -> list[int]:
    """The reference's tokens as the API returns and counts them: with the stop token (EOS) that
    ended it, as vLLM counts it (``pdserve generate`` leaves it out of ``token_ids``)."""
    stop = ref.get("stop_token_id")
    return ref["token_ids"] + ([stop] if stop is not None else [])


def fresh(url: str) -> dict:
    return fresh_metrics(url, HEARTBEAT_S)


def idle(url: str) -> dict:
    return wait_idle(url, HEARTBEAT_S)


# ---- tests ---------------------------------------------------------------------------------------
def test_models_and_health(url, client, model):
    assert [m.id for m in client.models.list().data] == [model]
    r = httpx.get(f"{url}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_matches_generate(client, model, refs):
    ref = refs[PROMPTS[0]]
    r = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    c = r.choices[0]
    assert c.token_ids == output_ids(ref) and c.prompt_token_ids == ref["prompt_token_ids"]
    assert c.text == ref["text"] and c.finish_reason == ref["finish_reason"]
    assert r.usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert r.usage.completion_tokens == len(output_ids(ref))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_logit_bias_bans_and_forces_tokens(client, model, refs):
    ref = refs[PROMPTS[0]]["token_ids"]

    def ids(bias):
        r = client.completions.create(
            model=model,
            prompt=PROMPTS[0],
            max_tokens=6,
            temperature=0,
            logit_bias=bias,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return r.choices[0].token_ids

    banned = ids({str(ref[0]): -100})
    assert banned[0] != ref[0] and ref[0] not in banned
    forced = 1234 if ref[0] != 1234 else 1235
    assert ids({str(forced): 100}) == [forced] * 6


def test_completion_stream_matches_generate(client, model, refs):
    ref = refs[PROMPTS[1]]
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref["finish_reason"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(output_ids(ref))


def test_batch_of_prompts_and_token_ids(client, model, refs, tokenizer):
    r = client.completions.create(model=model, prompt=PROMPTS[2:4], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [refs[p]["text"] for p in PROMPTS[2:4]]
    ids = refs[PROMPTS[4]]["prompt_token_ids"]
    r = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[4] + tokenizer.decode(refs[PROMPTS[4]]["token_ids"][:8])
    assert r.usage.completion_tokens == 8


def test_logprobs_shape(client, model, refs, tokenizer):
    ref = refs[PROMPTS[0]]
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ref["token_ids"][:5]]
    assert len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert all(max(top.values()) == pytest.approx(v, abs=1e-5) for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_stop_string_cuts_text_and_frees_kv(url, client, model, refs):
    text = refs[PROMPTS[5]]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    r = client.completions.create(model=model, prompt=PROMPTS[5], max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPTS[5], max_tokens=MAX_TOKENS, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    idle(url)


def test_chat_matches_generate(client, model, refs, tokenizer):
    ref = refs[CHAT_QUESTION]
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref["text"]
    assert c.token_ids == output_ids(ref) and c.finish_reason == ref["finish_reason"]
    assert ref["finish_reason"] == "stop" and c.token_ids[-1] in tokenizer.eos_token_ids  # ends on EOS: counted
    assert r.usage.completion_tokens == len(ref["token_ids"]) + 1
    assert r.usage.prompt_tokens == len(ref["prompt_token_ids"])


def test_chat_stream(client, model, refs):
    ref = refs[CHAT_QUESTION]
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": CHAT_QUESTION}],
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref["finish_reason"]] and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].usage.completion_tokens == len(output_ids(ref))


def test_disconnect_mid_stream_frees_kv(url, model):
    before = fresh(url)
    body = {
        "model": model,
        "prompt": PROMPTS[6],
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 3
    m = idle(url)
    aborted = "pdserve_worker_aborted_requests_total"
    assert metric_sum(m, aborted) == metric_sum(before, aborted) + 1
    assert metric_sum(m, "pdserve_requests_total", status="499") >= 1


def greedy_prefix(ref: dict, n: int, tokenizer) -> tuple[str, str]:
    """(text, finish reason) of the first ``n`` greedy tokens, from a longer reference run."""
    if len(ref["token_ids"]) < n:
        return ref["text"], ref["finish_reason"]
    return tokenizer.decode(ref["token_ids"][:n]), "length"


def test_32_concurrent_streams_with_retraction(url, model, refs, tokenizer):
    before = idle(url)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=CONCURRENT_MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, used = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            if c.usage:
                used = c.usage.completion_tokens
        return text, finish, used

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run_all())
    for p, (text, finish, _) in zip(prompts, results):
        assert (text, finish) == greedy_prefix(refs[p], CONCURRENT_MAX_TOKENS, tokenizer), p
    m = idle(url)
    delta = {
        k: metric_sum(m, k) - metric_sum(before, k)
        for k in ("pdserve_retractions_total", "pdserve_generation_tokens_total", "pdserve_oom_aborts_total")
    }
    assert delta["pdserve_retractions_total"] > 0
    assert delta["pdserve_oom_aborts_total"] == 0
    expected = sum(used for _, _, used in results)  # usage counts a sampled EOS, as the worker does
    assert delta["pdserve_generation_tokens_total"] == expected
    assert metric_sum(m, "pdserve_requests_total", status="200") >= 32
    assert metric_sum(m, "pdserve_inflight_requests") == 0
