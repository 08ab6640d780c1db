"""The SLO planner end to end (``--planner slo``, ``server.router.planner_task``): ``pdserve launch``
with 1 prefill + 2 decode worker processes, KV over NIXL, the real model and HTTP API. With nothing
measured yet the planner moves nothing; once prompts were prefilled, a TTFT SLO no prefill can meet
(1 ms) with a TPOT SLO of minutes makes it switch one decode worker to prefill through the admin path
(counted with reason ``planner``, ``/health`` lists it as a prefill worker), exactly once (the
dwell; the last decode worker never moves), and every stream, before and after, equals the colocated
engine's greedy tokens with no KV page or host buffer left in use."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum, scrape_metrics, wait_idle
from tests.e2e.test_migration_e2e import PROMPTS as MIGRATION_PROMPTS
from tests.e2e.test_migration_e2e import stream_all
from tests.support.models import strip_eos
from tests.support.role_switch_launch import HEARTBEAT_S, greedy_refs, held, launch_switchable_pd

pytestmark = [pytest.mark.process, pytest.mark.slow]

NEW_TOKENS = 32
PROMPTS = MIGRATION_PROMPTS[:4]


@pytest.fixture(scope="module")
def refs(embedded):
    return greedy_refs(embedded, PROMPTS, NEW_TOKENS)


def planner_switches(m: dict, old: str, new: str) -> float:
    return metric_sum(m, "pdserve_role_switches_total", **{"from": old, "to": new, "reason": "planner"})


def test_a_ttft_slo_no_prefill_meets_turns_one_decode_worker_into_a_prefill_worker(
    launched_server_per_test, embedded, refs
):
    tok = embedded[2]
    srv = launch_switchable_pd(
        launched_server_per_test,
        "--planner",
        "slo",
        "--slo-ttft-ms",
        "1",
        "--slo-tpot-ms",
        "600000",
        "--planner-interval-s",
        "0.5",
        "--planner-hysteresis",
        "2",
        "--planner-dwell-s",
        "3600",
        # the launch's workers share the host's cores, where the planner holds (a move adds no compute);
        # this test is about a move and the switch it makes, so the workers are taken as nodes of their own
        "--planner-cores",
        "own",
    )
    url = srv.url
    wait_idle(url, HEARTBEAT_S)
    time.sleep(2.0)  # four evaluations with no prefill measured: TTFT unknown, no move
    m = scrape_metrics(url)
    assert planner_switches(m, "decode", "prefill") == 0, srv.log()[-3000:]

    results = asyncio.run(stream_all(url, PROMPTS, NEW_TOKENS))
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == refs
    deadline = time.monotonic() + 60
    while planner_switches(scrape_metrics(url), "decode", "prefill") < 1:
        assert time.monotonic() < deadline, f"the planner switched nothing: {srv.log()[-4000:]}"
        time.sleep(HEARTBEAT_S)
    text = httpx.get(f"{url}/health", timeout=10, trust_env=False).text
    assert "decode-0 (prefill): ready" in text or "decode-1 (prefill): ready" in text, text

    results = asyncio.run(stream_all(url, PROMPTS, NEW_TOKENS))
    assert [strip_eos(ids, tok.eos_token_ids) for ids, _ in results] == refs
    time.sleep(2.0)  # more evaluations, TTFT still violated: the dwell and the last decode worker hold
    m = wait_idle(url, HEARTBEAT_S)
    assert planner_switches(m, "decode", "prefill") == 1 and planner_switches(m, "prefill", "decode") == 0
    assert metric_sum(m, "pdserve_role_switches_total", reason="admin") == 0
    assert metric_sum(m, "pdserve_requests_total", status="200") == 2 * len(PROMPTS)
    assert held(m) == {}
