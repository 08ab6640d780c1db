"""Failover, router side without a model: a request whose streaming worker dies (503) after tokens
were streamed goes out again on a live route as a continuation carrying the tokens so far
(``resume_output_ids``; in PD only the decode worker is sent to, it asks the prefill worker for the
recompute), and its stream goes on from the next token, with no error; at most ``max_failovers``
times, and never without a live route before the deadline, each end naming its reason;
``pdserve_failovers_total{worker,outcome}`` and ``pdserve_failover_recomputed_tokens_total`` count
them. The real thing (kill -9 of a launched replica) is in ``tests/e2e/test_failover_e2e.py``."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from configs.schema import PdserveConfig
from server.router.app import build_context, create_app
from server.router.errors import APIError
from server.router.failover import FailoverBudget, continuation_route
from server.router.metrics import RouterMetrics
from server.router.registry import Registry, Route, WorkerSpec, route_pd
from server.router.session import GenerationSession
from server.router.worker_client import WorkerClient
from tests.support.router_doubles import RecordingClient, ScriptedColocated, ready_registry
from transfer.control_auth import ControlAuth
from transfer.wire.protocol import PrefilledLocally, TokenDelta, encode
from transfer.wire.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=6, prompt_logprobs=1)


def registry(mode: str, *ids: str) -> Registry:
    """Ready workers named like ``p0``/``d1``/``c0`` (role from the first letter)."""
    return ready_registry(mode, *ids)


def session(reg: Registry, limit: int = 2, outcomes: list | None = None, timeout_s: float = 5) -> GenerationSession:
    budget = FailoverBudget(limit, on_outcome=lambda w, o: outcomes.append((w, o)) if outcomes is not None else None)
    s = GenerationSession(reg, reg.table, [1, 2, 3], PARAMS, timeout_s=timeout_s, retries=1, failover=budget)
    s.prepare()
    s.send()
    return s


def stream_from(s: GenerationSession) -> str:
    return s.route.stream_from.worker_id


def test_pd_decode_death_mid_stream_continues_on_the_other_decode_worker():
    reg, outcomes = registry("pd", "p0", "d0", "d1"), []

    async def scenario():
        s = session(reg, outcomes=outcomes)
        first = s.rid
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4, 5], cached_tokens=2))
        assert (await s.next()).token_ids == [4, 5]
        assert reg.mark_dead("d0", "worker process exited with code -9") == [s.rid]
        waiting = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.01)
        assert stream_from(s) == "d1" and s.rid != first and not waiting.done()
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[6], cached_tokens=5))
        got = [(await waiting).token_ids]
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[7], finish_reason="length"))
        last = await s.next()
        return first, s, got + [last.token_ids], last

    first, s, got, last = asyncio.run(scenario())
    assert got == [[6], [7]] and last.finish_reason == "length" and s.sent == [4, 5, 6, 7]
    d1, p0 = reg.handles["d1"].client, reg.handles["p0"].client
    (kind, rid, resume, params) = d1.sent[0]
    assert (kind, rid, resume) == ("generate", s.rid, [4, 5]) and params.prompt_logprobs is None
    assert [k for k, *_ in p0.sent] == ["prefill"]  # the continuation's recompute is the decode worker's to ask
    assert first in reg.handles["d0"].client.aborted
    assert outcomes == [("d0", "continued")] and len(reg.table) == 0


def test_pd_continuation_goes_back_to_the_prefill_worker_that_prefilled_its_prompt():
    """With 2 prefill workers a decode worker's death sends the continuation to the prefill worker of
    its route (its radix cache holds the prompt), not to the fresh pair's other prefill worker; when
    that prefill worker is gone too, to the policy's pick; when the prefill worker is the one that
    died (the continuation's recompute), to a fresh pair; when the dead decode worker had prefilled
    the prompt itself (``PrefilledLocally``), to the policy's pick: no prefill worker holds it."""

    async def routes(*deaths: tuple[str, ...], local: bool = False) -> tuple[list[list[str]], int]:
        reg, same = registry("pd", "p0", "p1", "d0", "d1"), []
        budget = FailoverBudget(2, on_same_prefill=lambda: same.append(1))
        s = GenerationSession(reg, reg.table, [1, 2, 3], PARAMS, timeout_s=5, retries=1, failover=budget)
        s.prepare()
        s.send()
        assert [h.worker_id for h in s.route.targets] == ["p0", "d0"]
        if local:
            assert reg.table.local("d0", s.rid)  # what d0's PrefilledLocally calls
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4, 5]))
        await s.next()
        seen = []
        for dead in deaths:
            for w in dead:
                reg.mark_dead(w, "worker process exited with code -9")
            waiting = asyncio.ensure_future(s.next())
            await asyncio.sleep(0.01)
            seen.append([h.worker_id for h in s.route.targets])
            waiting.cancel()
        s.close("test over")
        return seen, len(same)

    # (the routes taken, the continuations counted as sent to their failed route's prefill worker)
    assert asyncio.run(routes(("d0",))) == ([["p0", "d1"]], 1)  # the fresh pair would be p1 + d1
    assert asyncio.run(routes(("p0", "d0"))) == ([["p1", "d1"]], 0)  # the holder is gone: the policy's pick
    assert asyncio.run(routes(("d0",), ("p0",))) == ([["p0", "d1"], ["p1", "d1"]], 1)  # its recompute's prefill died
    assert asyncio.run(routes(("d0",), local=True)) == ([["p1", "d1"]], 0)  # d0 prefilled it: the fresh pair


def test_the_kept_prefill_worker_is_expected_to_compute_the_sent_tokens_and_the_partial_page():
    """``Route.prefill`` of a continuation that keeps its prompt's prefill worker names that worker with
    the sent tokens plus the prompt's partial last page, where the policy had named its own pick."""
    reg = registry("pd", "p0", "p1", "d0", "d1")
    for h in reg.handles.values():
        h.stats = h.stats.model_copy(update={"page_size": 4})
    failed = reg.route()
    reg.mark_dead("d0", "worker process exited with code -9")

    def counting_policy(pool, load, prompt_ids):
        chosen = route_pd(pool, load, prompt_ids)
        return Route(chosen.targets, chosen.stream_from, (chosen.targets[0].worker_id, len(prompt_ids)))

    reg.policy = counting_policy
    route = continuation_route(reg, failed, list(range(10)), sent=5)
    assert [h.worker_id for h in route.targets] == ["p0", "d1"] and route.prefill == ("p0", 5 + 2)
    reg.policy = route_pd  # least-loaded names no prefill estimate: none is made up
    assert continuation_route(reg, failed, list(range(10)), sent=5).prefill is None


class LocalAwareClient(RecordingClient):
    """A recording decode worker double with the ``WorkerClient`` hook the registry wires."""

    on_local = None


def test_a_continuation_its_decode_worker_prefills_survives_the_prefill_worker():
    """After ``PrefilledLocally`` the continuation depends on its decode worker only: the prefill
    worker's death neither fails it nor spends a failover (before it, the same death would)."""
    reg, outcomes = ready_registry("pd", "p0", "d0", "d1", client=LocalAwareClient), []

    async def scenario():
        s = session(reg, outcomes=outcomes)
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4, 5]))
        await s.next()
        reg.mark_dead("d0", "worker process exited with code -9")
        waiting = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.01)
        assert stream_from(s) == "d1" and reg.table.entry(s.rid).depends_on == ("p0", "d1")
        reg.handles["d1"].client.on_local("d1", s.rid)  # what its PrefilledLocally calls
        assert reg.table.entry(s.rid).depends_on == ("d1",) and reg.table.pending_prefill_tokens("p0") == 0
        assert reg.mark_dead("p0", "worker process exited with code -9") == []
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[6], finish_reason="length"))
        return s, await waiting

    s, delta = asyncio.run(scenario())
    assert delta.token_ids == [6] and s.sent == [4, 5, 6] and outcomes == [("d0", "continued")]
    assert s.failover.used == 1 and len(reg.table) == 0


def continuations_gauge(metrics: RouterMetrics) -> dict[str, float]:
    """``pdserve_router_continuations`` by worker, as a scraper reads it."""
    fams = text_string_to_metric_families(metrics.render().decode())
    return {s.labels["worker"]: s.value for f in fams for s in f.samples if s.name == "pdserve_router_continuations"}


def test_the_continuations_gauge_follows_a_failed_over_stream():
    """``pdserve_router_continuations{worker}``: 0 everywhere for a first attempt; once d0 dies its
    continuation counts on p0 (the prefill worker that prefilled its prompt) and d1; after d1's first
    new token on d1 only; 0 once it ends. A second one that d1 prefills itself (``PrefilledLocally``)
    counts on d1 alone at once."""
    reg = ready_registry("pd", "p0", "p1", "d0", "d1", client=LocalAwareClient)
    metrics = RouterMetrics(lambda: reg.handles.values(), lambda: len(reg.table), continuations=reg.table.continuations)
    zero = {"p0": 0.0, "p1": 0.0, "d0": 0.0, "d1": 0.0}

    async def scenario():
        seen = []
        s = session(reg)
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4, 5]))
        await s.next()
        seen.append(continuations_gauge(metrics))
        reg.mark_dead("d0", "worker process exited with code -9")
        waiting = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.01)
        seen.append(continuations_gauge(metrics))
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[6]))
        await waiting
        seen.append(continuations_gauge(metrics))
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[7], finish_reason="length"))
        await s.next()
        seen.append(continuations_gauge(metrics))
        return seen

    assert asyncio.run(scenario()) == [
        zero,
        {**zero, "p0": 1.0, "d1": 1.0},
        {**zero, "d1": 1.0},
        zero,
    ]
    reg.table.open("c", ("p1", "d1"), "d1", 10, continuation=True)
    assert continuations_gauge(metrics) == {**zero, "p1": 1.0, "d1": 1.0}
    assert reg.table.local("d1", "c") and continuations_gauge(metrics) == {**zero, "d1": 1.0}


def test_prefilled_locally_from_a_worker_reaches_the_hook_only_from_its_stream_worker():
    ctx, got = zmq.asyncio.Context(), []
    try:
        c = WorkerClient("d1", "tcp://127.0.0.1:1", ctx, print, print, auth=ControlAuth.insecure())
        c.on_local = lambda w, rid: got.append((w, rid))
        c._handle(encode(PrefilledLocally(rid="r1")))
    finally:
        ctx.term()
    assert got == [("d1", "r1")]
    reg = ready_registry("pd", "p0", "d0")
    reg.table.open("r1", ("p0", "d0"), "d0", 5, prefill=("p0", 3))
    assert not reg.table.local("p0", "r1") and reg.table.entry("r1").depends_on == ("p0", "d0")  # not its stream
    assert reg.table.local("d0", "r1") and reg.table.pending_prefill_tokens("p0") == 0
    assert reg.table.fail_worker("p0", 503, "gone") == [] and reg.table.fail_worker("d0", 503, "gone") == ["r1"]


def test_colocated_replica_death_continues_on_the_other_replica():
    reg = registry("colocated", "c0", "c1")

    async def scenario():
        s = session(reg)
        w = stream_from(s)
        reg.on_tokens(w, TokenDelta(rid=s.rid, token_ids=[9]))
        await s.next()
        reg.mark_dead(w, "worker process exited with code -9")
        waiting = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.01)
        other = stream_from(s)
        assert other != w
        reg.on_tokens(other, TokenDelta(rid=s.rid, token_ids=[10], finish_reason="length"))
        return other, await waiting

    other, delta = asyncio.run(scenario())
    assert delta.token_ids == [10] and reg.handles[other].client.sent[0][2] == [9]


def test_failover_waits_for_a_starting_worker():
    reg = registry("pd", "p0", "d0", "d1")
    reg.handles["d1"].state = "starting"

    async def scenario():
        s = session(reg)
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4]))
        await s.next()
        reg.mark_dead("d0", "gone")
        waiting = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.2)
        assert not waiting.done() and stream_from(s) == "d0"
        reg.handles["d1"].state = "ready"
        await asyncio.sleep(0.1)
        assert stream_from(s) == "d1"
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[5], finish_reason="length"))
        return await waiting

    assert asyncio.run(scenario()).token_ids == [5]


@pytest.mark.parametrize("case", ["limit", "no route", "disabled"])
def test_failover_ends_with_its_reason(case):
    reg, outcomes = registry("pd", "p0", "d0", "d1"), []
    if case == "no route":
        reg = registry("pd", "p0", "d0")

    async def scenario():
        s = session(reg, limit=0 if case == "disabled" else 1, outcomes=outcomes, timeout_s=30)
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4]))
        await s.next()
        if case == "limit":  # the first death is continued on d1, the second one is one too many
            reg.mark_dead("d0", "gone")
            waiting = asyncio.ensure_future(s.next())
            await asyncio.sleep(0.01)
            reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[5]))
            assert (await waiting).token_ids == [5]
            reg.mark_dead("d1", "gone too")
            return await s.next()
        reg.mark_dead("d0", "worker process exited with code -9")
        return await s.next()

    with pytest.raises(APIError) as e:
        asyncio.run(scenario())
    assert e.value.status == 503
    expected = {
        "limit": ("--max-failovers 1 reached", [("d0", "continued"), ("d1", "limit")]),
        "no route": ("no live route (another worker) before the request's deadline", [("d0", "no_route")]),
        "disabled": ("worker d0 is unavailable", []),
    }[case]
    assert expected[0] in e.value.message and outcomes == expected[1]
    if case == "limit":
        assert "not continued after 2 tokens" in e.value.message
    assert len(reg.table) == 0


def dies_once(rid, resume):
    """A script for ``ScriptedColocated``: a first request streams one token and then fails with
    503 (its worker died); a continuation streams one more token and finishes."""
    if resume:
        return [TokenDelta(rid=rid, token_ids=[29], finish_reason="length")]
    return [TokenDelta(rid=rid, token_ids=[28]), TokenDelta.failed(rid, "the worker died", 503)]


def sample(metrics: str, prefix: str) -> list[tuple[str, float]]:
    return [
        (ln.split()[0], float(ln.split()[-1]))
        for ln in metrics.splitlines()
        if ln.startswith(prefix) and "_created" not in ln
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_http_failover_is_invisible_and_moves_the_counters(tokenizer, stream):
    cfg = PdserveConfig.model_validate({"server": {"health_interval_s": 0.05}, "cluster": {"mode": "colocated"}})
    specs = [WorkerSpec("w0", "colocated", "inproc://w0"), WorkerSpec("w1", "colocated", "inproc://w1")]
    ctx = build_context(
        cfg, tokenizer, "fake-model", specs, lambda s, on_t, on_s: ScriptedColocated(s, on_t, on_s, dies_once)
    )
    with TestClient(create_app(ctx)) as http:
        assert http.get("/health").status_code == 200
        before = sample(http.get("/metrics").text, "pdserve_failover")
        r = http.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": stream, "return_token_ids": True}
        )
        metrics = http.get("/metrics").text
    assert r.status_code == 200, r.text
    if stream:
        assert '"token_ids":[28]' in r.text and '"token_ids":[29]' in r.text and "error" not in r.text
    else:
        body = r.json()
        assert body["choices"][0]["token_ids"] == [28, 29] and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 2
    assert [n for n, v in before if v] == []
    after = dict(sample(metrics, "pdserve_failover"))
    died = next(w for w in ("w0", "w1") if f'pdserve_failovers_total{{outcome="continued",worker="{w}"}}' in after)
    assert after[f'pdserve_failovers_total{{outcome="continued",worker="{died}"}}'] == 1
    assert after["pdserve_failover_recomputed_tokens_total"] == 1
    assert sum(v for n, v in after.items() if n.startswith("pdserve_failovers_total")) == 1
    assert after["pdserve_failover_stall_seconds_count"] == 1 and 0 < after["pdserve_failover_stall_seconds_sum"] < 5
    assert len(ctx.table) == 0


def test_max_failovers_flag_and_default():
    from server.launch.args import build_parser, load_config

    assert PdserveConfig().cluster.max_failovers == 2
    assert (
        load_config(build_parser().parse_args(["launch", "--max-failovers", "0"]), "launch").cluster.max_failovers == 0
    )
