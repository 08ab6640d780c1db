"""Parallel sampling shares the prompt's KV pages in the colocated scheduler (insert on prefill,
``cache.prefix_share``), on the tiny random model: the choices of one prompt arrive as the
router sends them (the first, then the others once it has its first token) and match the first
one's full prompt pages instead of computing them again; each computes only its last page, into
pages of its own. Seeded and greedy outputs equal those of separate requests (greedy: of HF), the
prompt is prefilled once (the scheduler's prefill token count), and the pool invariant (free + used
+ cached == total, no page owned twice, radix locks consistent) holds after every step, through the
abort of one choice and retracts under memory pressure."""

from __future__ import annotations

import pytest

from tests.engine.test_scheduler import EOS, assert_clean, make_sched, prompts, submit
from tests.support.models import hf_greedy
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def seeded(seed: int, n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, ignore_eos=True)


def run_choices(sched, prompt: list[int], params: list[SamplingParams], on_step=None) -> dict[str, list[int]]:
    """Choice 0 first; the others once it has its first token (as the router sends them). Steps
    until idle, checking the pool after every step; ``on_step(sched, step)`` runs after each (the
    deltas of an outbox it returns count as the step's)."""
    out: dict[str, list[int]] = {f"c{i}": [] for i in range(len(params))}
    ends: dict[str, str] = {}
    submit(sched, "c0", prompt, params[0])
    step, sent = 0, False
    extra = []
    while sched.has_work or not sent:
        for d in sched.step().outbox.deltas + extra:
            out[d.rid] += d.token_ids
            if d.finish_reason:
                ends[d.rid] = d.finish_reason
        if not sent and (out["c0"] or "c0" in ends):
            for i, p in enumerate(params[1:], 1):
                submit(sched, f"c{i}", prompt, p)
            sent = True
        sched.check_integrity()
        step += 1
        got = on_step(sched, step) if on_step is not None else None
        extra = got.deltas if got is not None else []
    assert set(ends) == set(out), ends
    return out


def alone(tiny, prompt: list[int], params: list[SamplingParams], **kw) -> list[list[int]]:
    """Each choice as a separate request on a scheduler of its own."""
    got = []
    for p in params:
        sched = make_sched(tiny, **kw)
        submit(sched, "r", prompt, p)
        toks = []
        while sched.has_work:
            toks += [t for d in sched.step().outbox.deltas for t in d.token_ids]
        got.append(toks)
    return got


def test_four_seeded_choices_prefill_the_prompt_once(tiny):
    """n=4 on a 256-token prompt, page size 4: the first choice computes 256 tokens, the others the
    last page only (matched 252 = the full pages of prompt[:255]), 268 in all instead of 1024. The
    recomputed last page is a duplicate of the tree's: each choice switches to the tree's page, so
    all 64 prompt pages are read by all four and only the generated tokens' pages are their own."""
    prompt = prompts(1, 256, 256, seed=11)[0]
    params = [seeded(40 + i) for i in range(4)]
    sched = make_sched(tiny, page_size=4)
    seen = {}

    def shared_pages(s, step):
        if len(s.requests) == 4 and not seen and all(r.output_ids for r in s.requests.values()):
            pages = [s.requests[f"c{i}"].kv.pages for i in range(4)]
            seen["prefix"] = {tuple(p[:64]) for p in pages}
            seen["own"] = [p[64:] for p in pages]

    out = run_choices(sched, prompt, params, shared_pages)
    assert [out[f"c{i}"] for i in range(4)] == alone(tiny, prompt, params, page_size=4)
    assert len({tuple(t) for t in out.values()}) == 4  # the seeds differ, so do the choices
    assert sched.stats.prefill_computed_tokens == 256 + 3 * 4
    assert sched.stats.cached_prompt_tokens == 3 * 252
    assert len(seen["prefix"]) == 1, "the choices do not read the same prompt pages"
    own = [p for pages in seen["own"] for p in pages]
    assert len(own) == len(set(own)), "a choice writes into another's page"
    assert_clean(sched)
    assert sched.kv.usage([]).cached >= 64  # the prompt stays cached after the request


def test_greedy_choices_equal_hf(tiny):
    prompt = prompts(1, 37, 37, seed=12)[0]
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    sched = make_sched(tiny, page_size=4)
    out = run_choices(sched, prompt, [greedy] * 3)
    want = hf_greedy(tiny[2], prompt, 10)
    assert [out[f"c{i}"] for i in range(3)] == [want] * 3
    assert sched.stats.prefill_computed_tokens == 37 + 2 * 1  # 36 tokens matched, the last computed
    assert_clean(sched)


def test_abort_of_one_choice_leaves_the_others_and_the_pool_whole(tiny):
    prompt = prompts(1, 50, 50, seed=13)[0]
    params = [seeded(70 + i, 12) for i in range(4)]
    sched = make_sched(tiny, page_size=4)
    state = {}

    def abort_c2(s, step):
        if "c2" in s.requests and s.requests["c2"].output_ids and not state:
            locks = s.kv.tree.protected_size()
            box = s.abort("c2")
            state["delta"] = box.deltas[0]
            s.check_integrity()
            assert s.kv.tree.protected_size() == locks  # the others still hold the shared prompt
            assert s.kv.usage(s.live_handles()).used > 0
            return box
        return None

    out = run_choices(sched, prompt, params, abort_c2)
    assert state["delta"].finish_reason == "abort"
    ref = alone(tiny, prompt, params, page_size=4)
    assert [out[f"c{i}"] for i in (0, 1, 3)] == [ref[i] for i in (0, 1, 3)]
    assert out["c2"] == ref[2][: len(out["c2"])] and len(out["c2"]) < 12
    assert_clean(sched)


@pytest.mark.slow
def test_retract_under_pressure_with_shared_prompt(tiny):
    """A 28-page pool, a 40-token prompt (10 pages, shared) and 4 choices of 24 tokens (16 pages
    each alone, 37 with sharing): decode must retract; outputs stay those of separate requests."""
    prompt = prompts(1, 40, 40, seed=14)[0]
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=90 + i) for i in range(4)]
    kw = dict(kv_pool_tokens=112, page_size=4, eos=(), init_new_token_ratio=0.1)
    sched = make_sched(tiny, **kw)
    out = run_choices(sched, prompt, params)
    assert sched.stats.retractions > 0 and sched.stats.oom_aborts == 0
    assert [out[f"c{i}"] for i in range(4)] == alone(tiny, prompt, params, **kw)
    assert_clean(sched)


def test_share_prefix_switches_to_the_tree_page_of_a_duplicate(tiny):
    """Two requests with one prompt admitted together both compute it; the second to insert gets
    the first one's pages and frees its own copies (no page leaked or owned twice)."""
    prompt = [t % EOS for t in range(3, 23)]
    sched = make_sched(tiny, page_size=4)
    greedy = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    submit(sched, "a", prompt, greedy)
    submit(sched, "b", prompt, greedy)
    out = {"a": [], "b": []}
    while sched.has_work:
        for d in sched.step().outbox.deltas:
            out[d.rid] += d.token_ids
        if len(sched.requests) == 2:
            a, b = (sched.requests[r].kv for r in ("a", "b"))
            assert a.pages[:5] == b.pages[:5] and a.full.num_shared == b.full.num_shared == 5
        sched.check_integrity()
    assert out["a"] == out["b"] == hf_greedy(tiny[2], prompt, 6)
    assert sched.stats.prefill_computed_tokens == 40
    assert_clean(sched)
