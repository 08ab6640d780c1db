"""Unit tests of retract victim selection, the last-request abort and the new_token_ratio tracker."""

from __future__ import annotations

import pytest

from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from configs.scheduler import SchedulerConfig
from engine.request import Request
from engine.sampling import SamplerState
from engine.scheduler.decode_memory import check_decode_mem, retract_decode, victim_order
from engine.scheduler.ratio import NewTokenRatioTracker
from transfer.wire.sampling_params import SamplingParams


def req(rid, prompt_len, out_len, kv: KVManager, max_new=64) -> Request:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0)
    r = Request(rid, [1] * prompt_len, sp, SamplerState.new(sp, 10), output_ids=[2] * out_len)
    r.kv_len = r.seq_len - 1
    assert kv.ensure_pages(r.kv, r.kv_len)
    return r


def test_victim_order_most_output_then_shortest_input():
    kv = KVManager(PageAllocator(100), 4, False)
    a, b, c = req("a", 10, 5, kv), req("b", 4, 9, kv), req("c", 3, 5, kv)
    assert [r.rid for r in victim_order([a, b, c])] == ["b", "c", "a"]


def test_victim_order_least_output_then_longest_input():
    kv = KVManager(PageAllocator(100), 4, False)
    a, b, c, d = req("a", 10, 5, kv), req("b", 4, 9, kv), req("c", 3, 5, kv), req("d", 2, 1, kv)
    assert [r.rid for r in victim_order([a, b, c, d], "least-output")] == ["d", "a", "c", "b"]
    with pytest.raises(ValueError, match="most-output or least-output"):
        victim_order([a], "oldest")


@pytest.mark.parametrize("order, first", [("most-output", "old"), ("least-output", "new")])
def test_retract_takes_victims_in_the_configured_order(order, first):
    kv = KVManager(PageAllocator(8), 4, False)
    old, new = req("old", 7, 5, kv), req("new", 7, 1, kv)  # 3 + 2 pages used, 3 free
    res = retract_decode(kv, [old, new], retract_steps=8, release_victim=lambda r: kv.free(r.kv), retract_order=order)
    assert [r.rid for r in res.retracted] == [first]
    assert check_decode_mem(kv, res.kept, 8)


def test_retract_until_room_for_steps():
    kv = KVManager(PageAllocator(12), 4, False)
    reqs = [req(f"r{i}", 7, 1, kv) for i in range(4)]  # kv_len 7 -> 2 pages each, 8 used, 4 free
    released = []

    def release(r):
        released.append(r.rid)
        kv.free(r.kv)

    res = retract_decode(kv, reqs, retract_steps=8, release_victim=release)
    # each request needs 2 more pages for 8 more steps: 4 free < 4*2; one retracted -> 6 free == 3*2
    assert len(res.retracted) == 1 and res.aborted is None
    assert check_decode_mem(kv, res.kept, 8)
    assert released == [r.rid for r in res.retracted]
    kv.check_integrity([r.kv for r in res.kept])


def test_last_request_that_cannot_fit_is_aborted():
    alloc = PageAllocator(4)
    kv = KVManager(alloc, 4, False)
    r = req("only", 16, 1, kv)  # kv_len 16 fills 4 pages; position 16 needs a 5th
    assert not check_decode_mem(kv, [r], 1)
    res = retract_decode(kv, [r], 20, lambda x: kv.free(x.kv))
    assert res.aborted is r and not res.kept and not res.retracted
    assert alloc.num_free() == 0  # the caller releases the aborted request
    kv.free(r.kv)
    assert alloc.num_free() == 4


def test_last_request_is_parked_when_others_hold_pages_and_it_fits_alone():
    alloc = PageAllocator(6)
    kv = KVManager(alloc, 4, False)
    held = kv.allocator.alloc(2)  # pages a transfer in flight holds
    r = req("only", 16, 1, kv)  # 4 pages; the 5th is not free now, but the pool has 6
    released = []
    res = retract_decode(kv, [r], 20, lambda x: released.append(x) or kv.free(x.kv), park_last=True)
    assert res.retracted == [r] == released and res.aborted is None and not res.kept
    assert alloc.num_free() == 4
    alloc.free(held)


def test_last_request_larger_than_the_pool_is_aborted_even_with_park_last():
    alloc = PageAllocator(4)
    kv = KVManager(alloc, 4, False)
    r = req("only", 16, 1, kv)  # needs 5 pages, the pool has 4: waiting can never help
    res = retract_decode(kv, [r], 20, lambda x: kv.free(x.kv), park_last=True)
    assert res.aborted is r and not res.retracted
    kv.free(r.kv)


def test_forced_retract_takes_one():
    kv = KVManager(PageAllocator(100), 4, False)
    reqs = [req("a", 5, 1, kv), req("b", 5, 3, kv)]
    res = retract_decode(kv, reqs, 20, lambda x: kv.free(x.kv), force_one=True)
    assert [r.rid for r in res.retracted] == ["b"] and [r.rid for r in res.kept] == ["a"]


def test_new_token_ratio_decay_floor_and_reset():
    cfg = SchedulerConfig(schedule_conservativeness=1.0, new_token_ratio_decay_steps=10)
    t = NewTokenRatioTracker(cfg)
    assert t.value == pytest.approx(0.7)
    t.step()
    assert t.value == pytest.approx(0.7 - (0.7 - 0.098) / 10)
    for _ in range(20):
        t.step()
    assert t.value == pytest.approx(0.7 * 0.14)
    assert t.reset_after_retract(decoded_tokens=100, num_reqs=5, max_new_total=399) == pytest.approx(0.5)
    assert t.reset_after_retract(0, 0, 1000) == pytest.approx(t.floor)
    assert t.reset_after_retract(5000, 10, 10) == 1.0
    assert NewTokenRatioTracker(SchedulerConfig(schedule_conservativeness=1.3)).value == pytest.approx(0.91)
