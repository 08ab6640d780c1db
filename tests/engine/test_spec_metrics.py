"""The speculative decoding series: pdserve_spec_draft_tokens_total moves by the draft tokens the
scheduler verified, pdserve_spec_accepted_tokens_total by the tokens its decode rows emitted
beyond one per row and step; both stay at zero on a worker without speculation."""

from __future__ import annotations

from tests.engine.test_spec_identity import greedy, make, run
from tests.support.metrics_scrape import scrape, val


def test_spec_series_move_by_the_drafted_and_accepted_tokens(tiny):
    sched = make(tiny, True)
    drafted, extra = [], []
    drafts, mixed = sched.spec.drafts, sched.executor.mixed

    def counting_drafts(reqs, other_tokens):
        ds = drafts(reqs, other_tokens)
        drafted.extend(map(len, ds))
        return ds

    def counting_mixed(reqs, items):
        decoded, extended = mixed(reqs, items)
        extra.append(len(decoded) - len(reqs))  # one delta per emitted token
        return decoded, extended

    sched.spec.drafts, sched.executor.mixed = counting_drafts, counting_mixed
    m = scrape(sched)
    assert val(m, "pdserve_spec_draft_tokens_total") == val(m, "pdserve_spec_accepted_tokens_total") == 0
    run(sched, [([55] * 12, greedy(32)), ([30] * 9, greedy(20))])
    m = scrape(sched)
    assert val(m, "pdserve_spec_draft_tokens_total") == sum(drafted) > 0
    assert val(m, "pdserve_spec_accepted_tokens_total") == sum(extra) > 0


def test_spec_series_stay_zero_without_speculation(tiny):
    sched = make(tiny, False)
    run(sched, [([55] * 12, greedy(8))])
    m = scrape(sched)
    assert val(m, "pdserve_spec_draft_tokens_total") == val(m, "pdserve_spec_accepted_tokens_total") == 0


def test_acceptance_length_histogram_counts_each_verified_row(tiny):
    sched = make(tiny, True)
    per_row = []  # accepted tokens of each verified row: its deltas in the step beyond the first
    drafts, mixed = sched.spec.drafts, sched.executor.mixed
    drafting = {}

    def recording_drafts(reqs, other_tokens):
        ds = drafts(reqs, other_tokens)
        drafting.clear()
        drafting.update({r.rid: len(d) for r, d in zip(reqs, ds) if d})
        return ds

    def counting_mixed(reqs, items):
        decoded, extended = mixed(reqs, items)
        for rid in drafting:
            per_row.append(sum(r.rid == rid for r, _ in decoded) - 1)
        return decoded, extended

    sched.spec.drafts, sched.executor.mixed = recording_drafts, counting_mixed
    m = scrape(sched)
    assert val(m, "pdserve_spec_acceptance_length_count") == 0
    run(sched, [([55] * 12, greedy(32)), ([30] * 9, greedy(20))])
    m = scrape(sched)
    assert val(m, "pdserve_spec_acceptance_length_count") == len(per_row) > 0
    assert val(m, "pdserve_spec_acceptance_length_sum") == sum(per_row) == sched.spec.accepted_tokens > 0
    for le in (0, 1, 2, 4):
        assert val(m, "pdserve_spec_acceptance_length_bucket", le=f"{le:.1f}") == sum(n <= le for n in per_row)
