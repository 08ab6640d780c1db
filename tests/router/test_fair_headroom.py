"""Headroom for keys under their share (server/router/fair_headroom.py) through the admission
stage: a key at its share stops short of the headroom while another key is active, never blocks an
idle router, and takes every slot again once the other key has gone quiet."""

from __future__ import annotations

import asyncio

import pytest

from tests.router.test_admission import Clock, demand, make, queue, settle, sync

pytestmark = pytest.mark.unit


@sync
async def test_headroom_keeps_slots_free_for_a_key_under_its_share():
    """A heavy key alone uses every slot; once a light key has been seen, the heavy key (over its
    share) stops short of the headroom, so the light key's next request is granted at once
    instead of waiting for a heavy release; the reservation lapses active_window_s after the light
    key's last arrival."""
    clock = Clock()
    adm, _, _ = make(capacity=10, headroom=3, clock=clock)
    heavy = [adm.try_grant(demand("heavy")) for _ in range(10)]
    assert all(heavy), "one active key: work-conserving, every slot is used"
    light = adm.try_grant(demand("light"))
    assert light is None  # all 10 held; the light key is now active
    tasks = await queue(adm, demand("light"), *[demand("heavy") for _ in range(10)])
    for g in heavy[:4]:  # four heavy requests end: light goes, heavy refills only up to 10 - 3
        adm.release(g)
    await settle()
    went = [t.result().demand.key for t in tasks if t.done()]
    assert went == ["light"], went  # the first release: light goes (under its share of 5)
    assert adm.inflight_slots == 7  # 6 heavy + 1 light: heavy, over its share, stops at 10 - 3
    adm.release(heavy[4])
    await settle()
    assert [t.result().demand.key for t in tasks if t.done()] == ["light", "heavy"]  # back up to 7, not beyond
    assert adm.inflight_slots == 7
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@sync
async def test_headroom_lapses_when_the_other_key_goes_quiet():
    clock = Clock()
    adm, _, _ = make(capacity=4, headroom=2, clock=clock)
    light = adm.try_grant(demand("light"))
    held = [adm.try_grant(demand("heavy")) for _ in range(3)]
    assert held[0] and held[1] and held[2] is None  # light + 2 heavy: heavy over its share of 2 stops at 4 - 2 + ...
    adm.release(light)
    clock.t += 4.0
    assert adm.try_grant(demand("heavy")) is None  # light arrived 4 s ago: still active (window 5 s)
    clock.t += 1.5
    assert adm.try_grant(demand("heavy")) is not None  # light gone quiet: every slot is heavy's again
    assert adm.try_grant(demand("heavy")) is not None and adm.inflight_slots == 4


@sync
async def test_headroom_never_blocks_an_idle_router_or_a_key_under_its_share():
    adm, _, _ = make(capacity=3, headroom=5)  # more headroom than slots: capped at capacity - 1
    adm.release(adm.try_grant(demand("b")))  # b has been seen: two keys are active
    assert adm.try_grant(demand("a")) is not None  # nothing in flight: always granted
    assert adm.try_grant(demand("a")) is None  # a past its share (1.5 of 3): 1 + 1 > 3 - 2
    assert adm.try_grant(demand("b")) is not None  # b under its share: only the capacity bounds it


@sync
async def test_grants_that_leave_a_key_below_another_are_marked_preempt():
    """``Grant.preempt`` (with ``FairHeadroom.preempt``): set while another key is active and the
    grant leaves its key below it per unit of share, never with one key alone, never without
    ``preempt``; within its own share is not enough."""
    off, _, _ = make(capacity=4)
    off.try_grant(demand("a"))
    assert not off.try_grant(demand("b")).preempt
    adm, _, _ = make(capacity=4, shares={"a": 1, "b": 3}, preempt=True)
    alone = [adm.try_grant(demand("a")) for _ in range(2)]
    assert [g.preempt for g in alone] == [False, False]  # one active key: nothing to protect
    b = adm.try_grant(demand("b"))
    assert b.preempt  # 1 slot per 3 of share against a's 2 per 1
    for g in alone:
        adm.release(g)
    a = adm.try_grant(demand("a"))
    assert not a.preempt  # within a's share of 1, but 1 per 1 is not below b's 1 per 3
    b2 = adm.try_grant(demand("b"))
    assert b2.preempt  # 2 per 3 < a's 1 per 1


@sync
async def test_with_preempt_a_key_under_its_share_is_granted_past_a_full_router():
    """With ``FairHeadroom.preempt`` (PD: the decode worker retracts for it) a key is granted even
    when every slot is taken while it stays within its share of the slots, or below the other key in
    slots held or in service lately (work granted per second, per share); past that it waits like
    anyone; an over-share key never goes past the slots."""
    for light_tokens, granted in ((100, 5), (10, 6)):
        adm, _, _ = make(capacity=6, preempt=True)
        heavy = [adm.try_grant(demand("heavy", tokens=100)) for _ in range(6)]
        assert all(heavy) and adm.try_grant(demand("heavy")) is None
        light = [adm.try_grant(demand("light", tokens=light_tokens)) for _ in range(7)]
        # 3 within its share of 3, then 4 and 5 held < heavy's 6; a 6th only while served < 0.8 x heavy's
        # 600 tokens/s (500 is not; 50 is); never past twice the slots (12)
        assert [g is not None for g in light] == [True] * granted + [False] * (7 - granted), light_tokens
        assert all(g.preempt for g in light[:granted])
        tasks = await queue(adm, demand("heavy"))
        adm.release(heavy[0])
        await settle()
        assert not tasks[0].done()  # still past capacity: heavy (past its share, served more) waits
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_past_the_slots_stays_within_twice_them():
    adm, _, _ = make(capacity=2, preempt=True)
    heavy = [adm.try_grant(demand("heavy", tokens=1000)) for _ in range(2)]
    light = [adm.try_grant(demand("light", tokens=1)) for _ in range(4)]
    assert all(heavy) and all(light[:2]) and light[2] is None  # 4 in flight = twice the 2 slots
    assert adm.inflight_slots == 4


@sync
async def test_without_preempt_a_full_router_grants_nobody():
    adm, _, _ = make(capacity=2)
    held = [adm.try_grant(demand("heavy")) for _ in range(2)]
    assert all(held)
    assert adm.try_grant(demand("light")) is None
