"""PD mode end to end: ``pdserve launch --mode pd`` (router + prefill worker + decode worker as
separate processes, KV over UCX on loopback through NIXL and through ucxx: one server per data
plane), driven through the real HTTP API with the ``openai`` client. Greedy outputs equal
transformers and the colocated engine; 32 concurrent requests with shared prefixes against a small
decode pool; aborts at random points leak nothing; kill -9 of either worker fails its requests fast,
keeps the router up, and traffic flows again after the launcher restarts it. The cases the data
plane does not change (request fields, the prefill worker's death) run over NIXL only. These share
one server per data plane and run in file order."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from bench.harness.subprocess_server import LaunchedServer, metric_sum, wait_idle
from engine.llm import LLM
from tests.support.models import engine_cfg, sched_cfg, strip_eos
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.process

HEARTBEAT_S = 0.2
NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    'def add(a, b):\n    """Add two numbers."""\n',
    "List three primary colors and explain why they are called primary:",
]
SHARED = (
    "You are a helpful assistant that answers questions about geography, history and science "
    "in one short paragraph. Question: "
)
QUESTIONS = [
    "Why is the sky blue?",
    "Who built the pyramids?",
    "What is photosynthesis?",
    "Where is Mount Everest?",
    "When did the Roman Empire fall?",
    "How do volcanoes form?",
    "What causes tides?",
    "Why do leaves change color?",
]
# after SHARED and a question: the 32-request case's private pages (the decode worker shares SHARED's
# full page among every request it holds, so the pool pressure must come from what follows it)
TAIL = (
    " Answer for a curious student in two plain sentences: first the main cause, then one concrete example "
    "that a twelve-year-old could check at home."
)


@pytest.fixture(scope="module", params=["nixl", "ucxx"])
def server(request, launched_server):
    """One launched PD server per KV data plane; every test below runs against each."""
    srv = launched_server(
        "pd",
        "--transfer-backend",
        request.param,
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
        "30",
        "--peer-timeout-s",
        "4",
        "--log-level",
        "WARNING",
    )
    yield srv
    launched_server.stop(srv)  # one backend's server at a time: stopped before the next param's starts


@pytest.fixture
def nixl_only(request):
    """Runs the test over NIXL only: a case about request fields (sampling, logprobs, grammar, bias,
    cache accounting) or a fault the data plane does not see; the data planes' own cases run on both."""
    if request.node.callspec.params["server"] != "nixl":
        pytest.skip("the KV data plane does not change this case: it runs over NIXL")


@pytest.fixture(scope="module")
def url(server):
    return server.url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def colocated(embedded):
    cfg, weights, tok, _ = embedded
    return LLM(engine_cfg(kv_pool_tokens=8192), sched_cfg(), loaded=(cfg, weights, tok))


def complete(client, model, prompt, max_tokens=NEW_TOKENS):
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"return_token_ids": True}
    )
    return r.choices[0]


def worker_pid(server: LaunchedServer, role: str) -> int:
    for pid in server.worker_pids():
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--role" in cmd and cmd[cmd.index(b"--role") + 1] == role.encode():
            return pid
    raise LookupError(f"no {role} worker")


def idle(url):
    return wait_idle(url, HEARTBEAT_S, timeout_s=60)


@pytest.fixture(scope="module")
def greedy_refs(embedded, hf_embedded, colocated) -> dict[str, list[int]]:
    """transformers' greedy continuation of each of ``PROMPTS`` (EOS dropped), asserted equal to the
    colocated engine's; computed once for both data planes (it does not depend on the server)."""
    tok, refs = embedded[2], {}
    for text in PROMPTS:
        ids = tok.encode(text)
        with torch.no_grad():
            out = hf_embedded.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        refs[text] = [t for t in out[0, len(ids) :].tolist() if t not in tok.eos_token_ids]
        colo = colocated.generate_ids([ids], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))[0]
        assert colo.token_ids == refs[text], text
    return refs


def test_pd_greedy_matches_transformers_and_colocated(client, model, embedded, greedy_refs):
    tok = embedded[2]
    for text in PROMPTS:
        ref = greedy_refs[text]
        choice = complete(client, model, text)
        assert choice.prompt_token_ids == tok.encode(text)
        assert strip_eos(choice.token_ids, tok.eos_token_ids) == ref, text
        assert choice.text == tok.decode(ref)


def test_pd_long_prompt_matches_colocated(client, model, embedded, colocated):
    """A ~280-token prompt (17+ float32 pages of 16, 13 MB): its KV lands in one write of 8 MiB or
    more, which over ucxx the decode worker pulls on its copy lanes (``--ucxx-copy-lanes``, default
    2: page i on lane i % 2, transfer/ucxx_lanes.py); the greedy tokens equal the colocated engine's."""
    text = " ".join(f"{q}{TAIL}" for q in QUESTIONS)
    ids = embedded[2].encode(text)
    assert len(ids) >= 8 * 16 + 16
    colo = colocated.generate_ids([ids], SamplingParams(max_new_tokens=16, temperature=0))[0]
    choice = complete(client, model, text, max_tokens=16)
    assert strip_eos(choice.token_ids, embedded[2].eos_token_ids) == colo.token_ids and colo.token_ids


@pytest.mark.usefixtures("nixl_only")
def test_pd_seeded_sampling_equals_colocated(client, model, embedded, colocated):
    # the sampler state must carry over the handoff: with a fresh one in the decode worker,
    # temperature=1, seed=7 gave [2684, 282, ...] colocated and [2684, 2422, ...] in PD
    ids = embedded[2].encode(PROMPTS[0])
    r = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=24, temperature=1.0, seed=7, extra_body={"return_token_ids": True}
    )
    colo = colocated.generate_ids([ids], SamplingParams(max_new_tokens=24, temperature=1.0, seed=7))[0]
    got = strip_eos(r.choices[0].token_ids, embedded[2].eos_token_ids)
    assert got == colo.token_ids and len(colo.token_ids) > 2


@pytest.mark.usefixtures("nixl_only")
def test_pd_prompt_logprobs_equal_transformers_and_n_choices(client, model, url, embedded, hf_embedded):
    """Prompt logprobs computed by the prefill worker (echo + logprobs + max_tokens=0, and the
    prompt_logprobs field) equal transformers' log-softmax: a one-token request that the prefill
    worker answers itself, no KV written; n=2 greedy choices are equal in PD."""
    before = idle(url)
    ids = embedded[2].encode(PROMPTS[0])
    with torch.no_grad():
        ref = hf_embedded(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    want = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
    r = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1, extra_body={"prompt_logprobs": 2}
    )
    (c,) = r.choices
    assert c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    pl = c.model_extra["prompt_logprobs"]
    assert pl[0] is None and [e[str(t)]["logprob"] for e, t in zip(pl[1:], ids[1:])] == pytest.approx(want, abs=2e-3)
    after = idle(url)
    for series, moved in (("pdserve_prefill_direct_answers_total", 1), ("pdserve_kv_transfer_seconds_count", 0)):
        assert metric_sum(after, series) - metric_sum(before, series) == moved, series
    two = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, n=2)
    assert [x.index for x in two.choices] == [0, 1] and two.choices[0].text == two.choices[1].text


@pytest.mark.usefixtures("nixl_only")
def test_pd_structured_output_continues_on_the_decode_worker(client, model):
    """The prefill worker masks the first token, the decode worker replays it into its own matcher
    and goes on: the JSON is valid against the schema (greedy and sampled)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for seed in (None, 5):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "A person as JSON."}],
            max_tokens=48,
            temperature=0 if seed is None else 1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


@pytest.mark.usefixtures("nixl_only")
def test_pd_logit_bias_reaches_prefill_and_decode(client, model):
    # token 0 is sampled on the prefill worker, the rest on the decode worker: both apply the bias
    r = client.completions.create(
        model=model,
        prompt=PROMPTS[1],
        max_tokens=5,
        temperature=0,
        logit_bias={"1234": 100},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert r.choices[0].token_ids == [1234] * 5


@pytest.mark.usefixtures("nixl_only")
def test_pd_cached_prompt_tokens_count_the_decode_radix_hits(client, model, url):
    # the counter must include the decode radix cache's hits, not only the prefill worker's. Its
    # own prefix: SHARED in the caches would take the pressure off the 32-request test below
    base = (
        "A lighthouse keeper on a remote island kept a journal of every ship that passed, every storm "
        "that broke against the rocks and every letter the supply boat brought. One winter"
    )
    complete(client, model, base, max_tokens=4)
    before = idle(url)
    r = client.completions.create(model=model, prompt=base + " Answer in one word.", max_tokens=4, temperature=0)
    cached = r.usage.prompt_tokens_details.cached_tokens
    after = idle(url)
    assert cached > 0 and decode_cached_tokens(after) - decode_cached_tokens(before) == cached


def decode_cached_tokens(m) -> float:
    """The decode workers' ``pdserve_cached_prompt_tokens_total`` (their radix hits) in scrape ``m``."""
    decode = [dict(lab)["worker"] for (n, lab) in m if n == "pdserve_worker_up" and dict(lab)["role"] == "decode"]
    return sum(metric_sum(m, "pdserve_cached_prompt_tokens_total", worker=w) for w in decode)


@pytest.fixture(scope="module")
def shared_prefix_case(embedded, colocated) -> tuple[list[str], list[int], dict[int, list[int]]]:
    """(32 prompts sharing ``SHARED``, their max_tokens, each one's colocated greedy output); computed
    once for both data planes, in one batch per max_tokens (greedy tokens do not depend on the batch
    a request runs in: the PD run below batches them its own way and must match). SHARED is one full
    page (shared on the decode worker once the first request's KV landed); each prompt differs from
    every other from its second page on and holds 3 pages of its own (about 60 tokens, page 16), so 32
    of them need 96 private pages of the 64-page decode pool before they decode a token."""
    tok = embedded[2]
    rng = random.Random(3)
    prompts = [f"{SHARED}[{i + 1}] {QUESTIONS[i % len(QUESTIONS)]}{TAIL}" for i in range(32)]
    lengths = [rng.choice([16, 32, 48]) for _ in prompts]
    refs = {}
    for n in sorted(set(lengths)):
        group = [i for i in range(32) if lengths[i] == n]
        outs = colocated.generate_ids(
            [tok.encode(prompts[i]) for i in group], SamplingParams(max_new_tokens=n, temperature=0)
        )
        refs.update((i, out.token_ids) for i, out in zip(group, outs))
    return prompts, lengths, refs


def test_pd_32_concurrent_shared_prefixes_small_pool(url, model, embedded, shared_prefix_case):
    tok = embedded[2]
    prompts, lengths, refs = shared_prefix_case

    async def one(c, i):
        r = await c.completions.create(
            model=model,
            prompt=prompts[i],
            max_tokens=lengths[i],
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        ids = []
        async for chunk in r:
            ids += getattr(chunk.choices[0], "token_ids", None) or []
        return ids

    async def run_all():
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(32)))
        finally:
            await c.close()

    before = idle(url)
    got = [strip_eos(ids, tok.eos_token_ids) for ids in asyncio.run(run_all())]
    assert got == [refs[i] for i in range(32)]
    m = idle(url)
    for series in (
        "pdserve_retractions_total",  # the decode pool holds ~1/3 of the demand
        "pdserve_kv_transfer_bytes_total",
    ):
        assert metric_sum(m, series) > metric_sum(before, series), series
    assert decode_cached_tokens(m) > decode_cached_tokens(before)  # SHARED's page matched on the decode worker
    assert metric_sum(m, "pdserve_kv_pool_pages", state="used") == 0
    assert metric_sum(m, "pdserve_host_kv_pool_bytes", state="used") == 0


def test_pd_aborts_at_random_points_leak_nothing(url, model):
    async def one(c, i, cut):
        try:
            r = await c.completions.create(
                model=model, prompt=f"{SHARED}{QUESTIONS[i % 8]}", max_tokens=48, temperature=0, stream=True
            )
            n = 0
            async for _ in r:
                n += 1
                if n >= cut:
                    break
            await r.close()
        except openai.APIError:
            pass

    async def run_all():
        rng = random.Random(5)
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            tasks = [asyncio.create_task(one(c, i, rng.choice([0, 1, 2, 5, 20]))) for i in range(16)]
            await asyncio.sleep(0.05)
            await asyncio.gather(*tasks)
        finally:
            await c.close()

    asyncio.run(run_all())
    m = idle(url)
    assert metric_sum(m, "pdserve_kv_pool_pages", state="used") == 0
    assert metric_sum(m, "pdserve_host_kv_pool_bytes", state="used") == 0


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_pd_worker_killed_then_restarted(request, server, url, client, model, role):
    """kill -9 of either worker under load: the requests it held fail fast with 503, the router stays
    up, and traffic flows again once the launcher restarted it. The decode worker's death is a write
    to a dead peer on each data plane; the prefill worker's is not seen by the plane (NIXL only)."""
    if role == "prefill":
        request.getfixturevalue("nixl_only")

    async def one(c, q):
        """(result or exception, monotonic time it ended)."""
        try:
            r = await c.completions.create(
                model=model, prompt=f"{SHARED}{q}", max_tokens=120, temperature=0, extra_body={"ignore_eos": True}
            )
        except Exception as e:  # noqa: BLE001 - the test inspects it
            r = e
        return r, time.monotonic()

    async def kill_during_load():
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            task = asyncio.gather(*(one(c, q) for q in QUESTIONS))
            await asyncio.sleep(1.5)
            t_kill = time.monotonic()
            os.kill(worker_pid(server, role), signal.SIGKILL)
            return await task, t_kill
        finally:
            await c.close()

    ended, t_kill = asyncio.run(kill_during_load())
    results = [r for r, _ in ended]
    errors = [r for r in results if isinstance(r, Exception)]
    if role == "decode":
        assert errors, "killing the decode worker mid-load must fail its in-flight requests"
    # a dead prefill worker fails only what it still held: requests already decoding complete
    assert all(isinstance(e, openai.APIStatusError) and e.status_code == 503 for e in errors), errors
    assert all(r.usage.completion_tokens == 120 for r in results if not isinstance(r, Exception))
    # every failure comes within 10 s of the kill (requests that go on decoding take what they take)
    assert all(t - t_kill < 10 for r, t in ended if isinstance(r, Exception)), [t - t_kill for _, t in ended]
    health = httpx.get(f"{url}/health", timeout=5)
    assert health.status_code in (200, 503)  # the router is up; 503 until the worker is back
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the restarted worker did not rejoin"
        time.sleep(0.5)
    choice = None
    for _ in range(20):  # the decode worker may still be re-handshaking with the new prefill worker
        try:
            choice = complete(client, model, PROMPTS[0], max_tokens=8)
            break
        except openai.APIStatusError:
            time.sleep(0.5)
    assert choice is not None and choice.finish_reason == "length" and len(choice.token_ids) == 8
    m = idle(url)
    assert metric_sum(m, "pdserve_kv_pool_pages", state="used") == 0
