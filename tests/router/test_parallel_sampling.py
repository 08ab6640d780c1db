"""``n`` and ``best_of`` in the router, against scripted fake workers: one request per choice, each
with its own seed (``seed + index``), followers sent after their leader's first token on its route,
indices ``prompt * n + i``, usage summed over every sequence, ``best_of`` keeping the best ``n`` by
cumulative logprob, a follower whose leader's decode worker switched role meanwhile sent on a fresh
route, and the 400s for counts out of range. (Against the real model:
tests/clients/test_openai_table.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from server.router.choices import ChoiceRun
from server.router.parallel import MAX_CHOICES, choice_params
from server.router.registry import READY, WorkerSpec
from server.router.session import GenerationSession
from server.router.workers import SWITCHING
from tests.support.fake_worker import PIECES, completion, sse_events
from tests.support.router_doubles import ready_registry
from transfer.wire.enums import Role
from transfer.wire.sampling_params import SamplingParams


def test_choices_of_each_prompt_get_their_own_seed_and_index(make_client):
    client, worker, ctx = make_client()
    r = completion(client, prompt=["a", "b"], n=3, seed=5, temperature=1.0, max_tokens=4)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert len(worker.requests) == 6
    seeds = sorted(p.seed for _, _, p in worker.requests)
    assert seeds == [5, 5, 6, 6, 7, 7]
    assert [p.seed for _, _, p in worker.requests[:2]] == [5, 5]  # the two leaders go out first
    assert body["usage"]["completion_tokens"] == 6 * 4
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for _, ids, p in worker.requests if p.seed == 5)  # once each
    assert len(ctx.table) == 0 and worker.aborted == []


def test_best_of_keeps_the_best_n_by_cumulative_logprob(make_client):
    # seeds 10..13 give per-token logprobs -1, -6, -4, -2: the best two are choices 0 and 3
    client, worker, _ = make_client(mode={"logprob": lambda p: -float(p.seed * 5 % 7)})
    r = completion(client, n=2, best_of=4, seed=10, temperature=1.0, max_tokens=3, logprobs=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["logprobs"]["token_logprobs"] for c in body["choices"]] == [[-1.0] * 3, [-2.0] * 3]
    assert body["usage"]["completion_tokens"] == 4 * 3  # every generated sequence is counted
    r = completion(client, n=1, best_of=3, seed=10, temperature=1.0, max_tokens=3)
    assert r.json()["choices"][0]["logprobs"] is None  # ranked internally, not shown unless asked
    assert all(p.logprobs == 0 for _, _, p in worker.requests[4:])


def test_chat_stream_with_n(make_client):
    client, worker, _ = make_client()
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert r.status_code == 200, r.text
    events = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    by_index: dict[int, list] = {0: [], 1: []}
    for e in events[:-1]:
        (c,) = e["choices"]
        by_index[c["index"]].append(c)
    for chunks in by_index.values():
        assert chunks[0]["delta"]["role"] == "assistant" and chunks[-1]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content") or "" for c in chunks) == "".join(PIECES[:3])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6
    assert len(worker.requests) == 2


def test_greedy_choices_keep_their_params():
    greedy = SamplingParams(temperature=0.0)
    assert choice_params(greedy, 3) is greedy
    assert choice_params(SamplingParams(seed=2**64 - 1), 2).seed == 1  # wraps within the accepted range
    assert choice_params(SamplingParams(seed=7), 0).seed == 7


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": 0}, "n"),
        ({"n": MAX_CHOICES + 1}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": MAX_CHOICES + 1}, "best_of"),
        ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ],
)
def test_counts_out_of_range_are_400(make_client, body, param):
    client, worker, _ = make_client()
    r = completion(client, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"] and worker.requests == []


@pytest.mark.parametrize("switched", [False, True])
def test_a_follower_goes_to_its_leaders_route_unless_a_worker_of_it_switched_role(tokenizer, switched):
    reg = ready_registry("pd", "p0", "d0", "d1")
    params = SamplingParams(max_new_tokens=4)
    sessions = [GenerationSession(reg, reg.table, [1, 2, 3], params, timeout_s=5) for _ in range(2)]
    runs = [ChoiceRun(0, sessions[0], tokenizer)]
    runs.append(ChoiceRun(1, sessions[1], tokenizer, follows=runs[0]))
    runs[0].session.prepare()
    runs[1].session.prepare(runs[0].session.route)
    runs[0].session.send()
    d = runs[0].session.route.stream_from
    if switched:  # the leader's decode worker became a prefill worker before the leader's first token
        d.state = SWITCHING
        d.spec, d.state = WorkerSpec(d.worker_id, Role.PREFILL, d.spec.addr), READY
    runs[0].started_ok = True
    runs[0].started.set()

    async def send_follower():
        await runs[1]._send_after_leader()

    asyncio.run(send_follower())
    follower = runs[1].session
    decode = follower.route.stream_from
    assert (decode is d) is not switched
    assert decode.spec.role == Role.DECODE and follower.rid in decode.client.rids()
    generated_at_d = [x.rid for x in d.client.sent if x.kind == "generate"]  # d may prefill it now
    assert (follower.rid in generated_at_d) is not switched
