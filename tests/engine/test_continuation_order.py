"""A burst of failover continuations under ``continuation_forward_tokens``: computed shortest first
(prompt + tokens sent), ahead of other waiting prompts, at most that many of their tokens per forward,
and each still the uninterrupted tail; off (0), they are admitted in arrival order as one batch."""

from __future__ import annotations

from engine.llm import run_batch
from engine.model_runner import ModelRunner
from engine.scheduler.colocated import ColocatedScheduler
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

PROMPT = [3, 17, 29, 41, 8, 55, 60, 12, 71, 5]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
SENT = {"c6": 6, "c2": 2, "c4": 4}  # arrival order: the longest first


def scheduler(tiny, cap: int) -> ColocatedScheduler:
    runner = ModelRunner(engine_cfg(kv_pool_tokens=1024, page_size=4), tiny[0], tiny[1])
    return ColocatedScheduler(runner, sched_cfg(continuation_forward_tokens=cap, enable_radix_cache=False), ())


def burst(tiny, cap: int) -> tuple[list[set[str]], list[int], dict[str, list[int]]]:
    """An ordinary prompt, then the three continuations; (the requests whose first token each step
    gave, the continuation tokens each step computed, every request's tokens)."""
    ref = run_batch(scheduler(tiny, 0), [PROMPT], [GREEDY])[0].token_ids
    sched = scheduler(tiny, cap)
    sched.add(b"", GenerateRequest(rid="n", params=GREEDY), PROMPT[::-1])
    for rid, k in SENT.items():
        sched.add(b"", GenerateRequest(rid=rid, params=GREEDY, resume_output_ids=ref[:k]), PROMPT)
    firsts, computed, got = [], [], {rid: [] for rid in ("n", *SENT)}
    while sched.has_work:
        before = sched.stats.continuation_prefill_tokens
        deltas = sched.step().outbox.deltas
        firsts.append({d.rid for d in deltas if d.token_ids and not got[d.rid]})
        computed.append(sched.stats.continuation_prefill_tokens - before)
        for d in deltas:
            got[d.rid] += d.token_ids
    for rid, k in SENT.items():
        assert got[rid] == ref[k:], rid
    return [f for f in firsts if f], computed, got


def test_continuations_are_computed_shortest_first_within_the_cap(tiny):
    firsts, computed, _ = burst(tiny, 16)
    assert firsts == [{"c2"}, {"c4"}, {"c6"}, {"n"}]
    assert max(computed) == 16 and sum(computed) == sum(len(PROMPT) + k for k in SENT.values())


def test_off_the_burst_is_one_batch_in_arrival_order(tiny):
    firsts, computed, _ = burst(tiny, 0)
    assert firsts == [{"n", "c6", "c2", "c4"}]
    assert computed[0] == sum(len(PROMPT) + k for k in SENT.values())
