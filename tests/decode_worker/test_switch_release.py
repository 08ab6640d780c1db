"""A decode worker switching role does not wait for requests whose prefill has not started
(``decode_worker.evacuate.release_unprefilled``, ``prefill_worker.withdraw``), in one process
(1 prefill + 2 decode workers, loopback transports, the tiny model): they end on it with a 503 and
no token (the router's cue to send them again to another pair), the prefill worker drops their
prompts and frees nothing it had not, their reserved pages come back only after the prefill
worker's answer, a prompt already being prefilled lands and migrates as before, and every output,
moved or sent again, equals transformers. (The router's re-send itself: tests/router/test_router_retry.py;
with real processes: tests/e2e/test_role_switch_e2e.py.)"""

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

    def __init__(self, prealloc=(), inflight=(), offered=None) -> None:
        self.transfers, self.ended = _Tracker(prealloc, inflight), []
        self.queued = None if offered is None else type("Q", (), {"offered": offered})()

    def finish(self, job, outcome):
        self.ended.append((job, outcome))
        from transfer.wire.outbox import Outbox

        return Outbox()


def test_only_unprefilled_first_prefills_are_asked_back_once():
    fresh, posted, recompute, migrated = _job(), _job(write_posted=True), _job(generation=1), _job(migrated=True)
    streamed = _job()
    streamed.req.output_ids.append(5)
    s = _Decode(inflight=[fresh], prealloc=[])
    for other in (posted, recompute, migrated, streamed):
        s.transfers.inflight[id(other)] = other
    out = release_unprefilled(s)
    assert [(m.to, m.msg) for m in out.messages] == [(Peer("tcp://p0"), PrefillWithdrawn(rid="r", room=7))]
    assert s.ended == [] and fresh.withdrawn  # its pages stay reserved until the prefill worker answers
    assert release_unprefilled(s).messages == []  # asked once


def test_a_queued_one_ends_at_once_with_a_retryable_error_unless_offered():
    queued, offered = _job(DecodeState.QUEUED), _job(DecodeState.QUEUED)
    offered.req.rid = "o"
    s = _Decode(prealloc=[queued, offered], offered={"o": 0.0})
    out = release_unprefilled(s)
    assert [m.msg for m in out.messages] == [PrefillWithdrawn(rid="r", room=7)]
    [(job, outcome)] = s.ended
    assert job is queued and outcome.status == 503 and outcome.error == SWITCHING_AWAY


def _migrating():
    """d1's configuration: a migration path that moves nothing on its own (as a switch needs)."""
    c = pd_cfg()
    return c.model_copy(update={"cluster": c.cluster.model_copy(update={"migrate_after": "100000"})})


@pytest.fixture
def harness(tiny):
    # p0 prefills one 20-token prompt per step at most (chunks of 16): a backlog builds behind it
    yield from checked_harnesses(
        lambda: MigrationHarness(pd_cfg(chunked_prefill_size=16), _migrating(), pd_cfg(), tiny[0], tiny[1])
    )


@pytest.mark.slow
def test_switching_away_releases_the_backlog_and_nothing_is_lost(harness, tiny):
    h = harness()
    ps = pd_prompts(6, lo=20, hi=20, seed=3)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, GREEDY, decode="d1")
    for _ in range(20):  # until d1 reserved every request's pages (its destinations went out)
        h.step()
        if len(h.d1.transfers.inflight) == len(ps):
            break
    assert len(h.d1.transfers.inflight) == len(ps) and h.workers["p0"].waiting
    assert start(h.d1) is None
    steps = 0
    while h.d1.jobs and steps < 200:
        evacuate(h.d1)  # what the role switcher does before each turn
        h.step()
        steps += 1
    # emptied within a few turns (the withdrawals' round trip, the one prompt under way landing and
    # moving), not after p0's whole backlog (15 turns when it waits for every prompt)
    assert not h.d1.jobs and steps < 8, (steps, sorted(h.d1.jobs))
    assert h.d1.kv.usage([]).used == 0
    h.run()
    released = sorted(r for r, o in h.out.items() if o["error"] is not None)
    # every released request streamed nothing and names why (a 503 from its decode worker)
    assert released and all(h.out[r]["tokens"] == [] and RELEASED in h.out[r]["error"] for r in released)
    assert h.workers["p0"].withdrawn == len(released)
    kept = [r for r in h.out if r not in released]  # prefilled before the switch reached them: moved
    assert kept and all(h.out[r]["finish"] == "length" for r in kept)
    assert all("d2" in h.out[r]["from"] for r in kept if h.out[r]["from"][-1] != "d1")
    for r in released:  # the router's re-send, to the peer
        h.submit(f"{r}~1", ps[int(r[1:])], GREEDY, decode="d2")
    h.run()
    for i, p in enumerate(ps):
        rid = f"r{i}" if f"r{i}" in kept else f"r{i}~1"
        assert h.out[rid]["tokens"] == hf_greedy(tiny[2], p, 16), rid
    h.check_clean()
