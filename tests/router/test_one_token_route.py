"""The router's route for a one-token PD request (``server.router.workers.one_token_route``), over
recording worker doubles: ``max_new_tokens`` 1 goes to the prefill worker alone, asking it to answer
(``PrefillRequest.answer_router``), and its delta from the prefill worker ends the request; a longer
request and a colocated one go as before; a one-token request whose prefill worker dies before
answering is sent again to the other prefill worker alone. (The prefill worker's side:
tests/prefill_worker/test_one_token.py; real processes: tests/e2e/test_pd_http.py.)"""

from __future__ import annotations

import asyncio

import pytest

from server.router.session import GenerationSession
from tests.support.router_doubles import ready_registry
from transfer.wire.protocol import TokenDelta
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def sent(reg) -> dict[str, list[str]]:
    return {w: [x.kind for x in h.client.sent] for w, h in reg.handles.items()}


def session(reg, max_new_tokens: int) -> GenerationSession:
    s = GenerationSession(reg, reg.table, [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens), timeout_s=5)
    s.prepare()
    s.send()
    return s


def test_a_one_token_request_goes_to_its_prefill_worker_alone():
    reg = ready_registry("pd", "p0", "d0")

    async def scenario():
        s = session(reg, 1)
        assert sent(reg) == {"p0": ["answer"], "d0": []}
        reg.on_tokens("p0", TokenDelta(rid=s.rid, token_ids=[9], finish_reason="length"))
        return await s.next()

    d = asyncio.run(scenario())
    assert d.token_ids == [9] and d.finish_reason == "length" and len(reg.table) == 0


@pytest.mark.parametrize(
    "mode,ids,n,want",
    [
        ("pd", ("p0", "d0"), 2, {"p0": ["prefill"], "d0": ["generate"]}),
        ("colocated", ("c0",), 1, {"c0": ["generate"]}),
    ],
)
def test_other_requests_go_as_before(mode, ids, n, want):
    reg = ready_registry(mode, *ids)
    session(reg, n)
    assert sent(reg) == want


def test_a_one_token_request_is_retried_on_the_other_prefill_worker_alone():
    reg = ready_registry("pd", "p0", "p1", "d0")

    async def scenario():
        s = GenerationSession(reg, reg.table, [1, 2, 3], SamplingParams(max_new_tokens=1), timeout_s=5, retries=1)
        s.prepare()
        s.send()
        first = s.route.stream_from.worker_id
        reg.mark_dead(first, "worker process exited with code -9")
        waiting = asyncio.ensure_future(s.next())
        await asyncio.sleep(0.01)
        other = s.route.stream_from.worker_id
        reg.on_tokens(other, TokenDelta(rid=s.rid, token_ids=[4], finish_reason="length"))
        return first, other, await waiting

    first, other, d = asyncio.run(scenario())
    assert {first, other} == {"p0", "p1"} and d.token_ids == [4]
    assert sent(reg) == {first: ["answer"], other: ["answer"], "d0": []}
