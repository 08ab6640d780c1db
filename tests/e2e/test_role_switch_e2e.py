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
after a decode one, a switch marker each way, and role switch tiles equal to ``/metrics``."""

from __future__ import annotations

import asyncio
import json
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
