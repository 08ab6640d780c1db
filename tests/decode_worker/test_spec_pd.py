"""Speculative decoding (n-gram drafts) in a PD decode worker gives the tokens, logprobs and finish
reasons of the same PD pair without it, token for token: the drafts come from prompt + output of
requests whose prompt KV arrived from the prefill worker (loopback transport), and hold with the
decode radix cache, forced retracts offloaded to the host pool and resumed, retracts recomputed
by the prefill worker, and a continuation. Every scenario asserts that drafts were accepted on the
decode worker (so it cannot pass vacuously) and, after every step, the decode pool's invariant
(free + used + cached == total) and that a running request holds exactly its ``kv_len``'s pages;
at the end the harness checks both pools and the host pool clean."""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PREFILL_ADDR, ROUTER, PDHarness, checked_harnesses
from tests.engine.test_spec_identity import PLAIN, SPEC, assert_same, greedy, repeating_prompts
from tests.support.metrics_scrape import scrape, val
from tests.support.models import hf_greedy
from tests.support.pd import pd_cfg
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # PD pairs in one process, each scenario run twice


@pytest.fixture
def harness(tiny):
    def build(spec: bool, local: int = 0, **d):
        cfg_d = pd_cfg(**d, **(SPEC if spec else PLAIN))
        cfg_d.cluster.local_prefill_max_tokens = local  # prompts up to this long prefilled on the decode worker
        cfg_d.cluster.local_prefill_backlog_ratio = 0.0
        return PDHarness(pd_cfg(), cfg_d, tiny[0], tiny[1])

    yield from checked_harnesses(build)


def drain(h: PDHarness, out: dict) -> dict:
    """Step ``h`` until idle, collecting each request's (token ids, logprobs, top logprobs, finish
    reason, stop token) into ``out``; the decode pool is checked after every step."""
    for _ in range(5000):
        if not h.busy:
            break
        checked_step(h, out)
    assert not h.busy, "PD harness did not drain"
    return out


def checked_step(h: PDHarness, out: dict) -> None:
    """One step of ``h``, its deltas collected into ``out``; then the decode pool's checks."""
    dec = h.decode
    for d in h.step():
        assert d.error is None, d.error
        o = out.setdefault(d.rid, [[], [], [], None, None])
        o[0] += d.token_ids
        o[1] += d.logprobs
        o[2] += d.top_logprobs
        if d.finish_reason is not None:
            o[3], o[4] = d.finish_reason, d.stop_token_id
    dec.check_integrity()
    for r in dec.running:  # rejected positions' pages went back
        assert len(r.kv.pages) == dec.kv.pages_for(r.kv_len), (r.rid, len(r.kv.pages), r.kv_len)


def run(h: PDHarness, jobs: list[tuple[list[int], SamplingParams]]) -> dict:
    for i, (prompt, params) in enumerate(jobs):
        h.submit(f"r{i}", prompt, params)
    return drain(h, {})


def same_with_and_without(harness, jobs, min_accepted=1, **d) -> PDHarness:
    """``jobs`` on a plain and a speculative PD pair (decode options ``d``): identical results and
    at least ``min_accepted`` draft tokens accepted by the decode worker. Returns the speculative pair."""
    plain = run(harness(False, **d), jobs)
    h = harness(True, **d)
    assert_same(run(h, jobs), plain)
    spec = h.decode.spec
    assert spec.accepted_tokens >= min_accepted, (spec.draft_tokens, spec.accepted_tokens)
    assert h.prefill.transfer_bytes > 0  # the prompts' KV came over the wire
    return h


def test_greedy_identical_and_equal_to_transformers(harness, tiny):
    ps = repeating_prompts(5)
    h = same_with_and_without(harness, [(p, greedy(32, logprobs=2)) for p in ps], min_accepted=10)
    assert h.decode.spec.accepted_tokens < h.decode.spec.draft_tokens  # rejections were rolled back too
    h2 = harness(True)
    out = run(h2, [(p, greedy(20)) for p in ps[:2]])
    assert [out[f"r{i}"][0] for i in range(2)] == [hf_greedy(tiny[2], p, 20) for p in ps[:2]]


def test_seeded_sampling_and_penalties_identical(harness):
    ps = repeating_prompts(6, seed=1)
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.3, seed=7, ignore_eos=True, logprobs=1),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_k=5, seed=11, ignore_eos=True),
        greedy(repetition_penalty=1.2),
        greedy(frequency_penalty=0.4, presence_penalty=0.2),
        greedy(logit_bias=((3, 2.0), (5, -1.0))),
        SamplingParams(max_new_tokens=24, temperature=0.5, top_p=0.9, seed=3, ignore_eos=True, min_p=0.05),
    ]
    same_with_and_without(harness, list(zip(ps, params)), min_accepted=5)


def test_forced_retracts_offload_and_resume(harness):
    """A retract every 3 decode steps: victims go to the host pool and come back, drafting again."""
    jobs = [(p, greedy(30)) for p in repeating_prompts(4, seed=3)]
    h = same_with_and_without(harness, jobs, min_accepted=5, retract_test_interval=3)
    rs = h.decode.retract.stats
    assert h.decode.stats.retractions > 0 and rs.offloaded > 0 and rs.resumed == rs.offloaded


def test_retracts_recomputed_by_the_prefill_worker(harness):
    """No host pool and a retract every 4 decode steps: victims are recomputed (prompt + output so far shipped
    again from the prefill worker) and keep drafting from their whole sequence."""
    jobs = [(p, greedy(24)) for p in repeating_prompts(4, seed=4)]
    h = same_with_and_without(harness, jobs, min_accepted=5, host_gb=0.0, retract_test_interval=4)
    assert h.decode.retract.stats.recomputed > 0


@pytest.mark.parametrize("mixed", [True, False])
def test_local_prefill_beside_drafting_rows(harness, mixed):
    """Short prompts prefilled on the decode worker itself (their chunks in the decode steps, one
    forward with the drafting rows when ``mixed``), long ones by the prefill worker."""
    ps = repeating_prompts(6, seed=5)
    jobs = [(p, greedy(24)) for p in ps]
    h = same_with_and_without(harness, jobs, min_accepted=5, local=20, mixed_batches=mixed)
    local = h.decode.local.counters()
    assert 0 < local["local_prefill_tokens"] < sum(map(len, ps)), local


def test_decode_radix_cache_serves_output_pages(harness):
    """A later prompt extending an earlier request's prompt + output: the decode radix cache holds
    the accepted tokens' pages (never a rejected one) and matches them as the plain pair's does."""
    first = ([55] * 12, greedy(29))
    outs = {}
    for spec in (False, True):
        h = harness(spec)
        a = run(h, [first])["r0"][0]
        h.submit("later", first[0] + a + [30] * 6, greedy(20))
        outs[spec] = drain(h, {})
        assert h.decode.stats.cached_prompt_tokens >= 40  # the output's pages were matched
    assert_same(outs[True], outs[False])
    assert h.decode.spec.accepted_tokens > 0


def test_continuation_drafts_from_the_sent_output(harness):
    """A continuation (prompt + output so far recomputed by the prefill worker, no prefill request):
    the tokens after the sent ones are those of the plain pair."""
    prompt, params = [55] * 10, greedy(30)
    outs = {}
    for spec in (False, True):
        h = harness(spec)
        full = run(h, [(prompt, params)])["r0"][0]
        room = next(h.room)
        msg = GenerateRequest(rid="c", params=params, room=room, prefill_addr=PREFILL_ADDR, resume_output_ids=full[:5])
        h.deliver(h.decode.add(ROUTER, msg, prompt), True)
        outs[spec] = drain(h, {})
        assert outs[spec]["c"][0] == full[5:]
    assert_same(outs[True], outs[False])
    assert h.decode.spec.accepted_tokens > 0


def test_parallel_choices_each_equal_without_speculation(harness):
    """``n = 4`` seeded choices of one prompt as the PD router sends them (per-choice seeds; the first
    choice alone, the others once it has its first token, so the prefill worker serves their prompt
    from its cache): each choice equals its run on the plain pair, the choices differ, and the decode
    worker accepts drafts for them."""
    from tests.engine.test_spec_identity import choices

    params = choices(SamplingParams(max_new_tokens=24, temperature=0.2, seed=21, ignore_eos=True, logprobs=1), 4)
    prompt = [7] * 12
    outs = {}
    for spec in (False, True):
        h = harness(spec, spec_max_batch_tokens=64)  # every row of the 4 drafts
        h.submit("c0", prompt, params[0])
        out: dict = {}
        while not out.get("c0", [[]])[0]:
            checked_step(h, out)
        for i in range(1, 4):
            h.submit(f"c{i}", prompt, params[i])
        outs[spec] = drain(h, out)
        assert h.prefill.stats.cached_prompt_tokens >= 3 * 8  # the later choices' prompt came from the cache
    assert_same(outs[True], outs[False])
    assert len({tuple(o[0]) for o in outs[True].values()}) == 4, "seeded choices should differ"
    assert h.decode.spec.accepted_tokens >= 20, (h.decode.spec.draft_tokens, h.decode.spec.accepted_tokens)


def test_decode_worker_series_move(harness):
    """The colocated worker's series, from the decode worker: the draft counter moves by the draft
    tokens verified, the accepted one by the tokens emitted beyond one per row and step, the
    histogram counts each verified row; a plain decode worker exports zeros."""
    plain = harness(False)
    run(plain, [([55] * 12, greedy(8))])
    m = scrape(plain.decode)
    assert val(m, "pdserve_spec_draft_tokens_total") == val(m, "pdserve_spec_accepted_tokens_total") == 0
    h = harness(True)
    dec = h.decode
    rows, extra, mixed = [], [], dec.executor.mixed

    def counting_mixed(reqs, items):
        decoded, extended = mixed(reqs, items)
        extra.append(len(decoded) - len(reqs))  # one delta per emitted token
        return decoded, extended

    drafts = dec.spec.drafts

    def recording_drafts(reqs, other_tokens):
        ds = drafts(reqs, other_tokens)
        rows.append([len(d) for d in ds if d])
        return ds

    dec.executor.mixed, dec.spec.drafts = counting_mixed, recording_drafts
    m = scrape(dec)
    assert val(m, "pdserve_spec_draft_tokens_total") == 0
    run(h, [([55] * 12, greedy(32)), ([30] * 9, greedy(20))])
    m = scrape(dec)
    assert val(m, "pdserve_spec_draft_tokens_total") == sum(map(sum, rows)) > 0
    assert val(m, "pdserve_spec_accepted_tokens_total") == sum(extra) > 0
    assert val(m, "pdserve_spec_acceptance_length_count") == sum(map(len, rows))
    assert val(m, "pdserve_spec_acceptance_length_sum") == sum(extra)
