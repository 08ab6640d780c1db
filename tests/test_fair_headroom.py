"""Headroom for keys under their share (server/router/fair_headroom.py) through the admission
stage: a key at its share stops short of the headroom while another key is active, never blocks an
idle router, and takes every slot again once the other key has gone quiet."""
from __future__ import annotations

import asyncio

import pytest

from test_admission import Clock, demand, make, queue, settle, sync

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
