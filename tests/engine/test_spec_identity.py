"""Speculative decoding (n-gram drafts) in the colocated scheduler gives the tokens, logprobs and
finish reasons of decoding without it, token for token: greedy and seeded sampling, penalties and
logit_bias, max_tokens / stop_token_ids cutting inside an accepted run, mixed batches with
prefill, retracts. Every scenario asserts drafts were accepted (so it cannot pass vacuously) and
the pool invariant (free + used + cached == total) after every step, no page or lock left."""

from __future__ import annotations

import random

import pytest

from engine.model_runner import ModelRunner
from engine.scheduler.colocated import ColocatedScheduler
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

EOS = 96
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)
PLAIN = dict(speculative_method="off")  # the reference: every step decodes one token per request


def make(model, spec: bool, page_size=4, kv_pool_tokens=4096, eos=(EOS,), **kw) -> ColocatedScheduler:
    cfg, weights = model[0], model[1]
    runner = ModelRunner(engine_cfg(kv_pool_tokens=kv_pool_tokens, page_size=page_size), cfg, weights)
    return ColocatedScheduler(runner, sched_cfg(**(SPEC if spec else PLAIN), **kw), eos)


def run(sched: ColocatedScheduler, jobs: list[tuple[list[int], SamplingParams]]) -> dict:
    """Every job's (token ids, logprobs, top logprobs, finish reason, stop token), checking the pool
    after every step; in the end nothing is held but the radix cache, which holds no lock."""
    out = {f"r{i}": [[], [], [], None, None] for i in range(len(jobs))}
    for i, (prompt, params) in enumerate(jobs):
        sched.add(b"", GenerateRequest(rid=f"r{i}", params=params), prompt)
    while sched.has_work:
        for d in sched.step().outbox.deltas:
            assert d.error is None, d.error
            o = out[d.rid]
            o[0] += d.token_ids
            o[1] += d.logprobs
            o[2] += d.top_logprobs
            if d.finish_reason is not None:
                o[3], o[4] = d.finish_reason, d.stop_token_id
        sched.check_integrity()
        for r in sched.running:  # rejected positions' pages went back: a running row holds its kv_len's
            assert len(r.kv.pages) == sched.kv.pages_for(r.kv_len), (r.rid, len(r.kv.pages), r.kv_len)
    assert not sched.requests and not sched.live_handles()
    assert sched.kv.tree is None or sched.kv.tree.protected_size() == 0, "a radix lock was not released"
    return out


def same_with_and_without(model, jobs, min_accepted=1, **kw) -> ColocatedScheduler:
    """Run ``jobs`` on a plain and a speculative scheduler; assert identical results and that at
    least ``min_accepted`` draft tokens were accepted. Returns the speculative scheduler."""
    plain = run(make(model, False, **kw), jobs)
    sched = make(model, True, **kw)
    spec = run(sched, jobs)
    assert_same(spec, plain)
    assert sched.spec.accepted_tokens >= min_accepted, (sched.spec.draft_tokens, sched.spec.accepted_tokens)
    assert sched.stats.generation_tokens == make_count(plain)
    return sched


def assert_same(spec: dict, plain: dict) -> None:
    """Token ids, finish reasons and stop tokens equal; logprobs equal to float32 rounding (the
    verify step's rows are decode rows too, but a step of other rows and row counts)."""
    assert {k: (o[0], o[3], o[4]) for k, o in spec.items()} == {k: (o[0], o[3], o[4]) for k, o in plain.items()}
    for k, o in spec.items():
        assert [x is None for x in o[1]] == [x is None for x in plain[k][1]]
        assert [x for x in o[1] if x is not None] == pytest.approx([x for x in plain[k][1] if x is not None], abs=1e-4)
        for a, b in zip(o[2], plain[k][2]):
            assert (a is None) == (b is None)
            if a is not None:
                assert [t for t, _ in a] == [t for t, _ in b]
                assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-4)


def make_count(out: dict) -> int:
    """Deltas a run emits: one per output token, plus the stop token's own delta."""
    return sum(len(o[0]) + (o[4] is not None) for o in out.values())


LOOPING = (55, 30, 7)  # the tiny model answers a run of these with runs of its own


def repeating_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a passage or one token, so the drafter finds what follows again."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append([LOOPING[(i // 2 + seed) % len(LOOPING)]] * rng.randint(8, 14))
            continue
        passage = [rng.randrange(0, EOS) for _ in range(rng.randint(6, 14))]
        out.append([rng.randrange(0, EOS) for _ in range(rng.randint(0, 5))] + passage * 3)
    return out


def greedy(n=24, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("mixed", [True, False])
def test_greedy_tiny_batch_identical(tiny, mixed):
    jobs = [(p, greedy(48, logprobs=2)) for p in repeating_prompts(5)]
    sched = same_with_and_without(tiny, jobs, min_accepted=10, mixed_batches=mixed)
    assert sched.spec.accepted_tokens < sched.spec.draft_tokens  # rejections were rolled back too


def test_seeded_sampling_and_penalties_identical(tiny):
    ps = repeating_prompts(6, seed=1)
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.3, seed=7, ignore_eos=True, logprobs=1),
        SamplingParams(max_new_tokens=24, temperature=0.7, top_k=5, seed=11, ignore_eos=True),
        greedy(repetition_penalty=1.2),
        greedy(frequency_penalty=0.4, presence_penalty=0.2),
        greedy(logit_bias=((3, 2.0), (5, -1.0))),
        SamplingParams(max_new_tokens=24, temperature=0.5, top_p=0.9, seed=3, ignore_eos=True, min_p=0.05),
    ]
    same_with_and_without(tiny, list(zip(ps, params)), min_accepted=5)


def test_max_tokens_and_stop_ids_cut_inside_accepted_runs(tiny):
    """Lengths and stop ids that land inside runs the speculative scheduler accepts."""
    ps = repeating_prompts(4, seed=2)
    ref = run(make(tiny, False), [(p, greedy(40)) for p in ps])
    jobs = []
    for i, p in enumerate(ps):
        toks = ref[f"r{i}"][0]
        jobs.append((p, greedy(7 + i)))  # max_tokens anywhere
        jobs.append((p, greedy(40, stop_token_ids=(toks[9 + i],))))  # a stop id met mid-output
    sched = make(tiny, True)
    out = run(sched, jobs)
    assert_same(out, run(make(tiny, False), jobs))
    assert sched.spec.accepted_tokens > 0
    assert {o[3] for o in out.values()} == {"length", "stop"}


def test_retracts_and_a_small_pool(tiny):
    """A pool too small for every request at once: retracts (forced too) and draft pages that do not
    fit fall back to plain decode rows; outputs unchanged."""
    jobs = [(p, greedy(30)) for p in repeating_prompts(6, seed=3)]
    same_with_and_without(tiny, jobs, min_accepted=5, kv_pool_tokens=256, retract_test_interval=5)


def test_tokens_per_step_rise_with_acceptance(tiny):
    """The point of it: fewer decode steps for the same tokens when drafts are accepted."""
    jobs = [([55] * 12, greedy(32))]
    plain, spec = make(tiny, False), make(tiny, True)
    assert_same(run(spec, jobs), run(plain, jobs))
    assert spec.stats.decode_steps < plain.stats.decode_steps
    assert plain.stats.decode_steps - spec.stats.decode_steps <= spec.spec.accepted_tokens


def test_embedded_repeat_passage_identical(embedded):
    """SmolLM2 asked to repeat a passage: drafts from the prompt are accepted; greedy output and
    logprobs are those of plain decoding."""
    cfg, weights, tok, _ = embedded
    passage = (
        "The lighthouse keeper climbed the stairs at dusk, lit the great lamp, and wrote in the log "
        "that the sea was calm, the wind was from the west, and no ships had passed since noon."
    )
    chat = tok.apply_chat_template([{"role": "user", "content": f"{passage}\n\nRepeat the passage above verbatim."}])
    prompt = tok.encode(chat, add_special_tokens=False)
    eos = tuple(cfg.eos_token_ids) or tuple(tok.eos_token_ids)
    jobs = [
        (prompt, SamplingParams(max_new_tokens=48, temperature=0, logprobs=1)),
        (prompt, SamplingParams(max_new_tokens=40, temperature=0.8, seed=5)),
    ]
    model = (cfg, weights)
    sched = same_with_and_without(model, jobs, min_accepted=15, page_size=16, eos=eos)
    assert sched.spec.accepted_tokens >= sched.spec.draft_tokens // 3


def test_choices_sharing_a_prompt(tiny):
    """n > 1 as the router sends it: choices of one prompt share its cached pages, each decodes on its own."""
    p = [55] * 13
    params = [
        greedy(24),
        *(SamplingParams(max_new_tokens=24, temperature=0.2, seed=s, ignore_eos=True) for s in (1, 2)),
    ]
    same_with_and_without(tiny, [(p, sp) for sp in params], min_accepted=5)


def choices(params: SamplingParams, n: int, ranked: bool = False) -> list[SamplingParams]:
    """The ``n`` requests the router makes of one prompt's ``n`` (or ``best_of``) choices."""
    from server.router.parallel import choice_params

    return [choice_params(params, i, ranked) for i in range(n)]


def test_parallel_choices_each_equal_without_speculation(tiny):
    """``n = 4`` seeded choices of one prompt and ``best_of = 3`` of another (ranked: logprobs on),
    with the router's per-choice seeds, batched together as a colocated router sends them: each
    choice equals its run without speculation, the choices differ from one another, drafts are
    accepted, and ``best`` keeps the same choices."""
    from server.router.parallel import best

    sampled = choices(SamplingParams(max_new_tokens=24, temperature=0.2, seed=21, ignore_eos=True), 4)
    ranked = choices(SamplingParams(max_new_tokens=20, temperature=0.3, top_k=8, seed=21, ignore_eos=True), 3, True)
    jobs = [([7] * 12, sp) for sp in sampled] + [([55] * 13, sp) for sp in ranked]
    plain = run(make(tiny, False), jobs)
    sched = make(tiny, True, spec_max_batch_tokens=64)  # every row of the 7 drafts
    spec = run(sched, jobs)
    assert_same(spec, plain)
    assert sched.spec.accepted_tokens >= 20, (sched.spec.draft_tokens, sched.spec.accepted_tokens)
    assert len({tuple(spec[f"r{i}"][0]) for i in range(4)}) == 4, "seeded choices should differ"
    assert len({tuple(spec[f"r{i}"][0]) for i in range(4, 7)}) == 3

    class Run:  # what ``best`` ranks: a choice's logprobs
        def __init__(self, rid):
            self.rid, self.logprobs, self.index = rid, spec[rid][1], 0

    kept = [r.rid for r in best([Run(f"r{i}") for i in range(4, 7)], 2)]
    ref = sorted(range(4, 7), key=lambda i: -sum(plain[f"r{i}"][1]))[:2]
    assert kept == [f"r{i}" for i in sorted(ref)]


def test_cached_output_pages_hold_the_accepted_tokens(tiny):
    """Pages a speculative request leaves in the radix cache (prompt + output, computed by verify
    steps) serve a later prompt that extends it exactly as the plain scheduler's do."""
    first = ([55] * 12, greedy(29))
    outs = {}
    for spec in (False, True):
        sched = make(tiny, spec)
        a = run(sched, [first])["r0"][0]
        later = [(first[0] + a + [30] * 6, greedy(20))]
        outs[spec] = run(sched, later)
        assert sched.stats.cached_prompt_tokens >= 40  # the output's pages were matched
    assert_same(outs[True], outs[False])


def test_sliding_window_hybrid_identical_and_matches_hf(swa_model):
    """Window 8 over a small SWA pool: drafted positions take SWA pages, rejected ones give them
    back, pages behind the window are released; greedy equals transformers' and plain decoding's."""
    from tests.support.swa import PAGE, hf_reference

    prompts = [[55] * 12, [30] * 10, [7, 8, 9] * 5]
    jobs = [(p, greedy(16)) for p in prompts]
    kw = dict(page_size=PAGE, kv_pool_tokens=1024)
    cfg, weights, hf = swa_model
    plain = run(make_swa(swa_model, False, **kw), jobs)
    sched = make_swa(swa_model, True, **kw)
    spec = run(sched, jobs)
    assert_same(spec, plain)
    assert sched.spec.accepted_tokens > 0
    assert [spec[f"r{i}"][0] for i in range(len(prompts))] == [hf_reference(hf, p, 16)[0] for p in prompts]
    assert sched.kv.usage([], "swa").used == 0


def make_swa(swa_model, spec: bool, page_size: int, kv_pool_tokens: int) -> ColocatedScheduler:
    cfg, weights, _ = swa_model
    eng = engine_cfg(kv_pool_tokens=kv_pool_tokens, page_size=page_size, swa_pool_tokens=64)
    return ColocatedScheduler(ModelRunner(eng, cfg, weights), sched_cfg(**(SPEC if spec else PLAIN)), (EOS,))
