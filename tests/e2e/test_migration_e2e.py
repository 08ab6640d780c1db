"""Migration end to end: ``pdserve launch`` with 1 prefill + 2 decode worker processes,
KV over NIXL and over ucxx (one launch per backend; the host pool is registered with the backend
and the migration writes straight from it), the real model and HTTP API. ``--route-decode
decode-0`` sends every request to one decode worker whose small pool makes it retract; the prefill
worker is held (SIGSTOP) until decode-0 holds every request (admitted or waiting for pages), so the
requests decode together however slow this shared machine is, the admitted ones fill the pool and
their next pages must come from a retract (``--retract-test-interval`` adds a forced one every 16
decode steps); ``--migrate-after 2`` moves parked requests to decode-1. Every streamed request ends
with the colocated engine's greedy tokens (equal to transformers, tests/e2e/test_pd_http.py) and its
usage; a migration happened (metric); nothing is left in either worker's device or host pool.
On the NIXL launch the dashboard (``/dashboard`` in headless Chromium, open through the load) shows
one marker per migration: each worker's markers add up to its ``pdserve_migrations_total`` out and in,
and the panel's tiles equal ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import openai
import pytest

from bench.harness.subprocess_server import metric_sum, scrape_metrics, wait_idle
from tests.support.chromium_cdp import Browser, find_chromium
from tests.support.models import strip_eos
from tests.support.servers import worker_pid
from transfer.wire.sampling_params import SamplingParams

pytestmark = [pytest.mark.process, pytest.mark.slow]

HEARTBEAT_S = 0.2
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
# after SHARED and the question: every prompt's own pages. The decode worker shares SHARED's full page
# among the requests it holds (inserted when the first one's KV landed), so the pool pressure that
# parks requests long enough to be migrated comes from here: 3 pages of its own per prompt (about 57
# tokens, page 16), 8 prompts > the 24-page pool before a token is decoded
TAIL = (
    " Answer for a curious student in two plain sentences: first the main cause, then one concrete example "
    "that a twelve-year-old could check at home."
)
PROMPTS = [SHARED + q + TAIL for q in QUESTIONS]
NEW_TOKENS = 48
CHROMIUM = find_chromium()
# the counts on the migration markers of the panel's first chart (labels "⇢N" / "⇠N") of one worker
# (each marker's title starts with its worker's id)
MARKED = """(() => {{ const svg = document.querySelector('#migration svg');
  return svg ? [...svg.querySelectorAll('g.marker.migrate.{direction}')]
    .filter((g) => g.querySelector('title').textContent.startsWith('{worker}: '))
    .reduce((a, g) => a + Number(g.querySelector('text').textContent.slice(1)), 0) : 0; }})()"""
TILE = """(() => {{ const e = [...document.querySelectorAll('[data-metric=pdserve_migrations_total]')]
  .find((x) => x.dataset.labels === '{labels}'); return e ? Number(e.dataset.value) : null; }})()"""


def dashboard(url: str, backend: str):
    """A headless Chromium page on ``url``'s dashboard (the NIXL launch only, one browser per run), or
    None: on the ucxx launch, or without Chromium unless CI requires it (PDSERVE_REQUIRE_CHROMIUM=1)."""
    if backend != "nixl":
        return contextlib.nullcontext()
    if not CHROMIUM:
        assert os.environ.get("PDSERVE_REQUIRE_CHROMIUM") != "1", "chromium is not installed"
        return contextlib.nullcontext()
    return Browser(CHROMIUM)


def check_markers(page, m: dict) -> None:
    """Per decode worker and direction, the page drew markers worth its ``pdserve_migrations_total``
    (outcome done) in the metrics ``m``, and its tiles agree. A request moved to decode-1 may be
    retracted there and moved back, so decode-1 can have moves out too: each worker's markers count
    its own moves, never the other's."""
    for worker in ("decode-0", "decode-1"):
        for direction in ("out", "in"):
            moved = metric_sum(m, "pdserve_migrations_total", worker=worker, direction=direction, outcome="done")
            page.wait_for(f"{MARKED.format(direction=direction, worker=worker)} === {moved}", 15)
            labels = json.dumps({"direction": direction, "outcome": "done", "worker": worker}, separators=(",", ":"))
            page.wait_for(f"{TILE.format(labels=labels)} === {moved}", 15)
    assert page.errors() == []


@pytest.fixture(scope="module")
def refs(embedded):
    """The colocated engine's greedy tokens of every prompt (computed once for both launches)."""
    from engine.llm import LLM
    from tests.support.models import engine_cfg, sched_cfg

    tok = embedded[2]
    colocated = LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(), loaded=(embedded[0], embedded[1], tok))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    return [colocated.generate_ids([tok.encode(p)], params)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("backend", ["nixl", "ucxx"])
def test_skewed_load_migrates_retracted_requests(launched_server_per_test, embedded, refs, backend):
    """Over ucxx the peer's pool is twice the source's (``--worker-kv-pool-tokens``): migrations land
    in a pool of another size, whose pages the handshake's geometry places."""
    tok = embedded[2]
    prompts = PROMPTS
    pools = {"decode-0": 24, "decode-1": 48 if backend == "ucxx" else 24}  # pages of 16 tokens
    srv = launched_server_per_test(
        "pd",
        "--decode",
        "2",
        "--transfer-backend",
        backend,
        "--route-decode",
        "decode-0",
        "--worker-kv-pool-tokens",
        f"decode-1={pools['decode-1'] * 16}",
        "--migrate-after",
        "2",
        "--retract-test-interval",
        "16",
        "--kv-pool-tokens",
        "384",
        "--page-size",
        "16",
        "--max-model-len",
        "512",
        "--init-new-token-ratio",
        "0.05",
        "--host-kv-pool-gb",
        "0.25",
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--worker-timeout-s",
        "30",
        "--peer-timeout-s",
        "30",  # longer than prefill_held's hold: the held prefill worker is not declared dead
        # every prompt goes through the prefill worker: by the backlog rule of selective PD, the held
        # prefill worker's queue would have decode-0 prefill one itself, which then decodes alone
        "--local-prefill-backlog-ratio",
        "0",
        "--log-level",
        "WARNING",
    )
    wait_connected(srv.url)

    with dashboard(srv.url, backend) as browser:
        page = None
        if browser is not None:
            page = browser.open()
            page.navigate(f"{srv.url}/dashboard")
            page.wait_for("document.querySelectorAll('#migration-tiles .tile').length > 0", 30)
        with prefill_held(srv) as release:
            results = asyncio.run(stream_all(srv.url, prompts, NEW_TOKENS, until=lambda: release(len(prompts))))
        check_idle(srv.url, results, prompts, refs, tok, page)
    m = scrape_metrics(srv.url)
    assert {w: metric_sum(m, "pdserve_kv_pool_capacity_pages", worker=w) for w in pools} == pools
    if backend == "ucxx":  # prompt + 400 tokens fit decode-1's pool, not decode-0's: routed there, not refused
        assert 24 * 16 < results[0][1].prompt_tokens + 400 <= 48 * 16
        decoded = metric_sum(m, "pdserve_generation_tokens_total", worker="decode-1")
        first_token_then_close(srv.url, prompts[0], 400)
        m = wait_idle(srv.url, HEARTBEAT_S)
        assert metric_sum(m, "pdserve_generation_tokens_total", worker="decode-1") > decoded
        assert metric_sum(m, "pdserve_kv_pool_pages", worker="decode-1", state="used") == 0


def first_token_then_close(url: str, prompt: str, max_tokens: int) -> None:
    """A streamed greedy completion admitted for ``max_tokens``: its first token, then the stream
    closed (the router aborts the rest)."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    with c.completions.create(
        model=c.models.list().data[0].id, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    ) as stream:
        assert next(c.text for c in (chunk.choices[0] for chunk in stream if chunk.choices) if c.text)


def wait_connected(url: str, timeout_s: float = 30.0) -> None:
    """Before any request, each decode worker has handshaken its KV sources (the router's
    ``KVSources``): the prefill worker and the other decode worker."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url)
        ready = [metric_sum(m, "pdserve_kv_sources", worker=w, state="ready") for w in ("decode-0", "decode-1")]
        if ready == [2, 2]:
            return
        assert time.monotonic() < deadline, f"KV sources ready: {ready}, expected [2, 2]"
        time.sleep(HEARTBEAT_S)


@contextlib.contextmanager
def prefill_held(srv, timeout_s: float = 25.0):
    """prefill-0 stopped (SIGSTOP) inside the block, which gets ``release(n)``: wait until decode-0
    holds ``n`` requests (admitted and waiting for their KV, or waiting for pages), none decoding
    yet, then resume prefill-0. Whatever happens, prefill-0 runs again when the block ends. Held,
    prefill-0 computes no KV, so decode-0 admits every request before its first decode step, and
    the KV of the admitted ones lands within a prefill batch or two: they overlap on any host."""
    pid = worker_pid(srv, "prefill-0")

    def release(n: int) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                m = scrape_metrics(srv.url)
                held = {q: metric_sum(m, "pdserve_queue_requests", worker="decode-0", queue=q) for q in QUEUES}
                if held["prealloc"] + held["transfer"] == n and held["running"] == 0:
                    return
                assert time.monotonic() < deadline, f"decode-0 queues {held}: {n} requests not all held"
                time.sleep(HEARTBEAT_S)
        finally:
            os.kill(pid, signal.SIGCONT)

    os.kill(pid, signal.SIGSTOP)
    try:
        yield release
    finally:
        os.kill(pid, signal.SIGCONT)


QUEUES = ("prealloc", "transfer", "running", "local_prefill")


async def stream_all(url: str, prompts: list[str], max_tokens: int, until=None) -> list[tuple[list[int], object]]:
    """Every prompt streamed at once, greedy: ``(token ids, usage)`` per prompt, in order. ``until``
    (blocking, run on a thread once every request is sent off) gates the load, e.g.
    ``prefill_held``'s release."""
    c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await c.models.list()).data[0].id

    async def one(prompt):
        r = await c.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
        ids, usage = [], None
        async for chunk in r:
            if chunk.choices:
                ids += getattr(chunk.choices[0], "token_ids", None) or []
            usage = chunk.usage or usage
        return ids, usage

    tasks = [asyncio.ensure_future(one(p)) for p in prompts]
    try:
        if until is not None:
            await asyncio.to_thread(until)
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await c.close()


def check_idle(url, results, prompts, refs, tok, page) -> None:
    """Tokens, usage, metrics once idle and, when ``page`` is open, the dashboard's migration markers."""
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == refs
    assert all(u is not None and u.completion_tokens == len(ids) for ids, u in results)
    m = wait_idle(url, HEARTBEAT_S)
    assert metric_sum(m, "pdserve_retractions_total", worker="decode-0") > 0
    moved = metric_sum(m, "pdserve_migrations_total", worker="decode-0", direction="out", outcome="done")
    assert moved > 0
    assert metric_sum(m, "pdserve_migrations_total", worker="decode-1", direction="in", outcome="done") == moved
    assert metric_sum(m, "pdserve_migration_bytes_total", worker="decode-0") > 0
    assert metric_sum(m, "pdserve_migration_seconds_count", worker="decode-0") == moved
    assert metric_sum(m, "pdserve_requests_total", status="200") == len(prompts)
    for w in ("decode-0", "decode-1"):
        assert metric_sum(m, "pdserve_kv_pool_pages", worker=w, state="used") == 0
        assert metric_sum(m, "pdserve_host_kv_pool_bytes", worker=w, state="used") == 0
        assert metric_sum(m, "pdserve_worker_aborted_requests_total", worker=w) == 0
    back = metric_sum(m, "pdserve_migrations_total", worker="decode-1", direction="out", outcome="done")
    retracted = metric_sum(m, "pdserve_retractions_total", worker="decode-0")
    print(f"\ndecode-0: {retracted:g} retractions, {moved:g} moved to decode-1; {back:g} moved back")
    if page is not None:
        check_markers(page, m)


def test_skewed_load_moves_queued_requests_before_their_prefill(launched_server_per_test, embedded, refs):
    """``--migrate-queued``: every request pinned to decode-0, whose 24-page pool holds a few of them;
    the ones waiting there for pages longer than ``--migrate-after`` are re-routed to decode-1
    before their prefill (no KV to move). Every stream ends with the colocated engine's greedy
    tokens and its usage, the router counts the moves, every request finished once over the two
    decode workers (decode-1 some of them), nothing was aborted or failed, and both pools are empty
    once idle."""
    tok, new_tokens = embedded[2], 24  # a prefix of the references: the queue forms from the prompts' pages
    # a full new-token reservation (ratio 1.0) keeps the overflow waiting in the prealloc queue: with a
    # low ratio decode-0 admits it, retracts some and migrates those instead, and their KV takes the
    # room on decode-1 that the queued offers need
    srv = launched_server_per_test(
        "pd",
        "--decode",
        "2",
        "--route-decode",
        "decode-0",
        "--migrate-after",
        "0.2s",
        "--migrate-queued",
        "--kv-pool-tokens",
        "384",
        "--page-size",
        "16",
        "--max-model-len",
        "512",
        "--init-new-token-ratio",
        "1.0",
        "--host-kv-pool-gb",
        "0.25",
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--worker-timeout-s",
        "30",
        "--peer-timeout-s",
        "4",
        "--log-level",
        "WARNING",
    )

    results = asyncio.run(stream_all(srv.url, PROMPTS, new_tokens))
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == [r[:new_tokens] for r in refs]
    assert all(u is not None and u.completion_tokens == len(ids) for ids, u in results)
    m = wait_idle(srv.url, HEARTBEAT_S)
    moved = metric_sum(m, "pdserve_router_queued_moves_total")
    assert moved > 0
    assert metric_sum(m, "pdserve_requests_total", status="200") == len(PROMPTS)
    # each request finished once, on one of the two (a moved or migrated one may move again: both
    # decode workers offer what waits too long, so only the sum is exact), and decode-1 took some
    finished = [metric_sum(m, "pdserve_worker_finished_requests_total", worker=w) for w in ("decode-0", "decode-1")]
    assert sum(finished) == len(PROMPTS) and finished[1] > 0, finished
    for w in ("decode-0", "decode-1", "prefill-0"):
        assert metric_sum(m, "pdserve_kv_pool_pages", worker=w, state="used") == 0
        assert metric_sum(m, "pdserve_worker_aborted_requests_total", worker=w) == 0
