"""Colocated replicas: ``pdserve launch --mode colocated --replicas N`` starts N colocated workers
behind one router, which balances them by their reported load (running, waiting, KV usage)
blended with its own in-flight count (``registry.route_colocated`` over ``load.BlendedLoad``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.harness.subprocess_server import metric_sum, wait_idle
from configs.schema import load_config
from server.launch.roles import worker_specs
from server.router.inflight import InflightTable
from server.router.load import BlendedLoad
from server.router.registry import READY, NoWorkerAvailable, WorkerHandle, WorkerSpec, route_colocated
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.enums import Role
from transfer.wire.protocol import WorkerStats


def replica(wid: str, running=0, waiting=0, used=0, total=100, role=Role.COLOCATED) -> WorkerHandle:
    h = WorkerHandle(WorkerSpec(wid, role, f"tcp://127.0.0.1:{29500 + int(wid[-1])}"), None, state=READY)
    h.stats = WorkerStats(
        worker_id=wid,
        role=role,
        model="m",
        capacity_tokens=total * 16,
        max_model_len=512,
        page_size=16,
        gauges={"queue_running": running, "queue_waiting": waiting, "kv_pages_used": used, "kv_pages_total": total},
    )
    return h


def pick(handles, inflight=None) -> str:
    table = InflightTable()
    for wid, n in (inflight or {}).items():
        for i in range(n):
            table.open(f"{wid}-{i}", (wid,), wid, 1)
    load = BlendedLoad(table, {h.worker_id: h for h in handles})
    return route_colocated(handles, load).stream_from.worker_id


def test_route_follows_reported_load_and_in_flight():
    a, b = replica("w0", running=3, waiting=2), replica("w1", running=4)
    assert pick([a, b]) == "w1"  # 5 reported requests against 4
    assert pick([a, b], {"w1": 6}) == "w0"  # this router knows of 6 on w1 already
    assert pick([replica("w0", running=2), replica("w1", running=2, used=90)]) == "w0"  # KV breaks the tie
    assert pick([replica("w0", running=2, used=99), replica("w1", running=3)]) == "w0"  # ... but outweighs no request
    assert pick([replica("w1"), replica("w0")]) == "w0"  # a full tie: lowest id
    fresh = replica("w1")
    fresh.stats = None  # no stats yet: its in-flight count alone
    assert pick([replica("w0", running=1), fresh]) == "w1"
    with pytest.raises(NoWorkerAvailable, match="no ready colocated worker"):
        pick([replica("w0", role=Role.PREFILL)])


def test_replicas_get_their_own_ids_and_ports():
    cfg = load_config(cli={"mode": "colocated", "replicas": 3, "base_port": 31000})
    assert [(s.worker_id, s.addr.rsplit(":", 1)[1]) for s in worker_specs(cfg)] == [
        ("colocated-0", "31000"),
        ("colocated-1", "31001"),
        ("colocated-2", "31002"),
    ]
    with pytest.raises(ValueError, match="replicas"):
        load_config(cli={"mode": "colocated", "replicas": 0})


PROMPTS = [
    "The capital of France is",
    "Count to five:",
    "Write a word about the sea.",
    "2 + 2 =",
    "Name a colour:",
    "The opposite of hot is",
    "Say hello in Spanish:",
    "A haiku about rain:",
]


def _complete(url: str, prompt: str) -> list[int]:
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.process
def test_two_pinned_replicas_share_the_load_with_a_single_workers_outputs(launched_server_per_test, embedded):
    """Both replicas serve, and every output equals the one a single colocated worker's engine
    (built in this process from the same weights, pool and page size) gives the prompt alone."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    two = launched_server_per_test(
        "colocated",
        "--replicas",
        "2",
        "--worker-cpus",
        "auto",
        "--log-level",
        "INFO",
        "--kv-pool-tokens",
        "1024",
        "--page-size",
        "16",
        "--health-interval-s",
        "0.2",
    )
    log = two.log()
    assert "colocated-0 -> cpus" in log and "colocated-1 -> cpus" in log
    for w in ("colocated-0", "colocated-1"):  # a pinned worker (no core ledger) also joins the build first
        assert log.index(f"[{w}] engine.grammar: grammar engine tokenizer built") < log.index(
            f"[{w}] server.worker.loop: colocated worker {w} serving"
        ), log[-3000:]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _complete(two.url, p), PROMPTS))
    m = wait_idle(two.url, 0.2)
    per_worker = [metric_sum(m, "pdserve_worker_finished_requests_total", worker=f"colocated-{i}") for i in (0, 1)]
    assert sum(per_worker) == len(PROMPTS) and min(per_worker) >= 2, per_worker
    launched_server_per_test.stop(two)
    cfg, weights, tok, _ = embedded
    one = LLM(engine_cfg(kv_pool_tokens=1024, page_size=16), sched_cfg(), loaded=(cfg, weights, tok))
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    assert [one.generate_ids([tok.encode(p)], params)[0].token_ids for p in PROMPTS] == got
