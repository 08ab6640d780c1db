"""One-token requests answered by the prefill worker itself (``prefill_worker.one_token``), with the
real schedulers in one process (``PDHarness``: loopback transport, the tiny model): the router gets
one delta with the token, its logprobs and the prompt logprobs, equal to the same request through the
decode worker and to transformers; nothing reaches the decode worker, nothing is written, the
prompt's KV is in the prefill worker's radix cache and both pools end clean. An EOS token ends it
"stop", a request that is not a first prefill of one token is refused (400), and a role switch hands
a queued one back. (Through the router and real processes: tests/e2e/test_pd_http.py.)"""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import ROUTER, PDHarness, checked_harnesses
from prefill_worker.one_token import NOT_ONE_TOKEN, final_delta
from prefill_worker.switch_away import SWITCHING_AWAY, hand_back_unwritten
from tests.support.models import hf_greedy
from tests.support.pd import pd_cfg, pd_prompts
from transfer.wire.outbox import Conn
from transfer.wire.protocol import PrefillRequest, TokenDelta, ids_frame
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

ONE = SamplingParams(max_new_tokens=1, temperature=0, logprobs=2, prompt_logprobs=1)
PROMPT, OTHER = pd_prompts(2, lo=20, hi=24, seed=5)


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda: PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1], eos=(96,)))


def _drain(h: PDHarness) -> list[TokenDelta]:
    decode_deltas = []
    for _ in range(100):
        if not h.busy:
            return decode_deltas
        decode_deltas += h.step()
    raise AssertionError("the harness did not drain")


def test_the_prefill_worker_answers_a_one_token_request_itself(harness, tiny):
    h = harness()
    h.answer("a", PROMPT, ONE)
    assert _drain(h) == [] and not h.to_decode and not h.decode.jobs  # the decode worker never heard of it
    (d,) = h.router_inbox
    assert (d.rid, d.token_ids, d.finish_reason, d.error) == ("a", hf_greedy(tiny[2], PROMPT, 1), "length", None)
    assert d.prompt_tokens == len(PROMPT) and len(d.prompt_logprobs) == len(PROMPT) and len(d.top_logprobs[0]) == 2
    assert h.prefill.stats.direct_answers == 1 and h.prefill.transfer_bytes == 0
    assert h.prefill.stats.finished_requests == 1 and h.prefill.stats.generation_tokens == 1
    usage = h.prefill.kv.usage([])
    assert usage.used == 0 and usage.cached >= len(PROMPT) // h.prefill.kv.page_size  # the prompt, for prefix hits

    h.router_inbox.clear()
    h.submit("b", PROMPT, ONE)  # the same request through the decode worker: the same delta
    (via_decode,) = _drain(h)
    assert via_decode.token_ids == d.token_ids and via_decode.finish_reason == "length"
    assert via_decode.logprobs == pytest.approx(d.logprobs) and via_decode.top_logprobs == d.top_logprobs
    assert h.router_inbox == [] and h.prefill.stats.direct_answers == 1


@pytest.mark.parametrize(
    "params,generation",
    [(SamplingParams(max_new_tokens=2, temperature=0), 0), (SamplingParams(max_new_tokens=1, temperature=0), 1)],
)
def test_only_a_first_prefill_of_one_token_is_answered_directly(harness, params, generation):
    h = harness()
    msg = PrefillRequest(rid="x", room=1, generation=generation, params=params, decode_worker="", answer_router=True)
    (d,) = h.deliver(h.prefill.handle(Conn(ROUTER), msg, [ids_frame(PROMPT)]), False)
    assert d.error_status == 400 and NOT_ONE_TOKEN in d.error and f"max_new_tokens {params.max_new_tokens}" in d.error
    assert not h.prefill.jobs


def test_an_eos_token_ends_it_stop_unless_eos_is_ignored():
    def delta(reason=None):
        return TokenDelta(rid="r", token_ids=[7], logprobs=[-0.5], top_logprobs=[[(7, -0.5)]], finish_reason=reason)

    stop = final_delta(delta(), (7,), ignore_eos=False)
    assert (stop.finish_reason, stop.token_ids, stop.stop_token_id, stop.stop_logprob) == ("stop", [], 7, -0.5)
    assert stop.stop_top_logprobs == [(7, -0.5)] and stop.logprobs == []
    assert final_delta(delta(), (7,), ignore_eos=True).finish_reason == "length"
    assert final_delta(delta(), (8,), ignore_eos=False).token_ids == [7]
    assert final_delta(delta("stop"), (), ignore_eos=False).finish_reason == "stop"  # a stop token ended it


def test_a_role_switch_hands_a_queued_one_back(harness):
    h = harness()
    h.answer("q", OTHER, ONE)
    out = hand_back_unwritten(h.prefill)
    assert out.messages == []  # no decode worker to tell
    (d,) = out.deltas
    assert (d.rid, d.error_status, d.handed_back) == ("q", 503, True) and SWITCHING_AWAY in d.error
    assert not h.prefill.jobs and not h.prefill.waiting
