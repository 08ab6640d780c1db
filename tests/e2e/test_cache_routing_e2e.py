"""Cache-aware routing end to end: ``pdserve launch --mode colocated --replicas 2
--routing cache-aware``, real worker processes publishing their radix caches on CURVE feeds (the
launch's ephemeral cluster key). A conversation whose first turn landed on the replica that was
not the least loaded gets its second turn there again (least-loaded routing would send it to the
idle replica 0): the router's metrics say it routed by prefix, that replica's cached prompt tokens
grow by the first turn's pages, and the output equals transformers' greedy continuation."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from bench.harness.subprocess_server import fresh_metrics, metric_sum, wait_idle

pytestmark = [pytest.mark.process, pytest.mark.slow]

HEARTBEAT_S = 0.2
PAGE = 16
FIRST = (
    "You are a helpful assistant who answers questions about geography, history and the natural world "
    "in short sentences. Question: which river flows through Paris?"
)


def _complete(url: str, prompt, max_tokens: int) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        timeout=180,
        json={
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _until(cond, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return got


def test_second_turn_lands_on_the_replica_holding_the_first(launched_server_per_test, embedded, hf_embedded):
    srv = launched_server_per_test(
        "colocated",
        "--replicas",
        "2",
        "--routing",
        "cache-aware",
        "--page-size",
        str(PAGE),
        "--kv-pool-tokens",
        "2048",
        "--health-interval-s",
        str(HEARTBEAT_S),
    )
    tok = embedded[2]
    workers = ("colocated-0", "colocated-1")
    _until(
        lambda: all(
            metric_sum(fresh_metrics(srv.url, HEARTBEAT_S), "pdserve_router_kv_index_synced", worker=w) == 1
            for w in workers
        )
    )
    # conversation A streams on replica 0 (the lowest id wins a tie) while B's first turn arrives: B goes to 1
    busy = threading.Event()

    def stream_a() -> None:
        with httpx.stream(
            "POST",
            f"{srv.url}/v1/completions",
            timeout=180,
            json={
                "prompt": "Tell me a long story about a lighthouse keeper.",
                "max_tokens": 96,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            for _ in r.iter_lines():
                busy.set()

    a = threading.Thread(target=stream_a)
    a.start()
    assert busy.wait(120)
    b1_ids = tok.encode(FIRST)
    before = fresh_metrics(srv.url, HEARTBEAT_S)
    b1 = _complete(srv.url, b1_ids, 8)
    a.join(180)
    m1 = wait_idle(srv.url, HEARTBEAT_S)
    grew = {
        w: metric_sum(m1, "pdserve_prompt_tokens_total", worker=w)
        - metric_sum(before, "pdserve_prompt_tokens_total", worker=w)
        for w in workers
    }
    assert grew["colocated-1"] == len(b1_ids), grew  # B's first turn went to the replica A did not hold
    _until(
        lambda: (
            metric_sum(fresh_metrics(srv.url, HEARTBEAT_S), "pdserve_router_kv_index_pages", worker="colocated-1")
            >= len(b1_ids) // PAGE
        )
    )
    # B's second turn: the first turn, its answer, a new question
    b2_ids = b1_ids + b1["token_ids"] + tok.encode(" And which sea does it flow into?")
    b2 = _complete(srv.url, b2_ids, 8)
    m2 = wait_idle(srv.url, HEARTBEAT_S)

    def delta(name: str, **labels) -> float:
        return metric_sum(m2, name, **labels) - metric_sum(m1, name, **labels)

    assert delta("pdserve_prompt_tokens_total", worker="colocated-1") == len(b2_ids)
    assert delta("pdserve_prompt_tokens_total", worker="colocated-0") == 0
    assert delta("pdserve_cached_prompt_tokens_total", worker="colocated-1") >= len(b1_ids) // PAGE * PAGE
    assert delta("pdserve_routing_decisions_total", reason="prefix") == 1
    # every feed message the workers published in between reached the router's index, and every
    # snapshot the router asked for was published once
    published = sum(delta("pdserve_worker_kv_events_published_total", worker=w) for w in workers)
    assert published >= 1 and delta("pdserve_router_kv_events_total") == published
    assert (
        sum(metric_sum(m2, "pdserve_worker_kv_snapshots_published_total", worker=w) for w in workers)
        == metric_sum(m2, "pdserve_router_kv_resyncs_total")
        >= 2
    )
    with torch.no_grad():
        out = hf_embedded.generate(torch.tensor([b2_ids]), max_new_tokens=8, do_sample=False)
    assert b2["token_ids"] == out[0, len(b2_ids) :].tolist()
