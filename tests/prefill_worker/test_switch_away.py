"""A prefill worker changing role gives back the prompts whose KV it has not written
(``prefill_worker.switch_away``), with the real schedulers in one process (``PDHarness``: 1 prefill +
1 decode worker, loopback transport, the tiny model): a queued prompt and the one being computed end
with a 503 marked ``handed_back`` to the router and ``PrefillFailed`` (``handed_back``) to their
decode worker, which frees their reserved pages at once and ends them as handed back too; a write
under way and a recompute (generation > 0) stay and finish. Sent again, every output equals
transformers, and both pools end clean (free + used + cached == total, ``checked_harnesses``).
(The worker loop's part: tests/worker/test_role_switch_unit.py; with real processes:
tests/e2e/test_role_switch_e2e.py.)"""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import PDHarness, checked_harnesses
from prefill_worker.switch_away import SWITCHING_AWAY, hand_back_unwritten
from tests.support.models import hf_greedy
from tests.support.pd import GREEDY, pd_cfg, pd_prompts
from tests.support.withdraw import reserve
from transfer.wire.protocol import PrefillFailed

pytestmark = pytest.mark.unit

FIRST, QUEUED = pd_prompts(2, lo=40, hi=40, seed=11)  # 3 chunks of 16 each; no EOS in 16 tokens


def _decode_cfg():
    """A decode worker that prefills nothing itself: every prompt queues on the prefill worker."""
    c = pd_cfg()
    c.cluster.local_prefill_max_tokens, c.cluster.local_prefill_backlog_ratio = 0, 0.0
    return c


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(
        lambda: PDHarness(pd_cfg(chunked_prefill_size=16), _decode_cfg(), tiny[0], tiny[1], eos=(96,))
    )


def _computing(h: PDHarness, rid: str) -> None:
    """Turns until ``rid``'s prompt is the one being computed (part-way through its chunks)."""
    for _ in range(10):
        h.step()
        chunked = h.prefill.admission.chunked
        if chunked is not None and chunked.rid == rid:
            return
    raise AssertionError(f"{rid} never became the chunked prompt")


def test_the_prompt_under_way_and_the_queued_one_are_handed_back(harness, tiny):
    h = harness()
    reserve(h, "a", FIRST, GREEDY)
    _computing(h, "a")
    reserve(h, "b", QUEUED, GREEDY)
    assert h.prefill.waiting and all(len(h.decode.jobs[r].req.kv.pages) > 0 for r in "ab")

    out = hand_back_unwritten(h.prefill)
    assert sorted((d.rid, d.error_status, d.handed_back) for d in out.deltas) == [("a", 503, True), ("b", 503, True)]
    assert all(SWITCHING_AWAY in d.error and not d.token_ids for d in out.deltas)
    failed = [m.msg for m in out.messages if isinstance(m.msg, PrefillFailed)]
    assert sorted(f.rid for f in failed) == ["a", "b"] and all(f.handed_back and f.error_status == 503 for f in failed)
    assert not h.prefill.jobs and h.prefill.admission.chunked is None  # the chunks computed so far dropped
    assert hand_back_unwritten(h.prefill).messages == []  # once

    h.deliver(out, False)
    ended = h._exchange()  # the decode worker: handed back too, its reserved pages free at once
    assert sorted((d.rid, d.error_status, d.handed_back) for d in ended) == [("a", 503, True), ("b", 503, True)]
    assert not h.decode.jobs and h.decode.kv.usage([]).used == 0

    for rid, prompt in (("a~1", FIRST), ("b~1", QUEUED)):  # the router's re-sends (to this pair in the harness)
        h.submit(rid, prompt, GREEDY)
    out = h.run()
    assert out["a~1"]["tokens"] == hf_greedy(tiny[2], FIRST, 16) and out["a~1"]["error"] is None
    assert out["b~1"]["tokens"] == hf_greedy(tiny[2], QUEUED, 16) and out["b~1"]["error"] is None
    assert h.prefill.stats.finished_requests == 2  # the re-sends; the hand-backs are not counted


def test_a_write_under_way_and_a_recompute_stay(harness, tiny):
    h = harness()
    reserve(h, "w", QUEUED, GREEDY)
    job = None
    for _ in range(10):  # prefill turns alone, until the write is posted
        h.deliver(h.prefill_turns.run().outbox, False)
        job = h.prefill.jobs.get((1, 0))
        if job is not None and job.writing:
            break
    assert job is not None and job.writing
    assert hand_back_unwritten(h.prefill).messages == []
    job.generation = 1  # as a recompute (no write yet): its decode worker owns it, so it stays too
    job.writing = False
    assert hand_back_unwritten(h.prefill).messages == []
    job.generation, job.writing = 0, True
    assert h.run()["w"]["tokens"] == hf_greedy(tiny[2], QUEUED, 16)


def test_a_destination_that_comes_after_the_hand_back_is_refused_as_handed_back(harness, tiny):
    h = harness()
    h.submit("c", QUEUED, GREEDY)  # the decode side's destination is still on its way
    assert h.prefill.bootstrapping and h.to_prefill
    out = hand_back_unwritten(h.prefill)
    assert [d.rid for d in out.deltas] == ["c"] and out.deltas[0].handed_back
    assert not h.prefill.jobs and not h.prefill.bootstrapping
    h.deliver(out, False)
    # the destination the decode worker sends now is refused, marked handed back: it ends so too
    [ended] = [d for _ in range(3) for d in h.step() if d.rid == "c"]
    assert ended.handed_back and ended.error_status == 503 and "c" not in h.decode.jobs
    h.submit("c~1", QUEUED, GREEDY)
    assert h.run()["c~1"]["tokens"] == hf_greedy(tiny[2], QUEUED, 16)
