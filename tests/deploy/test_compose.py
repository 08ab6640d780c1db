"""``make test-deploy``: the shipped ``docker/compose.yaml`` (two routers finding prefill and
decode containers through compose's DNS, KV over UCX/TCP between them) brought up from the
``pdserve:latest`` image (``PDSERVE_IMAGE`` picks another).

In order: routes to every container go through the project's bridge; greedy outputs through each
of the two routers equal the colocated engine's; ``--scale decode=2`` adds a worker that both
routers list without any edit and that serves a completion; 16 concurrent requests against small
decode pools retract and still equal it; the busiest decode container crashing (its main process
SIGKILLed, as an OOM kill would) fails only its own requests, fast, while the other decode worker
keeps serving, and comes back through its restart policy and serves; ``docker kill`` stops a
container for good (Docker never restarts a container it was told to kill), the rest keep serving,
``docker start`` brings it back. ``docker-compose down -v`` runs at the end whatever happened, and
nothing of the project is left. Timings are printed (``-s``), never asserted.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import openai
import pytest

from bench.harness.subprocess_server import free_port, fresh_metrics, metric_sum, scrape_metrics, wait_idle
from tests.deploy.compose_stack import ComposeStack, sh
from tests.support.models import engine_cfg, sched_cfg, strip_eos
from tests.support.stream_client import Outcome, stream_one

pytestmark = [pytest.mark.process, pytest.mark.slow]

SERVICES = ["prefill", "decode", "router", "router-b"]
LONG = 128  # output tokens of the streams a decode replica is lost under (still running at the loss)
# Small decode pools so 16 requests overcommit them; low initial reservation so admission
# overcommits and the decode workers must retract.
OVERRIDE = """
x-env: &env
  UCX_TLS: tcp
  UCX_NET_DEVICES: eth0
  PDSERVE_KV_POOL_TOKENS: "384"
  PDSERVE_MAX_MODEL_LEN: "384"
  PDSERVE_INIT_NEW_TOKEN_RATIO: "0.05"
  PDSERVE_HEALTH_INTERVAL_S: "0.5"
  # decode-side liveness of prefill peers is measured between scheduler steps; under retraction on a
  # loaded 2-core box a step ran past 8 s and the peer was declared dead (worker side)
  PDSERVE_PEER_TIMEOUT_S: "30"
  PDSERVE_LOG_LEVEL: WARNING
  # the exact mode the colocated reference runs in: containers get only the environment listed here,
  # not the test session's PDSERVE_DTYPE, and --dtype auto would run the workers in bfloat16
  PDSERVE_DTYPE: float32
services:
""" + "".join(f"  {s}: {{environment: *env}}\n" for s in SERVICES)
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", 'def add(a, b):\n    """Add two numbers."""\n']
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

ESSAY = "Write a long, detailed essay of at least ten paragraphs. Topic: "
TOPICS = [
    "why the sky is blue",
    "who built the pyramids",
    "photosynthesis",
    "Mount Everest",
    "the fall of the Roman Empire",
    "how volcanoes form",
    "what causes tides",
    "why leaves change color",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = ComposeStack(OVERRIDE, free_port(), free_port(), tmp_path_factory.mktemp("compose"))
    try:
        t0 = time.monotonic()
        s.up()
        t_up = time.monotonic() - t0
        s.verify_routes(SERVICES)
        t_health = t_up + s.wait_healthy()
        s.wait_healthy(url=s.url_b)
        t_first = t_health + first_request(s.url)
        print(
            f"\n[deploy] compose up -d (workers healthy, router started): {t_up:.1f}s; router healthy: "
            f"{t_health:.1f}s; first served request: {t_first:.1f}s after up"
        )
        yield s
    finally:
        s.down()
        left = s.leftovers()
        assert left == [], f"compose down -v left: {left}"


def first_request(url: str) -> float:
    t0 = time.monotonic()
    c = client(url)
    c.completions.create(model=c.models.list().data[0].id, prompt="Hi", max_tokens=1, temperature=0)
    return time.monotonic() - t0


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=300,
        http_client=httpx.Client(trust_env=False, timeout=300),
    )


def aclient(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=300,
        http_client=httpx.AsyncClient(trust_env=False, timeout=300),
    )


@pytest.fixture(scope="module")
def colocated(embedded):
    from engine.llm import LLM

    cfg, weights, tok, _ = embedded
    return LLM(engine_cfg(kv_pool_tokens=8192), sched_cfg(), loaded=(cfg, weights, tok))


def reference(colocated, tok, prompt: str, n: int) -> list[int]:
    from engine.sampling import SamplingParams

    return colocated.generate_ids([tok.encode(prompt)], SamplingParams(max_new_tokens=n, temperature=0))[0].token_ids


def references(colocated, tok, prompts: list[str], lengths: list[int]) -> list[list[int]]:
    """Colocated greedy outputs of all prompts in one batch (batching does not change them)."""
    from engine.sampling import SamplingParams

    res = colocated.generate_ids(
        [tok.encode(p) for p in prompts], [SamplingParams(max_new_tokens=n, temperature=0) for n in lengths]
    )
    return [r.token_ids for r in res]


def test_greedy_outputs_through_both_routers_equal_colocated(stack, colocated, embedded):
    for url in (stack.url, stack.url_b):
        c = client(url)
        model = c.models.list().data[0].id
        for text in PROMPTS:
            r = c.completions.create(
                model=model, prompt=text, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
            )
            got = strip_eos(r.choices[0].token_ids, embedded[2].eos_token_ids)  # the API returns the EOS, as vLLM
            assert got == reference(colocated, embedded[2], text, 24), (url, text)
    # the image's base has gcc: every worker built the C decode kernel for its CPU at start-up
    for worker in ("prefill", "decode"):
        built = stack.compose("exec", "-T", worker, "ls", "/home/pdserve/.cache/pdserve/kernels", check=False)
        assert ".so" in built, (worker, built)


def dns_id(info: dict) -> str:
    """The id a router gives a worker it found through DNS: ROLE@ADDRESS."""
    return f"{info['Config']['Labels']['com.docker.compose.service']}@{ComposeStack.address(info)}"


def test_scaling_decode_to_two_is_seen_by_both_routers_without_an_edit(stack):
    (first,) = stack.containers("decode")
    t0 = time.monotonic()
    stack.compose("up", "-d", "--no-recreate", "--no-build", "--scale", "decode=2")
    infos = stack.containers("decode")
    assert len(infos) == 2 and infos[0]["Id"] == first["Id"], "the running decode replica must be kept"
    new = dns_id(infos[1])
    for url in (stack.url, stack.url_b):  # both routers' DNS watches list the new replica, ready
        stack.wait_healthy(url=url, listing=f"{new} (decode): ready")
    print(f"\n[deploy] --scale decode=2: both routers route to {new} {time.monotonic() - t0:.1f}s after up")
    served_by_new_process(stack.url_b, new)


def test_16_concurrent_requests_retract_and_still_match(stack, colocated, embedded):
    tok = embedded[2]
    rng = random.Random(3)
    # essays run to max_tokens (the short answers above end at an EOS after 6-40 tokens, and spread
    # over the scale test's two decode workers they once stayed under both pools: 0 retractions)
    prompts = [ESSAY + TOPICS[i % len(TOPICS)] + "." + " " * (i // len(TOPICS)) for i in range(16)]
    lengths = [rng.choice([64, 80, 96]) for _ in prompts]  # ~1,600 tokens into two decode pools of 384
    refs = references(colocated, tok, prompts, lengths)
    before = metric_sum(wait_idle(stack.url, 0.5), "pdserve_retractions_total")

    async def run_all():
        c = aclient(stack.url)
        model = (await c.models.list()).data[0].id

        async def one(p, n):
            r = await c.completions.create(
                model=model, prompt=p, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
            )
            return r.choices[0].token_ids

        try:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))
        finally:
            await c.close()

    eos = embedded[2].eos_token_ids
    assert [strip_eos(ids, eos) for ids in asyncio.run(run_all())] == refs
    m = wait_idle(stack.url, 0.5, timeout_s=60)
    assert metric_sum(m, "pdserve_retractions_total") > before
    assert metric_sum(m, "pdserve_kv_pool_pages", state="used") == 0


async def load_while(url: str, action, n: int = 8, max_tokens: int = 64, choose=None) -> list[tuple[Outcome, float]]:
    """``n`` concurrent streamed requests; ``action()`` runs once every one has streamed a token (so
    none can be retried on a fresh pair: the router retries only before a first token); with
    ``choose``, ``action(choose())``, where ``choose`` runs before the clock starts.
    [(outcome, seconds from the action until that request ended)]."""
    first = [asyncio.Event() for _ in range(n)]
    limits = httpx.Limits(max_connections=n + 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits, trust_env=False) as c:
        tasks = [
            asyncio.create_task(stream_one(c, f"{SHARED}{q}", max_tokens, i, first[i]))
            for i, q in enumerate(QUESTIONS[:n])
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 240)
        chosen = choose() if choose is not None else None
        t_action = time.monotonic()
        action() if choose is None else action(chosen)
        return [(o, o.t_end - t_action) for o in await asyncio.gather(*tasks)]


def check_split(results: list[tuple[Outcome, float]], max_tokens: int = 64) -> None:
    """No request fails: the killed worker's requests (already streaming) fail over to the other
    decode worker and continue (``--max-failovers``, on by default), so every request gets all its
    tokens, within 60 s of the kill."""
    errors = [(o.error, round(t, 1)) for o, t in results if o.error]
    assert errors == [], "a request failed although the other decode worker could continue it"
    assert all(len(o.tokens) == max_tokens for o, _ in results), [len(o.tokens) for o, _ in results]
    assert max(t for _, t in results) < 60, [round(t, 1) for _, t in results]


def hello(url: str) -> str:
    c = client(url)
    r = c.completions.create(
        model=c.models.list().data[0].id, prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].text


def served_by_new_process(url: str, worker: str, attempts: int = 5) -> None:
    """Concurrent requests until ``worker``'s finished-requests counter, which a restarted process
    starts at 0, counts one: the new process itself serves (not only the other decode worker)."""
    for _ in range(attempts):

        async def four():
            c = aclient(url)
            model = (await c.models.list()).data[0].id
            try:
                await asyncio.gather(
                    *(
                        c.completions.create(model=model, prompt=f"Hello {i}", max_tokens=8, temperature=0)
                        for i in range(4)
                    )
                )
            finally:
                await c.close()

        asyncio.run(four())
        if metric_sum(fresh_metrics(url, 0.5), "pdserve_worker_finished_requests_total", worker=worker) >= 1:
            return
    raise AssertionError(f"{worker} served none of {4 * attempts} requests after its restart")


def two_decodes(stack) -> list[dict]:
    infos = stack.containers("decode")
    assert len(infos) == 2, "test_scaling_decode_to_two... runs first and leaves two decode replicas"
    return infos


def busiest_decode(url: str, infos: list[dict]) -> dict:
    """Of the decode replicas ``infos``, the one holding the most KV in the router's latest
    heartbeats (one scrape, no wait: it runs between the first tokens and the action): the one
    whose loss fails requests in flight, whichever replica the routers picked for them."""
    m = scrape_metrics(url)
    return max(infos, key=lambda i: metric_sum(m, "pdserve_kv_pool_pages", worker=dns_id(i), state="used"))


def test_crashed_decode_container_fails_fast_and_restart_policy_brings_it_back(stack):
    infos, crashed = two_decodes(stack), {}

    def choose() -> dict:
        crashed["info"] = busiest_decode(stack.url, infos)
        return crashed["info"]

    check_split(
        asyncio.run(
            load_while(
                stack.url, lambda i: os.kill(int(i["State"]["Pid"]), signal.SIGKILL), max_tokens=LONG, choose=choose
            )
        ),
        max_tokens=LONG,
    )
    info, restarts = crashed["info"], crashed["info"]["RestartCount"]
    t0 = time.monotonic()
    while (info := stack.inspect(info["Id"]))["RestartCount"] == restarts:
        assert time.monotonic() - t0 < 60, "the restart policy did not restart the decode container"
        time.sleep(0.5)
    worker = dns_id(info)  # docker may give the restarted container another address: DNS follows it
    back = stack.wait_healthy(listing=f"{worker} (decode): ready")
    print(f"\n[deploy] {worker} crashed and restarted; router healthy again after {back:.1f}s more")
    served_by_new_process(stack.url, worker)


def test_docker_kill_stops_decode_for_good_until_started_again(stack):
    infos, killed = two_decodes(stack), {}

    def choose() -> str:
        killed["cid"] = busiest_decode(stack.url, infos)["Id"]
        return killed["cid"]

    check_split(
        asyncio.run(load_while(stack.url, lambda cid: sh("docker", "kill", cid), max_tokens=LONG, choose=choose)),
        max_tokens=LONG,
    )
    cid = killed["cid"]
    assert stack.inspect(cid)["State"]["Status"] == "exited"  # a manual stop: no restart policy
    hello(stack.url)  # the other decode replica alone serves
    sh("docker", "start", cid)
    stack.wait_healthy(listing=f"{dns_id(stack.inspect(cid))} (decode): ready")
    m = wait_idle(stack.url, 0.5, timeout_s=60)
    assert metric_sum(m, "pdserve_kv_pool_pages", state="used") == 0
    assert metric_sum(m, "pdserve_host_kv_pool_bytes", state="used") == 0
