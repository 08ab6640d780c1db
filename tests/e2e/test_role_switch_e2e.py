"""Live role switching end to end (``POST /admin/role``, ``server.router.roles``,
``server.worker.role_switch``): ``pdserve launch`` with 1 prefill + 2 decode worker processes, KV over
NIXL, the real model and HTTP API. Streams run on decode-1 (``--route-decode decode-1``, decode steps
slowed by ``--test-step-delay-s`` so they are still running); decode-1 switches to prefill while they
stream: its requests migrate to decode-0 and every stream ends with the colocated engine's greedy
tokens (equal to transformers, tests/e2e/test_pd_http.py), none failed. ``/health`` then lists
``decode-1 (prefill)``, a switch that would leave no decode worker is refused (409), new requests
prefill on both prefill workers, and decode-1 switches back (``pdserve role``) and decodes again. Each switch moves
``pdserve_role_switches_total`` by exactly one; no KV page or host buffer is left in use. The
dashboard, open in headless Chromium throughout, draws decode-1's role timeline: a prefill band
after a decode one, a switch marker each way, and role switch tiles equal to ``/metrics``.

Behind a prefill backlog: decode-1 waits for the KV of long prompts (their pages reserved) while
prefill-0 computes the first, longest, of them in small, slowed chunks; decode-1 switches to
prefill then. It waits for none of them, the one being computed included: each is handed back to the
router, which sends it to decode-0 without using a retry (``--fresh-pair-retries 0``: one that used
a retry would fail), prefill-0 computes the prompt under way into its radix cache and the re-send
hits it. Every request answers 200 with the greedy reference tokens, none moved from decode-1 by
migration (none landed there), and no KV page or host buffer is left in use."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum, scrape_metrics, wait_idle
from tests.e2e.test_migration_e2e import PROMPTS as MIGRATION_PROMPTS
from tests.e2e.test_migration_e2e import stream_all
from tests.router.dashboard_dom import dom_values
from tests.support.chromium_cdp import optional_browser
from tests.support.models import strip_eos
from tests.support.role_switch_launch import HEARTBEAT_S, greedy_refs, held, launch_switchable_pd

pytestmark = [pytest.mark.process, pytest.mark.slow]

NEW_TOKENS = 64
PROMPTS = MIGRATION_PROMPTS[:4]  # long greedy answers: still streaming when the switch comes


@pytest.fixture(scope="module")
def refs(embedded):
    return greedy_refs(embedded, PROMPTS, NEW_TOKENS)


# decode-1's role switch markers on the dashboard's role timeline, as "from>to"
MARKERS = """[...document.querySelectorAll('#roles g.role-switch[data-worker="decode-1"]')]
  .map((g) => `${g.dataset.from}>${g.dataset.to}`).join(',')"""
# the roles of decode-1's bands on the timeline, oldest first, repeats merged
BANDS = """[...document.querySelectorAll('#roles rect.band[data-worker="decode-1"]')].map((r) => r.dataset.role)
  .filter((r, i, a) => i === 0 || a[i - 1] !== r).join(',')"""


def role_tiles_differ(page, m: dict) -> list[str]:
    """The page's role switch tiles that differ from the /metrics samples ``m`` (none shown: one entry)."""
    shown = [(n, lab, v) for n, lab, v in dom_values(page)[0] if n == "pdserve_role_switches_total"]
    bad = [] if shown else ["no role switch tile"]
    for n, labels, value in shown:
        want = metric_sum(m, n, **json.loads(labels))
        if float(value) != want:
            bad.append(f"{n}{labels}: page {value} != /metrics {want}")
    return bad


def switches(m: str, old: str, new: str) -> float:
    return metric_sum(m, "pdserve_role_switches_total", **{"from": old, "to": new, "reason": "admin"})


def switch(url: str, worker: str, role: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/role", json={"worker": worker, "role": role}, timeout=300, trust_env=False)


def health(url: str) -> str:
    return httpx.get(f"{url}/health", timeout=10, trust_env=False).text


async def switch_under_load(srv, worker: str, role: str) -> tuple[list, httpx.Response]:
    """Stream every prompt; once ``worker`` streamed tokens of each (they are in its running batch),
    switch it to ``role``. (the streams' results, the switch's answer)."""
    streams = asyncio.ensure_future(stream_all(srv.url, PROMPTS, NEW_TOKENS))
    deadline = time.monotonic() + 120
    while True:
        m = await asyncio.to_thread(scrape_metrics, srv.url)
        if metric_sum(m, "pdserve_generation_tokens_total", worker=worker) >= 2 * len(PROMPTS):
            break
        assert not streams.done(), streams.result()
        assert time.monotonic() < deadline, f"{worker} streamed nothing: {srv.log()[-3000:]}"
        await asyncio.sleep(HEARTBEAT_S)
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        r = await client.post(f"{srv.url}/admin/role", json={"worker": worker, "role": role})
    return await streams, r


def test_decode_worker_switches_to_prefill_under_load_and_back(launched_server_per_test, embedded, refs):
    tok = embedded[2]
    srv = launch_switchable_pd(
        launched_server_per_test,
        "--route-decode",
        "decode-1",
        "--test-step-delay-s",
        "0.05",  # the streams are still running when the switch comes
    )
    url = srv.url
    before = wait_idle(url, HEARTBEAT_S)
    assert switches(before, "decode", "prefill") == 0
    with optional_browser() as b:
        page = None
        if b is not None:  # without Chromium (and not required): the switches are checked, not the page
            page = b.open()
            page.navigate(f"{url}/dashboard")
            page.wait_for("document.querySelectorAll('#roles rect.band').length >= 3", 30)
        switch_and_back(srv, tok, refs, page)


def switch_and_back(srv, tok, refs, page) -> None:
    """The scenario of the module docstring; ``page``: the dashboard in Chromium, or None."""
    url = srv.url

    # streams in flight on decode-1, then the switch
    results, r = asyncio.run(switch_under_load(srv, "decode-1", "prefill"))
    assert r.status_code == 200, r.text
    answer = r.json()
    assert (answer["worker"], answer["previous_role"], answer["role"]) == ("decode-1", "decode", "prefill")
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == refs
    assert "decode-1 (prefill): ready" in health(url)
    m = wait_idle(url, HEARTBEAT_S)
    moved = metric_sum(m, "pdserve_migrations_total", worker="decode-0", direction="in", outcome="done")
    assert moved >= 1, "the switch moved no running request"
    assert switches(m, "decode", "prefill") == 1 and switches(m, "prefill", "decode") == 0
    assert metric_sum(m, "pdserve_requests_total", status="200") == len(PROMPTS)

    # the last decode worker may not leave its role
    r = switch(url, "decode-0", "prefill")
    assert r.status_code == 409 and "would leave no ready decode worker" in r.json()["error"]["message"], r.text

    # new requests: prefilled by both prefill workers, decoded by decode-0
    prefilled = {
        w: metric_sum(m, "pdserve_worker_finished_requests_total", worker=w) for w in ("prefill-0", "decode-1")
    }
    results = asyncio.run(stream_all(url, PROMPTS * 2, NEW_TOKENS))
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == refs * 2
    m = wait_idle(url, HEARTBEAT_S)
    for w in ("prefill-0", "decode-1"):
        assert metric_sum(m, "pdserve_worker_finished_requests_total", worker=w) > prefilled[w], w

    # and back, through the CLI: decode-1 decodes again
    cli = [sys.executable, "-m", "server.launch.cli", "role", "decode-1", "decode", "--router", url]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("decode-1: prefill -> decode in "), done
    assert "decode-1 (decode): ready" in health(url)
    results = asyncio.run(stream_all(url, PROMPTS[:2], NEW_TOKENS))
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == refs[:2]
    m = wait_idle(url, HEARTBEAT_S)
    assert switches(m, "decode", "prefill") == 1 and switches(m, "prefill", "decode") == 1
    assert metric_sum(m, "pdserve_generation_tokens_total", worker="decode-1") > 0
    assert metric_sum(m, "pdserve_requests_total", status="200") == len(PROMPTS) * 3 + 2
    assert held(m) == {}
    if page is not None:
        page.wait_for(f"{MARKERS} === 'decode>prefill,prefill>decode'", 15)
        assert page.evaluate(BANDS) == "decode,prefill,decode"
        page.wait_for("document.querySelectorAll('#roles-tiles [data-metric]').length === 2", 15)
        assert role_tiles_differ(page, scrape_metrics(url)) == []
        assert page.errors() == []


# ---- behind a prefill backlog ----------------------------------------------------------------------
BACKLOG_TOKENS = 8
WORDS = "the of and to in is was for on that with as by at from his her it an are were which this be or".split()


def backlog_prompts(n: int = 4, words: int = 200) -> list[str]:
    """``n`` long prompts that share no first token (a radix hit is a prompt's own), the first one
    four times as long: prefill-0 is still computing it when the switch comes."""
    starts = ["Story", "Letter", "Report", "Poem", "Song", "Essay"]
    rng = random.Random(5)
    return [
        f"{starts[i]} {i}: " + " ".join(rng.choice(WORDS) for _ in range(words * (4 if i == 0 else 1)))
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def backlog_refs(embedded):
    return greedy_refs(embedded, backlog_prompts(), BACKLOG_TOKENS)


def wait_held(url: str, worker: str, n: int, timeout_s: float = 60.0) -> None:
    """Until ``worker`` holds ``n`` requests waiting for pages or KV and runs none."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url)
        q = {k: metric_sum(m, "pdserve_queue_requests", worker=worker, queue=k) for k in ("prealloc", "transfer")}
        running = metric_sum(m, "pdserve_queue_requests", worker=worker, queue="running")
        if q["prealloc"] + q["transfer"] == n and running == 0:
            return
        assert time.monotonic() < deadline, f"{worker} queues {q}, running {running}: {n} requests not all held"
        time.sleep(HEARTBEAT_S)


def test_switch_behind_a_prefill_backlog_waits_for_no_prompt(launched_server_per_test, embedded, backlog_refs):
    tok = embedded[2]
    srv = launch_switchable_pd(
        launched_server_per_test,
        "--route-decode",
        "decode-1",
        "--kv-pool-tokens",
        "8192",  # decode-1 reserves pages for the prompts at once
        "--chunked-prefill-size",
        "16",  # the first prompt is still being computed (~60 chunks) when the switch reaches prefill-0
        "--test-step-delay-s",
        "0.05",  # ... each of them at least this long
        "--fresh-pair-retries",
        "0",  # a hand-back that used a retry would fail its request
        "--local-prefill-backlog-ratio",
        "0",  # every prompt through prefill-0 (decode-1 would prefill the short ones itself)
    )
    url, prompts = srv.url, backlog_prompts()
    wait_idle(url, HEARTBEAT_S)

    async def scenario():
        first = asyncio.ensure_future(stream_all(url, prompts[:1], BACKLOG_TOKENS))
        await asyncio.to_thread(wait_held, url, "decode-1", 1)  # prefill-0 computes the long prompt
        rest = asyncio.ensure_future(stream_all(url, prompts[1:], BACKLOG_TOKENS))
        await asyncio.to_thread(wait_held, url, "decode-1", len(prompts))  # queued behind it
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            r = await client.post(f"{url}/admin/role", json={"worker": "decode-1", "role": "prefill"})
        return await first + await rest, r

    results, r = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == backlog_refs
    m = wait_idle(url, HEARTBEAT_S)
    assert (
        metric_sum(m, "pdserve_requests_total", status="200") == metric_sum(m, "pdserve_requests_total") == len(prompts)
    )
    assert metric_sum(m, "pdserve_router_handbacks_total") == len(prompts)
    assert metric_sum(m, "pdserve_router_retries_total") == 0
    # no prompt landed on decode-1 (one that had would have streamed there and moved to decode-0)
    assert metric_sum(m, "pdserve_migrations_total", worker="decode-0", direction="in") == 0
    log = srv.log()
    assert "withdrawn while computed: answered now" in log, log[-3000:]
    # the prompt under way went to prefill-0's radix cache: its re-send computed one page at most
    assert metric_sum(m, "pdserve_cached_prompt_tokens_total", worker="prefill-0") >= len(tok.encode(prompts[0])) - 16
    assert held(m) == {}
