"""Retry on a fresh pair, router side without a model: a request whose prefill or
decode worker dies (503) before any token arrived goes out again, once by default, on another pair
(workers outside the failed one when there are, else with the dead worker replaced), under a new
request id, after an abort to the old pair; never after a token, never for other errors, never
beyond ``fresh_pair_retries``; ``pdserve_router_retries_total`` counts each retry. The real thing
(kill -9 of a launched worker) is in ``tests/chaos/test_retry_fresh_pair.py``.

A hand-back (a 503 marked ``handed_back``: a decode worker changing role gave the request back
before its first token) is sent again on a new route without using a retry, up to
``HANDBACK_LIMIT`` times, then as a retry; ``pdserve_router_handbacks_total`` counts each one. (The
switch behind a backlog with real processes: tests/e2e/test_role_switch_e2e.py.)"""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from configs.schema import PdserveConfig
from server.router.app import build_context, create_app
from server.router.errors import APIError
from server.router.registry import DEAD, Registry, WorkerSpec
from server.router.session import HANDBACK_LIMIT, GenerationSession
from server.router.workers import SWITCHING
from tests.support.router_doubles import RecordingClient, ScriptedColocated, ready_registry
from transfer.wire.protocol import TokenDelta, WorkerStats
from transfer.wire.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=4)


def registry(*ids: str) -> Registry:
    """A PD registry of ready workers named like ``p0``/``d1``."""
    return ready_registry("pd", *ids)


def session(
    reg: Registry, retries: int = 1, counted: list | None = None, handed: list | None = None
) -> GenerationSession:
    s = GenerationSession(
        reg,
        reg.table,
        [1, 2, 3],
        PARAMS,
        timeout_s=5,
        retries=retries,
        on_retry=None if counted is None else lambda: counted.append(1),
        on_hand_back=None if handed is None else lambda: handed.append(1),
    )
    s.prepare()
    s.send()
    return s


def pair(s: GenerationSession) -> list[str]:
    return [h.worker_id for h in s.route.targets]


def client(reg: Registry, wid: str) -> RecordingClient:
    return reg.handles[wid].client


def test_dead_prefill_before_the_first_token_is_retried_on_the_other_pair():
    reg, counted = registry("p0", "p1", "d0", "d1"), []

    async def scenario():
        s = session(reg, counted=counted)
        first = s.rid
        assert pair(s) == ["p0", "d0"]
        reg.mark_dead("p0", "worker process exited with code -9")  # fails the request with 503
        waiting = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.01)
        assert pair(s) == ["p1", "d1"] and s.rid != first and not waiting.done()
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[7], finish_reason="length"))
        return first, s, await waiting

    first, s, delta = asyncio.run(scenario())
    assert delta.token_ids == [7] and counted == [1]
    assert client(reg, "p1").rids() == [s.rid] and client(reg, "d1").rids() == [s.rid]
    assert first in client(reg, "d0").aborted and first in client(reg, "p0").aborted
    assert len(reg.table) == 0


def test_dead_decode_with_one_decode_left_keeps_the_live_prefill_worker():
    reg = registry("p0", "d0", "d1")

    async def scenario():
        s = session(reg)
        reg.mark_dead("d0", "worker process exited with code -9")
        waiting = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.01)
        assert pair(s) == ["p0", "d1"]
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[5], finish_reason="length"))
        return await waiting

    assert asyncio.run(scenario()).token_ids == [5]


@pytest.mark.parametrize("case", ["after a token", "retries=0", "status 500", "only one pair", "second death"])
def test_no_retry(case):
    reg, counted = registry("p0", "p1", "d0", "d1"), []
    if case == "only one pair":
        reg = registry("p0", "d0")

    async def scenario():
        s = session(reg, retries=0 if case == "retries=0" else 1, counted=counted)
        if case == "after a token":
            reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[3]))
            assert (await s.next()).token_ids == [3]
        if case == "second death":
            reg.mark_dead("p0", "gone")
            waiting = asyncio.ensure_future(s.next())
            await asyncio.sleep(0.01)
            reg.mark_dead("d1", "gone too")
            return await waiting
        if case == "status 500":
            reg.on_tokens("d0", TokenDelta.failed(s.rid, "KV pool too small", 500))
        else:
            reg.mark_dead("d0", "worker process exited with code -9")
        return await s.next()

    with pytest.raises(APIError) as e:
        asyncio.run(scenario())
    assert e.value.status == (500 if case == "status 500" else 503)
    assert counted == ([1] if case == "second death" else [])
    assert len(reg.table) == 0


def test_reroute_prefers_a_disjoint_pair_and_never_returns_the_failed_one():
    reg = registry("p0", "p1", "d0", "d1")
    route = reg.route()
    assert [h.worker_id for h in reg.reroute(route).targets] == ["p1", "d1"]
    reg.handles["p1"].state = DEAD  # no disjoint pair: one worker of the failed pair replaced
    assert [h.worker_id for h in reg.reroute(route).targets] == ["p0", "d1"]
    reg.handles["d1"].state = DEAD
    assert reg.reroute(route) is None  # p0 + d0 is the failed pair itself
    reg.handles["p1"].state = "ready"
    reg.handles["d1"].state = DEAD
    assert [h.worker_id for h in reg.reroute(route).targets] == ["p1", "d0"]


def hand_back(reg: Registry, s: GenerationSession, switching: bool = True) -> str:
    """The route's decode worker (out of rotation when ``switching``) hands ``s`` back; its id."""
    d = s.route.stream_from.worker_id
    if switching:
        reg.handles[d].state = SWITCHING
    reg.on_tokens(d, TokenDelta.failed(s.rid, "its decode worker is changing role", 503, handed_back=True))
    return d


def test_a_hand_back_is_sent_again_without_using_a_retry():
    reg, counted, handed = registry("p0", "d0", "d1"), [], []

    async def scenario():
        s = session(reg, retries=0, counted=counted, handed=handed)
        first = s.rid
        assert pair(s) == ["p0", "d0"]
        waiting = asyncio.ensure_future(s.next())
        hand_back(reg, s)
        await asyncio.sleep(0.01)
        assert pair(s) == ["p0", "d1"] and s.rid == f"{first}~1" and not waiting.done()
        reg.on_tokens("d1", TokenDelta(rid=s.rid, token_ids=[7], finish_reason="length"))
        return first, s, await waiting

    first, s, delta = asyncio.run(scenario())
    assert delta.token_ids == [7] and handed == [1] and counted == [] and s.retries_left == 0
    assert first in client(reg, "p0").aborted and first in client(reg, "d0").aborted  # the old attempt
    assert len(reg.table) == 0


def test_a_hand_back_leaves_the_retry_to_a_death_after_it():
    reg, counted, handed = registry("p0", "p1", "d0", "d1", "d2"), [], []

    async def scenario():
        s = session(reg, retries=1, counted=counted, handed=handed)
        waiting = asyncio.ensure_future(s.next())
        hand_back(reg, s)
        await asyncio.sleep(0.01)
        reg.mark_dead(s.route.stream_from.worker_id, "worker process exited with code -9")
        await asyncio.sleep(0.01)
        reg.on_tokens(s.route.stream_from.worker_id, TokenDelta(rid=s.rid, token_ids=[5], finish_reason="length"))
        return await waiting

    assert asyncio.run(scenario()).token_ids == [5]
    assert handed == [1] and counted == [1]


def test_hand_backs_are_bounded_then_counted_as_retries():
    reg, counted, handed = registry("p0", "d0", "d1"), [], []

    async def scenario():
        s = session(reg, retries=1, counted=counted, handed=handed)
        waiting = asyncio.ensure_future(s.next())
        for _ in range(HANDBACK_LIMIT + 1):  # the last one uses the retry
            hand_back(reg, s, switching=False)
            await asyncio.sleep(0.01)
            assert not waiting.done()
        hand_back(reg, s, switching=False)  # no retry left: the client gets the 503
        return await waiting

    with pytest.raises(APIError) as e:
        asyncio.run(scenario())
    assert e.value.status == 503 and "changing role" in e.value.message
    assert len(handed) == HANDBACK_LIMIT and counted == [1]
    assert len(reg.table) == 0


def dying_or_answering(dies: bool):
    """A script for ``ScriptedColocated``: fail every request with 503 (its worker died) or answer 2 tokens."""

    def script(rid, resume):
        if dies:
            return [TokenDelta.failed(rid, "worker w0 is unavailable", 503)]
        return [TokenDelta(rid=rid, token_ids=[28]), TokenDelta(rid=rid, token_ids=[29], finish_reason="length")]

    return script


def handing_back_or_answering(hands_back: bool):
    """A script for ``ScriptedColocated``: hand every request back (503, ``handed_back``) or answer 2 tokens."""

    def script(rid, resume):
        if hands_back:
            return [TokenDelta.failed(rid, "worker w0 is changing role", 503, handed_back=True)]
        return [TokenDelta(rid=rid, token_ids=[28]), TokenDelta(rid=rid, token_ids=[29], finish_reason="length")]

    return script


def counter(metrics: str, name: str) -> float:
    samples = [float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(name)]
    assert len(samples) == 1, samples  # one counter, no labels
    return samples[0]


def _post_past_a_first_worker(tokenizer, retries: int, stream: bool, first_worker) -> tuple:
    """(response, /metrics text, context) of one completion through a colocated router of workers w0
    and w1, where w0 acts as ``first_worker(True)`` and w1 as ``first_worker(False)``."""
    cfg = PdserveConfig.model_validate(
        {"server": {"health_interval_s": 0.05}, "cluster": {"mode": "colocated", "fresh_pair_retries": retries}}
    )
    specs = [WorkerSpec("w0", "colocated", "inproc://w0"), WorkerSpec("w1", "colocated", "inproc://w1")]

    def make(spec, on_tokens, on_stats):
        return ScriptedColocated(spec, on_tokens, on_stats, first_worker(spec.worker_id == "w0"))

    ctx = build_context(cfg, tokenizer, "fake-model", specs, make)
    with TestClient(create_app(ctx)) as http:
        assert http.get("/health").status_code == 200
        r = http.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": stream, "return_token_ids": True}
        )
        metrics = http.get("/metrics").text
    return r, metrics, ctx


@pytest.mark.parametrize("stream", [False, True])
def test_http_hand_back_moves_its_counter_by_exactly_one_and_not_the_retries(tokenizer, stream):
    r, metrics, ctx = _post_past_a_first_worker(tokenizer, 0, stream, handing_back_or_answering)
    assert r.status_code == 200, r.text  # with no retry allowed: a hand-back is none
    assert ('"token_ids":[28]' in r.text) if stream else r.json()["choices"][0]["token_ids"] == [28, 29]
    assert counter(metrics, "pdserve_router_handbacks_total") == 1
    assert counter(metrics, "pdserve_router_retries_total") == 0
    assert len(ctx.table) == 0


@pytest.mark.parametrize("retries,stream", [(1, False), (1, True), (0, False)])
def test_http_retry_moves_the_counter_by_exactly_one(tokenizer, retries, stream):
    r, metrics, ctx = _post_past_a_first_worker(tokenizer, retries, stream, dying_or_answering)
    samples = [float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("pdserve_router_retries_total")]
    assert len(samples) == 1, samples  # one counter, no labels
    retried = samples[0]
    if retries:
        assert r.status_code == 200, r.text
        assert ('"token_ids":[28]' in r.text) if stream else r.json()["choices"][0]["token_ids"] == [28, 29]
        assert retried == 1
    else:
        assert r.status_code == 503 and "worker w0 is unavailable" in r.json()["error"]["message"]
        assert retried == 0
    assert len(ctx.table) == 0


def test_prefill_death_after_the_first_token_leaves_the_decoding_request_alone():
    """Chaos finding: every request routed through a prefill worker failed with 503 when it died,
    also those long past their prefill and decoding on a live decode worker."""
    reg = registry("p0", "d0")

    async def scenario():
        s = session(reg)
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4]))
        assert (await s.next()).token_ids == [4]
        assert reg.mark_dead("p0", "worker process exited with code -9") == []
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[6], finish_reason="length"))
        return await s.next()

    assert asyncio.run(scenario()).token_ids == [6]
    assert len(reg.table) == 0


def test_decode_death_after_the_first_token_still_fails_the_request():
    reg = registry("p0", "d0")

    async def scenario():
        s = session(reg)
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4]))
        await s.next()
        assert reg.mark_dead("d0", "worker process exited with code -9") == [s.rid]
        return await s.next()

    with pytest.raises(APIError) as e:
        asyncio.run(scenario())
    assert e.value.status == 503 and "d0" in e.value.message


def stats_of(reg: Registry, wid: str, instance: str = "i1", page_size: int = 1) -> WorkerStats:
    return WorkerStats(
        worker_id=wid,
        instance=instance,
        role=reg.handles[wid].spec.role,
        model="m",
        capacity_tokens=100,
        max_model_len=100,
        page_size=page_size,
    )


def test_worker_back_as_a_new_process_within_the_lease_fails_what_the_old_one_held():
    """Chaos finding: an external worker killed and started again faster than worker_timeout_s
    never went dead, so the requests the old process held waited for the request timeout."""
    reg = registry("p0", "p1", "d0", "d1")
    reg.on_stats("d0", stats_of(reg, "d0", "i1"))
    restarts = reg.handles["d0"].restarts

    async def scenario():
        s = session(reg)
        reg.on_tokens("d0", TokenDelta(rid=s.rid, token_ids=[4]))
        await s.next()
        reg.on_stats("d0", stats_of(reg, "d0", "i1"))  # same process: nothing happens
        assert len(reg.table) == 1
        reg.on_stats("d0", stats_of(reg, "d0", "i2"))
        return await asyncio.wait_for(s.next(), 1)

    with pytest.raises(APIError) as e:
        asyncio.run(scenario())
    assert e.value.status == 503 and "worker d0 restarted (a new process answers at tcp://d0)" in e.value.message
    assert reg.handles["d0"].state == "ready" and reg.handles["d0"].restarts == restarts + 1


def test_decode_worker_with_a_page_size_no_prefill_worker_has_is_never_routed_to():
    """Chaos finding: a decode worker restarted with another page size was ready, so requests were
    routed to it and every one failed its KV handshake."""
    reg = registry("p0", "d0", "d1")
    reg.on_stats("d1", stats_of(reg, "d1", "i2", page_size=8))
    assert reg.handles["d1"].state == "starting"
    assert (
        "its KV page size 8 matches no prefill worker's (1): no KV can move between them; start it with "
        "--page-size 1" in reg.health()[1]
    )
    assert all([h.worker_id for h in reg.route().targets] == ["p0", "d0"] for _ in range(3))
    reg.on_stats("d1", stats_of(reg, "d1", "i3", page_size=1))
    assert reg.handles["d1"].state == "ready"


def test_fresh_pair_retries_flag_and_default():
    from server.launch.args import build_parser, load_config

    assert PdserveConfig().cluster.fresh_pair_retries == 1
    args = build_parser().parse_args(["launch", "--fresh-pair-retries", "0"])
    assert load_config(args, "launch").cluster.fresh_pair_retries == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["launch", "--fresh-pair-retries", "one"])
