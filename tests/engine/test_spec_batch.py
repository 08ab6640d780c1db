"""The batch rule of speculative decoding: a step drafts only while its decode rows, prefill tokens
and drafted tokens stay within ``spec_max_batch_tokens`` and ``max_num_batched_tokens`` (a drafting
row counts K + 1 tokens), drafts trimmed to fit; so a large batch does not draft and a small one
does, and the outputs stay those of decoding without speculation."""

from __future__ import annotations

from tests.engine.test_spec_identity import greedy, make, repeating_prompts, run, same_with_and_without


def record_steps(sched) -> list[tuple[int, int, list[int]]]:
    """Each forward's (decode rows, prefill tokens, draft lengths), as the executor runs it."""
    steps = []
    drafts = sched.spec.drafts

    def recording(reqs, other_tokens):
        ds = drafts(reqs, other_tokens)
        steps.append((len(reqs), other_tokens, [len(d) for d in ds]))
        return ds

    sched.spec.drafts = recording
    return steps


def test_large_batch_does_not_draft_small_one_does(tiny):
    jobs = [(p, greedy(24)) for p in repeating_prompts(8)]
    sched = make(tiny, True, spec_max_batch_tokens=8)
    steps = record_steps(sched)
    run(sched, jobs)
    full = [s for s in steps if s[0] >= 8]
    assert full and all(sum(d) == 0 for _, _, d in full), full
    small = make(tiny, True, spec_max_batch_tokens=8)
    small_steps = record_steps(small)
    run(small, jobs[:2])
    assert sum(sum(d) for _, _, d in small_steps) > 0 and small.spec.accepted_tokens > 0


def test_step_tokens_count_every_drafted_position(tiny):
    # K = 4 and three repeating requests: untrimmed drafts would put 3 + 12 tokens in a step of 8
    jobs = [(p, greedy(32)) for p in repeating_prompts(3)]
    sched = same_with_and_without(
        tiny, jobs, min_accepted=5, max_num_batched_tokens=8, spec_max_batch_tokens=64, chunked_prefill_size=8
    )
    steps = record_steps(sched)
    run(sched, jobs)
    drafting = [s for s in steps if sum(s[2])]
    assert drafting and all(rows + prefill + sum(d) <= 8 for rows, prefill, d in drafting), drafting
    assert any(0 < n < 4 for _, _, d in drafting for n in d), "no draft was trimmed to the budget"
    assert sched.spec.step_tokens == 8


def test_rule_is_the_smaller_of_both_budgets(tiny):
    sched = make(tiny, True, max_num_batched_tokens=64, spec_max_batch_tokens=5)
    assert sched.spec.step_tokens == 5
    steps = record_steps(sched)
    run(sched, [(p, greedy(24)) for p in repeating_prompts(2)])
    drafting = [s for s in steps if sum(s[2])]
    assert drafting and all(rows + prefill + sum(d) <= 5 for rows, prefill, d in drafting), drafting
