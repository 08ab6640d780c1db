"""``bench serve --multi-turn`` without a server: each turn resends the conversation so far (the
answers the server streamed included), a failed turn ends only its own conversation, records come
per turn, the cache effect is read from two /metrics scrapes, and routing variants launch with
their ``--routing``."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.serve.client import ClientConfig
from bench.serve.multiturn import MultiTurnSpec, multi_turn_records, run_conversations, user_starts
from bench.serve.options import ServeOptions, add_serve_flags
from bench.serve.report import cache_table
from bench.serve.server_metrics import cache_effect
from bench.serve.servers import launch_argv, parse_modes
from bench.serve.stats import SLO
from bench.serve.workload import WordCounter


def _sse(text: str) -> str:
    chunk = json.dumps({"choices": [{"index": 0, "text": text}]})
    return (
        f"data: {chunk}\n\ndata: "
        + json.dumps({"choices": [], "usage": {"completion_tokens": 2}})
        + "\n\ndata: [DONE]\n\n"
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_each_turn_resends_the_conversation_and_a_failure_ends_only_its_own(endpoint):
    bodies: list[dict] = []
    failed: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        text = body["prompt"] if endpoint == "completions" else body["messages"][-1]["content"]
        first = bodies[0]["prompt"] if endpoint == "completions" else bodies[0]["messages"][0]["content"]
        second_turn = text.count(" A") == 1 if endpoint == "completions" else len(body["messages"]) == 3
        mine = (text if endpoint == "completions" else body["messages"][0]["content"]).startswith(first)
        if second_turn and mine:  # the second turn of the first conversation the server saw fails
            failed.append(body)
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return httpx.Response(200, text=_sse(f" A{len(text)}"), headers={"content-type": "text/event-stream"})

    spec = MultiTurnSpec(users=2, turns=3, first_len=5, question_len=2, output_len=2, think_s=0)
    cfg = ClientConfig("http://srv", "m", endpoint=endpoint)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    m = asyncio.run(run_conversations(cfg, spec, WordCounter(), seed=3, progress=False, client=client))
    assert len(m.results) == 5 and sum(not r.ok for r in m.results) == 1  # the failed user sent no 3rd turn
    for r in m.results:
        assert r.kind == f"turn{r.index % 3 + 1}"
    ok = [b for b in bodies if b is not failed[0]]
    if endpoint == "completions":
        grown = [b["prompt"] for b in ok]
        # a later turn of a user starts with that user's previous prompt and the answer it got
        # (right after it: the answer continues the prompt), then the new question on a new line
        assert any(
            later.startswith(earlier + " A") and "\n" in later[len(earlier) :] for earlier in grown for later in grown
        )
        assert {len(p.split()) for p in grown[:2]} == {5}
    else:
        roles = [[m["role"] for m in b["messages"]] for b in ok]
        assert ["user", "assistant", "user"] in roles and ["user"] in roles
        follow = next(b for b in ok if len(b["messages"]) == 3)
        assert follow["messages"][1]["content"].startswith(" A")
    records = multi_turn_records("x", m, SLO(), 3)
    assert [(r.kind, r.stats.requests) for r in records] == [("all", 5), ("turn1", 2), ("turn2", 2), ("turn3", 1)]


def test_users_arrive_one_after_another_when_asked():
    together = MultiTurnSpec(users=3, turns=1, first_len=5, question_len=2, output_len=2, think_s=0)
    assert user_starts(together, seed=1) == [0.0, 0.0, 0.0]
    spread = MultiTurnSpec(users=200, turns=1, first_len=5, question_len=2, output_len=2, think_s=0, arrival_s=2.0)
    starts = user_starts(spread, seed=1)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] == 0.0 and all(g > 0 for g in gaps) and 1.6 < sum(gaps) / len(gaps) < 2.4
    assert starts == user_starts(spread, seed=1) != user_starts(spread, seed=2)

    sent: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(asyncio.get_running_loop().time())
        return httpx.Response(200, text=_sse(" A"), headers={"content-type": "text/event-stream"})

    spec = MultiTurnSpec(users=2, turns=1, first_len=5, question_len=2, output_len=2, think_s=0, arrival_s=0.3)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    asyncio.run(
        run_conversations(ClientConfig("http://srv", "m"), spec, WordCounter(), seed=3, progress=False, client=client)
    )
    assert sent[1] - sent[0] >= user_starts(spec, 3)[1] - 0.01  # the second user waited its arrival gap


def _sample(name: str, value: float, **labels: str):
    return (name, tuple(sorted(labels.items()))), value


def test_cache_effect_per_side_from_two_scrapes():
    up = [
        _sample("pdserve_worker_up", 1, worker=w, role=r)
        for w, r in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
    ]
    before = dict(
        [
            *up,
            _sample("pdserve_prompt_tokens_total", 100, worker="p0"),
            _sample("pdserve_cached_prompt_tokens_total", 10, worker="p0"),
            _sample("pdserve_kv_transfer_bytes_total", 1000, worker="p0"),
        ]
    )
    after = dict(
        [
            *up,
            _sample("pdserve_prompt_tokens_total", 300, worker="p0"),
            _sample("pdserve_prompt_tokens_total", 200, worker="p1"),
            _sample("pdserve_cached_prompt_tokens_total", 160, worker="p0"),
            _sample("pdserve_cached_prompt_tokens_total", 50, worker="p1"),
            _sample("pdserve_prompt_tokens_total", 400, worker="d0"),
            _sample("pdserve_cached_prompt_tokens_total", 300, worker="d0"),
            _sample("pdserve_kv_transfer_bytes_total", 9000, worker="p0"),
            _sample("pdserve_kv_transfer_bytes_total", 2000, worker="p1"),
        ]
    )
    e = cache_effect(before, after, requests=5)
    assert e.hit_rate == {"prefill": 0.5, "decode": 0.75}  # (150 + 50) / (200 + 200); 300 / 400
    assert e.kv_bytes_per_request == 2000.0  # (8000 + 2000) / 5
    assert "50.0%" in cache_table({"pd": e.to_dict()}) and cache_effect({}, {}, 3).hit_rate == {}


def test_routing_variants_and_multi_turn_flags():
    import argparse

    assert parse_modes("pd+least-loaded,pd+cache-aware") == ["pd+least-loaded", "pd+cache-aware"]
    argv = launch_argv("pd+cache-aware", [])
    assert argv[:4] == ["--mode", "pd", "--routing", "cache-aware"]
    for bad in ("pd+fastest", "pd,pd"):
        with pytest.raises(ValueError, match="--compare"):
            parse_modes(bad)
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    o = ServeOptions.from_args(
        p.parse_args(
            [
                "--multi-turn",
                "--users",
                "4",
                "--turns",
                "3",
                "--input-len",
                "300",
                "--turn-input-len",
                "40",
                "--think-time-s",
                "0.5",
            ]
        )
    )
    assert o.multi_turn == MultiTurnSpec(4, 3, 300, 40, 64, 0.5)
    o = ServeOptions.from_args(p.parse_args(["--multi-turn", "--users", "4", "--user-arrival-s", "2"]))
    assert o.multi_turn.arrival_s == 2.0
    with pytest.raises(ValueError, match="--user-arrival-s"):
        ServeOptions.from_args(p.parse_args(["--multi-turn", "--user-arrival-s", "-1"]))
    with pytest.raises(ValueError, match="--multi-turn"):
        ServeOptions.from_args(p.parse_args(["--multi-turn", "--concurrency", "2"]))
    with pytest.raises(ValueError, match="--users"):
        ServeOptions.from_args(p.parse_args(["--multi-turn", "--users", "0"]))
