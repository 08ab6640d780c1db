"""A decode worker switching role does not wait for requests that streamed nothing, however far
their prefill got (``decode_worker.evacuate.release_unprefilled``, ``prefill_worker.withdraw``), in
one process (1 prefill + 2 decode workers, loopback transports, the tiny model): they end on it with
a 503 marked ``handed_back`` and no token (the router's cue to send them again to another pair
without using a retry), their reserved pages come back only after the prefill worker's answer (or
their KV's landing), the prompt being computed when the switch came goes to the prefill worker's
radix cache so that its re-send hits it, and every output, sent again, equals transformers. (The
router's re-send itself: tests/router/test_router_retry.py; the prefill side's cases one by one:
tests/prefill_worker/test_withdraw.py; with real processes: tests/e2e/test_role_switch_e2e.py.)"""

from __future__ import annotations

import pytest

from bench.harness.pd_harness import checked_harnesses
from decode_worker.evacuate import SWITCHING_AWAY, evacuate, release_unprefilled, start
from decode_worker.jobs import DecodeJob, DecodeState
from engine.request import Request
from engine.sampling import SamplerState
from prefill_worker.withdraw import RELEASED
from tests.support.migration_harness import MigrationHarness
from tests.support.models import hf_greedy
from tests.support.pd import GREEDY, pd_cfg, pd_prompts
from transfer.wire.outbox import Peer
from transfer.wire.protocol import PrefillWithdrawn

pytestmark = pytest.mark.unit


def _job(state=DecodeState.AWAITING_KV, **kw) -> DecodeJob:
    req = Request("r", [1, 2, 3], GREEDY, SamplerState.new(GREEDY, 8), owner=b"router")
    return DecodeJob(req, 7, "tcp://p0", state=state, **kw)


class _Tracker:
    def __init__(self, prealloc=(), inflight=()) -> None:
        self.prealloc = list(prealloc)
        self.inflight = {j.key: j for j in inflight}


class _Decode:
    """What ``release_unprefilled`` reads of a decode scheduler; ``finish`` records the endings."""

    def __init__(self, prealloc=(), inflight=(), offered=None, local=()) -> None:
        self.transfers, self.ended = _Tracker(prealloc, inflight), []
        self.jobs = {j.req.rid: j for j in (*prealloc, *inflight, *local)}
        self.queued = None if offered is None else type("Q", (), {"offered": offered})()

    def finish(self, job, outcome):
        self.ended.append((job, outcome))
        from transfer.wire.outbox import Outbox

        return Outbox()


def test_every_first_prefill_that_streamed_nothing_is_asked_back_once():
    fresh, posted, recompute, migrated = _job(), _job(write_posted=True), _job(generation=1), _job(migrated=True)
    streamed = _job()
    streamed.req.output_ids.append(5)
    s = _Decode(inflight=[fresh], prealloc=[])
    for other in (posted, recompute, migrated, streamed):
        s.transfers.inflight[id(other)] = other
    out = release_unprefilled(s)
    # a write under way does not hold it either: the prefill worker answers once the write ended
    assert [(m.to, m.msg) for m in out.messages] == [(Peer("tcp://p0"), PrefillWithdrawn(rid="r", room=7))] * 2
    assert s.ended == [] and fresh.withdrawn and posted.withdrawn  # pages kept until the answer
    assert not (recompute.withdrawn or migrated.withdrawn or streamed.withdrawn)
    assert release_unprefilled(s).messages == []  # asked once


def test_a_queued_one_ends_at_once_with_a_retryable_error_unless_offered():
    queued, offered = _job(DecodeState.QUEUED), _job(DecodeState.QUEUED)
    offered.req.rid = "o"
    s = _Decode(prealloc=[queued, offered], offered={"o": 0.0})
    out = release_unprefilled(s)
    assert [m.msg for m in out.messages] == [PrefillWithdrawn(rid="r", room=7)]
    [(job, outcome)] = s.ended
    assert job is queued and outcome.status == 503 and outcome.error == SWITCHING_AWAY and outcome.handed_back


def test_one_to_prefill_here_ends_at_once_unless_it_streamed():
    local, streamed = _job(DecodeState.LOCAL_PREFILL), _job(DecodeState.LOCAL_PREFILL)
    streamed.req.rid = "s"
    streamed.req.output_ids.append(5)
    s = _Decode(local=[local, streamed])
    assert release_unprefilled(s).messages == []  # its prefill worker was told when it was kept here
    [(job, outcome)] = s.ended
    assert job is local and outcome.status == 503 and outcome.error == SWITCHING_AWAY and outcome.handed_back


def _migrating():
    """d1's configuration: a migration path that moves nothing on its own (as a switch needs)."""
    c = pd_cfg()
    return c.model_copy(update={"cluster": c.cluster.model_copy(update={"migrate_after": "100000"})})


@pytest.fixture
def harness(tiny):
    # p0 prefills a 20-token prompt in 3 steps (chunks of 8): a backlog builds behind it
    yield from checked_harnesses(
        lambda: MigrationHarness(pd_cfg(chunked_prefill_size=8), _migrating(), pd_cfg(), tiny[0], tiny[1])
    )


@pytest.mark.slow
def test_switching_away_releases_the_backlog_and_nothing_is_lost(harness, tiny):
    h = harness()
    ps = pd_prompts(6, lo=20, hi=20, seed=3)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, GREEDY, decode="d1")
    p0 = h.workers["p0"]
    for _ in range(40):  # until d1 reserved every request's pages and p0 computed a first chunk of one
        h.step()
        chunked = p0.admission.chunked
        if len(h.d1.transfers.inflight) == len(ps) and chunked is not None and chunked.kv_len <= 8:
            break
    assert len(h.d1.transfers.inflight) == len(ps) and p0.waiting and p0.admission.chunked.kv_len <= 8
    computing = p0.admission.chunked
    assert start(h.d1) is None
    steps = 0
    while h.d1.jobs and steps < 200:
        evacuate(h.d1)  # what the role switcher does before each turn
        h.step()
        steps += 1
    # emptied by the withdrawals' round trip, the prompt under way included (not after p0's
    # backlog: 15 turns when it waits for every prompt)
    assert not h.d1.jobs and steps <= 3, (steps, sorted(h.d1.jobs))
    assert h.d1.kv.usage([]).used == 0
    h.run()
    assert sorted(h.out) == [f"r{i}" for i in range(len(ps))]
    # every request that had streamed nothing was handed back and names why (a 503 from its decode
    # worker); one whose KV had landed before d1 asked it back streamed on from d2 (a migration)
    released = sorted(r for r, o in h.out.items() if o["handed_back"])
    assert computing.rid in released and len(released) >= len(ps) - 1
    for r, o in h.out.items():
        ok = o["tokens"] == [] and RELEASED in o["error"] if r in released else o["from"][-1] == "d2"
        assert ok, (r, o)
    assert p0.withdrawn == len(released) and not p0.jobs
    page = p0.kv.page_size
    assert p0.kv.tree.match_prefix(computing.prompt_ids).num_tokens == len(computing.prompt_ids) // page * page
    cached = p0.stats.cached_prompt_tokens
    for r in released:  # the router's re-send, to the peer
        h.submit(f"{r}~1", ps[int(r[1:])], GREEDY, decode="d2")
    h.run()
    # the prompt under way when the switch came was computed into p0's cache: its re-send hit it
    assert p0.stats.cached_prompt_tokens - cached >= (len(computing.prompt_ids) - 1) // page * page
    for i, p in enumerate(ps):
        rid = f"r{i}~1" if f"r{i}" in released else f"r{i}"
        assert h.out[rid]["tokens"] == hf_greedy(tiny[2], p, 16), rid
    h.check_clean()
