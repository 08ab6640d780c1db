"""A decode worker's ``PrefillWithdrawn`` on the prefill side (``prefill_worker.withdraw``), with the
real schedulers in one process (``PDHarness``: 1 prefill + 1 decode worker, loopback transport,
the tiny model). The decode side asks back as a switching decode worker does
(``decode_worker.evacuate.release_unprefilled``).

- Not started: the job leaves and the decode worker is answered ``PrefillFailed`` (503) at once.
- Computing (the chunked prompt): answered at once; no write is ever posted for it, the prompt is
  computed to its end into the radix cache (a router abort does not stop it), and the request sent
  again hits that cache and equals transformers.
- Writing: no answer until the write ended, then one; the decode worker frees its pages on the
  answer or on the landing, whichever it sees first, never before, and ends the request once, with
  a 503 marked ``handed_back``.
- No destination: the job leaves silently and a late ``PrefillRequest`` is dropped; a destination
  parked before its prompt is answered at once.

Every run ends with both pools' invariant (free + used + cached == total) and nothing held.
"""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import DECODE_CONN, PDHarness, checked_harnesses
from prefill_worker.bootstrap import WITHDRAWN, EarlyDestination
from prefill_worker.withdraw import RELEASED, withdraw
from tests.support.models import hf_greedy
from tests.support.pd import GREEDY, pd_cfg, pd_prompts
from tests.support.withdraw import ask_back, reserve
from transfer.wire.outbox import Conn
from transfer.wire.protocol import KVDestination, PrefillFailed, PrefillWithdrawn

pytestmark = pytest.mark.unit

PROMPT = pd_prompts(1, lo=40, hi=40, seed=11)[0]  # 3 chunks of 16


@pytest.fixture
def harness(tiny):
    yield from checked_harnesses(
        lambda: PDHarness(pd_cfg(chunked_prefill_size=16), pd_cfg(), tiny[0], tiny[1], eos=(96,))
    )


def _started(h: PDHarness, rid: str = "r") -> None:
    """Submit ``rid`` and run prefill turns until its prompt is part computed (the chunked one)."""
    reserve(h, rid, PROMPT, GREEDY)
    for _ in range(10):
        h.step()
        chunked = h.prefill.admission.chunked
        if chunked is not None and chunked.rid == rid:
            return
    raise AssertionError("the prompt never became the chunked one")


def _pages(h: PDHarness, rid: str) -> int:
    job = h.decode.jobs.get(rid)
    return 0 if job is None else len(job.req.kv.pages)


def _released_answer(rid: str, room: int = 1) -> PrefillFailed:
    return PrefillFailed(rid=rid, room=room, generation=0, error=RELEASED, error_status=503)


def test_not_started_is_answered_at_once(harness):
    h = harness()
    reserve(h, "a", PROMPT, GREEDY)
    assert h.prefill.waiting
    assert ask_back(h) == [_released_answer("a")]
    assert not h.prefill.jobs and h.prefill.withdrawn == 1
    deltas = h._exchange()
    [d] = deltas
    assert d.error_status == 503 and d.handed_back and RELEASED in d.error and not d.token_ids
    assert not h.decode.jobs


def test_computing_is_answered_at_once_and_computed_into_the_cache(harness, tiny):
    h = harness()
    _started(h)
    job = h.prefill.jobs[(1, 0)]
    computed = job.req.kv_len
    assert 0 < computed < len(PROMPT) - 16 and not job.writing  # two chunks to go, the last one short
    written = []
    start = h.prefill.sender.start
    h.prefill.sender.start = lambda job, *a: (written.append(job.req.rid), start(job, *a))[1]
    held = _pages(h, "r")
    assert held > 0
    assert ask_back(h) == [_released_answer("r")]  # at once: nothing was or will be written
    assert _pages(h, "r") == held  # freed only on the answer, which is queued for the decode side
    [d] = h._exchange()
    assert d.handed_back and d.error_status == 503 and not h.decode.jobs
    assert h.decode.kv.usage([]).used == 0
    h.prefill.abort("r", "retried on another route")  # the router's abort of the old attempt: no effect
    assert job.released and (1, 0) in h.prefill.jobs
    # the router's re-send comes while the prompt is still computed: it waits for its KV in the cache
    cached = h.prefill.stats.cached_prompt_tokens
    h.submit("r~1", PROMPT, GREEDY)
    out = h.run()
    assert out["r~1"]["tokens"] == hf_greedy(tiny[2], PROMPT, 16) and out["r~1"]["error"] is None
    assert written == ["r~1"]  # never a write for the released prompt
    assert h.prefill.withdrawn == 1 and h.prefill.stats.finished_requests == 1
    page = h.prefill.kv.page_size
    assert h.prefill.stats.cached_prompt_tokens - cached == (len(PROMPT) - 1) // page * page


@pytest.mark.parametrize("seen_first", ["answer", "landing"])
def test_writing_is_answered_once_the_write_ended(harness, tiny, seen_first):
    h = harness()
    reserve(h, "w", PROMPT, GREEDY)
    job = None
    for _ in range(10):  # prefill turns alone, until the write is posted (it ends at the next settle)
        h.deliver(h.prefill_turns.run().outbox, False)
        job = h.prefill.jobs.get((1, 0))
        if job is not None and job.writing:
            break
    assert job is not None and job.writing
    h._exchange()  # KVWriteStarted: the decode side polls for the landing from now on
    held = _pages(h, "w")
    assert ask_back(h) == []  # no answer while the write is under way
    assert job.released and _pages(h, "w") == held
    if seen_first == "landing":
        deltas = h.deliver(h.decode_turns.run().outbox, True)  # the KV landed: nothing more is written
        assert not h.decode.jobs
    out = h.prefill_turns.run().outbox  # settle: the write ended, the answer goes out
    assert [m.msg for m in out.messages] == [_released_answer("w")]
    h.deliver(out, False)
    if seen_first == "answer":
        assert _pages(h, "w") == held
        deltas = h._exchange()
        assert not h.decode.jobs
    else:
        assert h._exchange() == []  # the answer finds the request gone: ignored
    [d] = deltas
    assert d.handed_back and d.error_status == 503 and not d.token_ids
    h.run()  # a landing seen after the answer is ignored too
    assert h.decode.kv.usage([]).used == 0 and not h.prefill.jobs and h.prefill.withdrawn == 1
    page = h.prefill.kv.page_size
    assert h.prefill.kv.tree.match_prefix(PROMPT).num_tokens == len(PROMPT) // page * page
    h.submit("w~1", PROMPT, GREEDY)
    assert h.run()["w~1"]["tokens"] == hf_greedy(tiny[2], PROMPT, 16)


def test_no_destination_leaves_silently_and_a_late_prompt_is_dropped(harness):
    h = harness()
    p = h.prefill
    msg = PrefillWithdrawn(rid="x", room=7)
    assert withdraw(p, msg).messages == [] and p.bootstrap.gone((7, 0)) == WITHDRAWN
    # a destination parked before its prompt came is released at once, not after its grace
    dest = KVDestination(rid="y", room=8, generation=0, decode_prefix_len=0, n_tokens=4)
    p.bootstrap.park((8, 0), EarlyDestination(Conn(DECODE_CONN), dest, (None, None)))
    [m] = withdraw(p, PrefillWithdrawn(rid="y", room=8)).messages
    assert m.to == Conn(DECODE_CONN) and m.msg == _released_answer("y", room=8)
    assert p.bootstrap.claim((8, 0)) is None
