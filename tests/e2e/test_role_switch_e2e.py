"""Live role switching end to end (``POST /admin/role``, ``server.router.roles``,
``server.worker.role_switch``): ``pdserve launch`` with 1 prefill + 2 decode worker processes, KV over
NIXL, the real model and HTTP API. Streams run on decode-1 (``--route-decode decode-1``, decode steps
slowed by ``--test-step-delay-s`` so they are still running); decode-1 switches to prefill while they
stream: its requests migrate to decode-0 and every stream ends with the colocated engine's greedy
tokens (equal to transformers, tests/e2e/test_pd_http.py), none failed. ``/health`` then lists
``decode-1 (prefill)``, a switch that would leave no decode worker is refused (409), new requests
prefill on both prefill workers, and decode-1 switches back (``pdserve role``) and decodes again. Each switch moves
``pdserve_role_switches_total`` by exactly one; no KV page or host buffer is left in use."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum, scrape_metrics, wait_idle
from tests.e2e.test_migration_e2e import PROMPTS as MIGRATION_PROMPTS
from tests.e2e.test_migration_e2e import stream_all
from tests.support.models import strip_eos
from transfer.wire.sampling_params import SamplingParams

pytestmark = [pytest.mark.process, pytest.mark.slow]

HEARTBEAT_S = 0.2
NEW_TOKENS = 64
PROMPTS = MIGRATION_PROMPTS[:4]  # long greedy answers: still streaming when the switch comes


@pytest.fixture(scope="module")
def refs(embedded):
    """The colocated engine's greedy tokens of every prompt."""
    from engine.llm import LLM
    from tests.support.models import engine_cfg, sched_cfg

    tok = embedded[2]
    colocated = LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(), loaded=(embedded[0], embedded[1], tok))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    return [colocated.generate_ids([tok.encode(p)], params)[0].token_ids for p in PROMPTS]


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


def test_decode_worker_switches_to_prefill_under_load_and_back(launched_server, embedded, refs):
    tok = embedded[2]
    srv = launched_server(
        "pd",
        "--decode",
        "2",
        "--route-decode",
        "decode-1",
        "--migrate-after",
        "100000",  # no migration of its own: only the switch moves requests
        "--host-kv-pool-gb",
        "0.25",
        "--kv-pool-tokens",
        "2048",
        "--test-step-delay-s",
        "0.05",
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--worker-timeout-s",
        "30",
        "--log-level",
        "INFO",
    )
    url = srv.url
    before = wait_idle(url, HEARTBEAT_S)
    assert switches(before, "decode", "prefill") == 0

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
    for w in ("prefill-0", "decode-0", "decode-1"):
        assert metric_sum(m, "pdserve_kv_pool_pages", worker=w, state="used") == 0, w
    for w in ("decode-0", "decode-1"):
        assert metric_sum(m, "pdserve_host_kv_pool_bytes", worker=w, state="used") == 0, w
