"""A continuation (``GenerateRequest.resume_output_ids``) continues a request exactly where an
uninterrupted run would: with the first ``k`` output tokens given, the tokens after ``k`` (and
their logprobs) are those of the run without a break, in the colocated scheduler and in PD (the
decode worker has prompt + output so far prefilled as a recompute and resumes from the last one),
for greedy and seeded sampling, with frequency / presence / repetition penalties and under a
``json_schema`` grammar."""

from __future__ import annotations

import json

import pytest

from bench.harness.pd_harness import PREFILL_ADDR, ROUTER, PDHarness, checked_harnesses
from configs.schema import PdserveConfig
from engine.llm import LLM, run_batch
from engine.model_runner import ModelRunner
from engine.scheduler.base import RequestRejected
from engine.scheduler.colocated import ColocatedScheduler
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.protocol import GenerateRequest, PrefilledLocally
from transfer.wire.sampling_params import SamplingParams, StructuredOutput

N, K = 12, 5
PROMPT = [3, 17, 29, 41, 8, 55, 60, 12, 71, 5]
CASES = {
    "greedy": SamplingParams(max_new_tokens=N, temperature=0, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(max_new_tokens=N, temperature=1.3, seed=7, ignore_eos=True, logprobs=0),
    "penalties": SamplingParams(
        max_new_tokens=N,
        temperature=0.9,
        seed=11,
        frequency_penalty=1.5,
        presence_penalty=1.0,
        repetition_penalty=1.4,
        ignore_eos=True,
    ),
    "greedy-penalties": SamplingParams(
        max_new_tokens=N, temperature=0, frequency_penalty=-0.2, presence_penalty=0.0, ignore_eos=True
    ),
}


def colocated(tiny) -> ColocatedScheduler:
    runner = ModelRunner(engine_cfg(kv_pool_tokens=1024, page_size=4), tiny[0], tiny[1])
    return ColocatedScheduler(runner, sched_cfg(), ())


def run_continuation(sched, rid: str, prompt: list[int], params: SamplingParams, sent: list[int]):
    """Submit a continuation to ``sched`` and step it until idle: (tokens, logprobs, finish)."""
    sched.add(b"", GenerateRequest(rid=rid, params=params, resume_output_ids=sent), prompt)
    toks, lps, finish = [], [], None
    while sched.has_work:
        for d in sched.step().outbox.deltas:
            toks += d.token_ids
            lps += d.logprobs
            finish = d.finish_reason or finish
    return toks, lps, finish


def assert_same_tail(full, cont, k: int) -> None:
    toks, lps, finish = cont
    assert toks == full.token_ids[k:]
    assert finish == full.finish_reason
    if full.logprobs:
        assert lps == pytest.approx(full.logprobs[k:], abs=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_colocated_continuation_is_the_uninterrupted_tail(tiny, case):
    params = CASES[case]
    sched = colocated(tiny)
    full = run_batch(sched, [PROMPT], [params])[0]
    assert len(full.token_ids) == N
    for k in (1, K, N - 1):
        assert_same_tail(full, run_continuation(sched, f"c{k}", PROMPT, params, full.token_ids[:k]), k)
    sched.check_integrity()
    assert sched.kv.usage([]).used == 0


def test_penalties_see_the_sent_tokens_as_output(tiny):
    """The frequency penalty (negative: it favours a repeat) counts only output: a continuation
    whose sent tokens went in as prompt would draw other tokens (so this case would fail above)."""
    params = CASES["greedy-penalties"]
    sched = colocated(tiny)
    full = run_batch(sched, [PROMPT], [params])[0]
    as_prompt = run_batch(sched, [PROMPT + full.token_ids[:K]], [params.model_copy(update={"max_new_tokens": N - K})])
    assert as_prompt[0].token_ids != full.token_ids[K:]


def test_a_continuation_with_nothing_left_is_refused(tiny):
    sched = colocated(tiny)
    params = SamplingParams(max_new_tokens=3, temperature=0)
    with pytest.raises(RequestRejected, match="nothing to generate"):
        sched.add(b"", GenerateRequest(rid="x", params=params, resume_output_ids=[1, 2, 3]), PROMPT)
    with pytest.raises(RequestRejected, match="resume_output_ids"):
        sched.add(b"", GenerateRequest(rid="y", params=params, resume_output_ids=[10_000]), PROMPT)
    assert not sched.has_work


def pd_cfg() -> PdserveConfig:
    return PdserveConfig.model_validate(
        {"engine": {"kv_pool_tokens": 512, "page_size": 4}, "cluster": {"mode": "pd", "transfer_backend": "loopback"}}
    )


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(lambda: PDHarness(pd_cfg(), pd_cfg(), tiny[0], tiny[1]))


def pd_continuation(h: PDHarness, rid: str, params: SamplingParams, sent: list[int]):
    """A continuation as the router sends it in PD: a ``GenerateRequest`` to the decode worker only."""
    msg = GenerateRequest(rid=rid, params=params, room=next(h.room), prefill_addr=PREFILL_ADDR, resume_output_ids=sent)
    h.deliver(h.decode.add(ROUTER, msg, PROMPT), True)
    toks, lps, finish = [], [], None
    for _ in range(1000):
        if not h.busy:
            break
        for d in h.step():
            assert d.rid == rid and d.error is None, d
            toks += d.token_ids
            lps += d.logprobs
            finish = d.finish_reason or finish
    assert not h.busy and not h.router_inbox, h.router_inbox
    return toks, lps, finish


@pytest.mark.parametrize("case", ["greedy", "seeded", "penalties"])
def test_pd_continuation_is_the_uninterrupted_tail(harness, tiny, case):
    params = CASES[case]
    ref = run_batch(colocated(tiny), [PROMPT], [params])[0]  # colocated and PD draw the same stream
    h = harness()
    h.submit("full", PROMPT, params)
    done = h.run()
    assert done["full"]["tokens"] == ref.token_ids
    for k in (1, K):
        assert_same_tail(ref, pd_continuation(h, f"c{k}", params, ref.token_ids[:k]), k)
    assert h.decode.stats.prompt_tokens == 3 * len(PROMPT)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.slow  # the embedded model (a real tokenizer for the grammar)
def test_grammar_continues_from_the_sent_tokens(embedded):
    cfg, weights, tok, _ = embedded
    llm = LLM(engine_cfg(kv_pool_tokens=4096), sched_cfg(), loaded=(cfg, weights, tok))
    prompt = llm.encode_prompt("Describe a person as JSON with a name and an age:")
    so = StructuredOutput(kind="json", spec=json.dumps(SCHEMA))
    for params in (
        SamplingParams(max_new_tokens=40, temperature=0, structured=so),
        SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, structured=so),
    ):
        full = llm.generate_ids([prompt], [params])[0]
        json.loads(full.text)
        k = len(full.token_ids) // 2
        cont = run_continuation(llm.scheduler, "g", prompt, params, full.token_ids[:k])
        assert cont[0] == full.token_ids[k:] and cont[2] == full.finish_reason


def test_a_burst_of_pd_continuations_is_split_between_prefill_and_decode_worker(harness, tiny):
    """The streams of a dead decode worker arrive at once: the decode worker prefills about half of
    the continuations itself (``LocalPrefillQueue.take_continuation``) while the prefill worker
    recomputes the others, and every one is still the uninterrupted tail."""
    params = CASES["seeded"]
    ref = run_batch(colocated(tiny), [PROMPT], [params])[0]
    h = harness()
    ks = {f"c{k}": k for k in (6, 5, 4, 3)}
    for rid, k in ks.items():
        msg = GenerateRequest(
            rid=rid, params=params, room=next(h.room), prefill_addr=PREFILL_ADDR, resume_output_ids=ref.token_ids[:k]
        )
        h.deliver(h.decode.add(ROUTER, msg, PROMPT), True)
    got = {rid: [] for rid in ks}
    for _ in range(1000):
        if not h.busy:
            break
        for d in h.step():
            assert d.error is None, d
            got[d.rid] += d.token_ids
    assert not h.busy
    assert got == {rid: ref.token_ids[k:] for rid, k in ks.items()}
    # c6 went to the prefill worker (nothing queued there yet), c5 (15 tokens, no cache hit) was taken
    # here against its backlog of 15, c4 went there (here 15 + 14 > 15), c3 here (15 + 13 <= 15 + 13)
    assert h.decode.local.tokens == (len(PROMPT) + 5) + (len(PROMPT) + 3)
    assert h.prefill.stats.prefill_computed_tokens == (len(PROMPT) + 6 - 1) + (len(PROMPT) + 4 - 1)
    # the router hears of each one prefilled here, so its prefill worker's death no longer fails it
    assert h.router_messages == [PrefilledLocally(rid="c5"), PrefilledLocally(rid="c3")]
