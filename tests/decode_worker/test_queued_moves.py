"""Queued moves (``--migrate-queued``): a request waiting for pages on one decode worker,
not prefilled yet, is offered to the router and re-routed to a peer decode worker with room. In
one process: the decode side's offers, holds and answers (``decode_worker.queued_moves``), the
router's pick (``Migrations.on_queued_offer``) and the in-flight table's ``Moved`` marker. The real
path (processes, HTTP, the session's re-send) is ``tests/e2e/test_migration_e2e.py``."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from configs.schema import ClusterConfig
from decode_worker.jobs import DecodeJob, DecodeState
from decode_worker.migration import MigrationPolicy
from decode_worker.queued_moves import QueuedMoves, movable
from engine.request import Request
from engine.sampling import SamplerState
from server.router.inflight import InflightTable, Moved
from server.router.migration import Migrations
from server.router.workers import READY, WorkerHandle, WorkerSpec
from transfer.wire.enums import Role
from transfer.wire.outbox import Conn, Peer
from transfer.wire.protocol import PrefillWithdrawn, QueuedOffer, TokenDelta, WorkerStats
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def _job(rid="r", **kw) -> DecodeJob:
    req = Request(rid, [1, 2, 3], GREEDY, SamplerState.new(GREEDY, 8), owner=b"router")
    return DecodeJob(req, 7, "tcp://p0", **kw)


def _offers(out) -> list:
    return [(o.to, o.msg) for o in out.messages]


def test_the_flag_needs_migrate_after():
    assert ClusterConfig(migrate_after="0.5s", migrate_queued=True).migrate_queued
    with pytest.raises(ValidationError, match="migrate_queued needs migrate_after"):
        ClusterConfig(migrate_queued=True)


def test_a_queued_job_is_offered_once_after_the_bound_and_held_until_answered():
    moves = QueuedMoves(MigrationPolicy.from_flag("2"), timeout_s=10)
    a, b = _job("a"), _job("b")
    assert _offers(moves.offer([a, b], lambda j: 5)) == []  # step 1: their waits begin
    assert _offers(moves.offer([a, b], lambda j: 5)) == []  # step 2: one step waited
    sent = _offers(moves.offer([a, b], lambda j: 5))  # step 3: two steps: due
    assert [d for d, _ in sent] == [Conn(b"router")] * 2
    assert [(m.rid, m.pages) for _, m in sent] == [("a", 5), ("b", 5)] and all(
        isinstance(m, QueuedOffer) for _, m in sent
    )
    assert set(moves.offered) == {"a", "b"}  # held: admission skips them
    assert _offers(moves.offer([a, b], lambda j: 5)) == []  # no second offer while one is out
    moves.declined("a")  # no peer: it waits another bound here
    assert "a" not in moves.offered
    assert _offers(moves.offer([a, b], lambda j: 5)) == []
    assert [m.rid for _, m in _offers(moves.offer([a, b], lambda j: 5))] == ["a"]


def test_an_unanswered_offer_is_dropped_after_the_timeout():
    moves = QueuedMoves(MigrationPolicy.from_flag("0.0s"), timeout_s=0.05)
    a = _job("a")
    assert len(_offers(moves.offer([a], lambda j: 1))) == 1
    time.sleep(0.06)
    out = moves.offer([a], lambda j: 1)  # the old offer dropped first; its wait began again (0 s: offered anew)
    assert [m.rid for _, m in _offers(out)] == ["a"] and "a" in moves.offered


def test_only_queued_first_prefills_with_nothing_decoded_move():
    assert movable(_job())
    assert not movable(_job(generation=1))  # a recompute: its output was streamed already
    assert not movable(_job(migrated=True))  # came from a peer with its KV
    assert not movable(_job(state=DecodeState.AWAITING_KV))  # its KVDestination went out
    done = _job()
    done.req.output_ids.append(5)
    assert not movable(done)
    moves = QueuedMoves(MigrationPolicy.from_flag("0"), timeout_s=10)
    assert _offers(moves.offer([_job(generation=1), _job(migrated=True)], lambda j: 1)) == []


def test_a_move_withdraws_the_prefill_only_for_an_offered_job():
    moves = QueuedMoves(MigrationPolicy.from_flag("0"), timeout_s=10)
    a = _job("a")
    out, ok = moves.move(a, "a")
    assert not ok and _offers(out) == []  # never offered
    moves.offer([a], lambda j: 1)
    out, ok = moves.move(a, "a")
    assert ok and _offers(out) == [(Peer("tcp://p0"), PrefillWithdrawn(rid="a", room=7))]
    assert moves.offered == {}


# ---- the router's part ------------------------------------------------------------------------------
def _handle(wid, room):
    stats = WorkerStats(
        worker_id=wid,
        role=Role.DECODE,
        model="m",
        capacity_tokens=100,
        max_model_len=100,
        page_size=4,
        gauges={"migration_room_pages": room},
    )
    return WorkerHandle(WorkerSpec(wid, Role.DECODE, f"inproc://{wid}"), _Client(), state=READY, stats=stats)


class _Client:
    def __init__(self):
        self.sent = []

    def move_queued(self, rid, target):
        self.sent.append(("moved", rid, target))

    def decline_migration(self, rid, why):
        self.sent.append(("declined", rid))


def test_router_moves_a_queued_request_to_the_peer_with_room_or_declines():
    src, dst = _handle("d1", 0), _handle("d2", 10)
    table = InflightTable()
    moves = Migrations({"d1": src, "d2": dst}, table, iter(range(100)).__next__)
    a = table.open("a", ("p0", "d1"), "d1", 10)
    table.open("b", ("p0", "d1"), "d1", 10)
    c = table.open("c", ("p0", "d1"), "d1", 10)
    moves.on_message("d1", QueuedOffer(rid="a", pages=6, waited_s=1.0), [])
    assert src.client.sent == [("moved", "a", "d2")] and a.queue.get_nowait() == Moved("d2")
    moves.on_message("d1", QueuedOffer(rid="b", pages=6, waited_s=1.0), [])  # 10 - 6 left on d2's report
    assert src.client.sent[-1] == ("declined", "b")
    table.dispatch("d1", TokenDelta(rid="c", token_ids=[3]))  # c streamed meanwhile: it stays
    c.queue.get_nowait()
    dst.stats = dst.stats.model_copy()  # a fresh report: room again
    moves.on_message("d1", QueuedOffer(rid="c", pages=1, waited_s=1.0), [])
    assert src.client.sent[-1] == ("declined", "c") and c.queue.empty()
    moves.on_message("d2", QueuedOffer(rid="x", pages=1, waited_s=1.0), [])  # its session ended: no answer
    assert dst.client.sent == []  # (a decline would race the session's abort on the worker)
