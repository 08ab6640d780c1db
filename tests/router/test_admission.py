"""The router's admission stage (server/router/admission.py) without HTTP: ordering, per-key
fairness, shedding, Retry-After from the drain rate, deadlines and clients that go away; plus the
``api_key`` syntax (configs/api_keys.py)."""

from __future__ import annotations

import asyncio
import functools

import pytest

from configs.api_keys import parse_api_keys
from configs.schema import PdserveConfig
from server.router.admission import Admission, AdmissionLimits, Demand, Refused, retry_after_headers
from server.router.drain_rate import DrainRate
from server.router.fair_headroom import FairHeadroom

pytestmark = pytest.mark.unit

FAR = 1e12  # a deadline nobody reaches


def sync(test):
    """Run an ``async def`` test on a fresh event loop."""

    @functools.wraps(test)
    def run():
        asyncio.run(test())

    return run


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def demand(key="default", priority=0, slots=1, tokens=10, deadline=FAR) -> Demand:
    return Demand(key, priority, slots, tokens, deadline)


def make(
    capacity=1, max_queued=100, max_tokens=None, max_wait=None, shares=None, clock=None, headroom=0, preempt=False
):
    refused, granted, clock = [], [], clock or Clock()
    adm = Admission(
        AdmissionLimits(max_queued, max_tokens, max_wait),
        lambda: capacity,
        shares=shares,
        clock=clock,
        on_refused=refused.append,
        on_granted=granted.append,
        headroom=FairHeadroom(lambda: headroom, preempt=preempt),
    )
    return adm, refused, granted


async def settle() -> None:
    """Let every ready task run until it waits again (a grant wakes its waiter in a few loop turns)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def queue(adm: Admission, *demands: Demand) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(adm.admit(d)) for d in demands]
    await settle()  # every admit runs up to its wait
    return tasks


async def drain_in_order(adm: Admission, first, tasks: list[asyncio.Task]) -> list:
    """Release ``first`` then each grant as it comes; the demands in the order they were granted."""
    order, pending, current = [], set(tasks), first
    while pending:
        adm.release(current)
        await settle()
        done = [t for t in pending if t.done()]
        assert len(done) == 1, "capacity 1: exactly one request goes per release"
        pending -= set(done)
        current = done[0].result()
        order.append(current.demand)
    adm.release(current)
    return order


@sync
async def test_priority_then_arrival_within_a_key():
    adm, _, _ = make(capacity=1)
    first = adm.try_grant(demand())
    tasks = await queue(
        adm,
        demand(priority=5, tokens=1),
        demand(priority=-1, tokens=2),
        demand(priority=0, tokens=3),
        demand(priority=-1, tokens=4),
    )
    assert adm.queued_requests == 4 and adm.queued_tokens == 10
    order = await drain_in_order(adm, first, tasks)
    assert [d.tokens for d in order] == [2, 4, 3, 1]
    assert adm.inflight_slots == 0 and adm.queued_requests == 0


@sync
async def test_light_key_is_not_starved_by_a_heavy_one():
    adm, _, _ = make(capacity=2)
    held = [adm.try_grant(demand("heavy")), adm.try_grant(demand("heavy"))]
    tasks = await queue(
        adm, *[demand("heavy", tokens=i) for i in range(10)], demand("light", tokens=100), demand("light", tokens=101)
    )
    adm.release(held[0])
    await settle()
    went = [t.result().demand for t in tasks if t.done()]
    assert [d.key for d in went] == ["light"]  # arrived last, goes first: heavy holds both slots
    adm.release(held[1])
    await settle()
    went = [t.result().demand for t in tasks if t.done()]
    # 1 light, 1 heavy in flight: equal, the better head of line (arrival) goes: heavy's first
    assert sorted(d.tokens for d in went) == [0, 100]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@sync
async def test_shares_split_the_slots():
    adm, _, _ = make(capacity=4, shares={"a": 3.0, "b": 1.0})
    tasks = await queue(adm, *[demand("b") for _ in range(8)])  # b alone takes every slot
    tasks += await queue(adm, *[demand("a") for _ in range(8)])
    assert sum(t.done() for t in tasks) == 4
    for _ in range(40):  # release the oldest grants one at a time; a then holds 3 of the 4 slots
        done = [t for t in tasks if t.done() and not t.result().released]
        adm.release(done[0].result())
        await settle()
        held = [t.result().demand.key for t in tasks if t.done() and not t.result().released]
        if held.count("a") == 3:
            break
    assert held.count("a") == 3 and held.count("b") == 1
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@sync
async def test_queue_full_refuses_at_once_and_lower_priority_is_shed_first():
    adm, refused, _ = make(capacity=1, max_queued=2)
    first = adm.try_grant(demand())
    tasks = await queue(adm, demand(priority=0, tokens=1), demand(priority=3, tokens=2))
    with pytest.raises(Refused) as e:
        await adm.admit(demand(priority=3, tokens=3))  # ties with the worst queued: the newcomer goes
    assert (e.value.status, e.value.reason) == (429, "queue_full") and e.value.retry_after_s == 1.0
    assert "max_queued_requests=2" in e.value.message
    urgent = asyncio.create_task(adm.admit(demand(priority=-5, tokens=4)))
    await settle()
    with pytest.raises(Refused) as e:
        await tasks[1]  # the priority-3 request was displaced
    assert (e.value.status, e.value.reason) == (429, "displaced")
    assert [r.reason for r in refused] == ["queue_full", "displaced"]
    order = await drain_in_order(adm, first, [tasks[0], urgent])
    assert [d.tokens for d in order] == [4, 1]


@sync
async def test_queued_token_bound():
    adm, refused, _ = make(capacity=1, max_tokens=100)
    adm.try_grant(demand(tokens=1000))  # in flight: does not count against the queue
    tasks = await queue(adm, demand(tokens=60))
    with pytest.raises(Refused) as e:
        await adm.admit(demand(tokens=50))
    assert e.value.reason == "queue_tokens" and "max_queued_tokens=100" in e.value.message
    assert not tasks[0].done() and adm.queued_tokens == 60
    tasks[0].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.queued_tokens == 0


@sync
async def test_estimated_wait_and_retry_after_come_from_the_drain_rate():
    clock = Clock()
    adm, refused, _ = make(capacity=1, max_wait=2.0, clock=clock)
    grants = [adm.try_grant(demand(tokens=100))]
    for _ in range(10):  # 100 tokens done per second for 10 s: 100 tokens/s
        clock.t += 1.0
        adm.release(grants[-1])
        grants.append(adm.try_grant(demand(tokens=100)))
    assert adm.drain.tokens_per_s(clock()) == pytest.approx(100.0)
    tasks = await queue(adm, demand(tokens=150))  # nothing ahead: queued
    tasks += await queue(adm, demand(tokens=60))  # 150 tokens ahead = 1.5 s <= 2 s: queued
    assert adm.queued_requests == 2
    with pytest.raises(Refused) as e:
        await adm.admit(demand(tokens=10))  # 210 ahead = 2.1 s > 2 s
    assert (e.value.status, e.value.reason) == (429, "queue_wait") and "2.1s" in e.value.message
    assert e.value.retry_after_s == pytest.approx(2.2)  # (210 ahead + its own 10) / 100 tokens/s
    assert adm.queued_requests == 2 and [r.reason for r in refused] == ["queue_wait"]
    adm.release(grants[-1])
    await settle()
    assert tasks[0].done() and tasks[0].result().waited_s == 0.0  # the fake clock did not move
    tasks[1].cancel()
    await asyncio.gather(tasks[1], return_exceptions=True)
    adm.release(tasks[0].result())
    assert adm.queued_requests == 0 and adm.inflight_slots == 0


def test_retry_after_headers():
    assert retry_after_headers(2.2) == {"Retry-After": "3", "retry-after-ms": "2200"}
    assert retry_after_headers(0.1) == {"Retry-After": "1", "retry-after-ms": "100"}


def test_drain_rate_forgets_old_work():
    rate = DrainRate(window_s=10.0)
    assert rate.tokens_per_s(0.0) is None
    rate.start(0.0)
    rate.record(5.0, 100)
    assert rate.tokens_per_s(5.0) == pytest.approx(20.0)
    assert rate.tokens_per_s(16.0) is None


@sync
async def test_deadline_while_queued_is_504_and_leaves_nothing():
    clock = Clock()
    adm, refused, granted = make(capacity=1, clock=clock)
    first = adm.try_grant(demand())
    with pytest.raises(Refused) as e:  # waits 0.05 s (asyncio's time) in the queue
        await adm.admit(Demand("default", 0, 1, 10, deadline=clock.t + 0.05))
    assert (e.value.status, e.value.reason) == (504, "deadline") and "router's queue" in e.value.message
    assert adm.queued_requests == 0 and adm.inflight_slots == 1 and len(granted) == 1
    with pytest.raises(Refused) as e:  # already past its deadline: never queued
        await adm.admit(Demand("default", 0, 1, 10, deadline=0.0))
    assert e.value.status == 504 and [r.reason for r in refused] == ["deadline", "deadline"]
    adm.release(first)
    adm.release(first)  # idempotent
    assert adm.inflight_slots == 0


@sync
async def test_client_gone_while_queued_costs_nothing():
    adm, refused, granted = make(capacity=1)
    first = adm.try_grant(demand())
    tasks = await queue(adm, demand(tokens=1), demand(tokens=2))
    tasks[0].cancel()
    await asyncio.gather(tasks[0], return_exceptions=True)
    assert adm.queued_requests == 1 and adm.queued_tokens == 2
    adm.release(first)  # the slot goes to the one still waiting
    grant = await tasks[1]
    assert grant.demand.tokens == 2 and adm.inflight_slots == 1 and refused == []


@sync
async def test_grant_racing_a_cancel_is_released():
    adm, _, _ = make(capacity=1)
    first = adm.try_grant(demand())
    task = (await queue(adm, demand(tokens=7)))[0]
    adm.release(first)  # grants the queued one (its future is set) ...
    task.cancel()  # ... but its task is cancelled before it resumes
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and adm.inflight_slots == 0 and adm.queued_requests == 0


@sync
async def test_no_ready_worker_grants_at_once_and_big_requests_do_not_deadlock():
    adm, _, _ = make(capacity=0, max_queued=0)
    assert adm.try_grant(demand()) is not None  # routing answers 503 with the reason
    adm2, _, _ = make(capacity=2, max_queued=0)
    assert adm2.try_grant(demand(slots=5)) is not None  # alone, it may exceed the slots
    with pytest.raises(Refused) as e:
        await adm2.admit(demand())
    assert e.value.reason == "queue_full"


def test_api_key_syntax():
    assert parse_api_keys(None) == () and parse_api_keys("") == ()
    keys = parse_api_keys("alice:3, bob ,c:d:0.5")
    assert [(k.secret, k.name, k.share) for k in keys] == [
        ("alice", "key-0", 3.0),
        ("bob", "key-1", 1.0),
        ("c:d", "key-2", 0.5),
    ]
    for bad, why in (
        ("a:0", "positive"),
        ("a,,b", "empty key"),
        (":2", "empty key"),
        ("a,a:2", "repeats"),
        ("a:inf", "positive"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_api_keys(bad)
    with pytest.raises(ValueError, match="share must be a positive number"):
        PdserveConfig.model_validate({"server": {"api_key": "k:-1"}})


def test_failed_requests_do_not_count_as_drained_work():
    clock = Clock()
    adm, _, _ = make(capacity=1, clock=clock)
    adm.release(adm.try_grant(demand(tokens=500)), drained=False)
    clock.t += 1.0
    assert adm.drain.tokens_per_s(clock()) is None and adm.inflight_slots == 0
    adm.release(adm.try_grant(demand(tokens=50)))
    assert adm.drain.tokens_per_s(clock()) == pytest.approx(50.0)


def test_default_forwarding_bound_is_the_batch_plus_a_small_margin():
    """Without ``--max-inflight-per-worker`` each ready decode (or colocated) worker gets its batch
    (``max_running_requests``) plus max(2, an eighth) forwarding slots: enough to keep the batch
    full, and the rest queues in the router where key shares and priorities order it."""
    from types import SimpleNamespace

    from server.router.app import build_admission
    from server.router.registry import DEAD, READY
    from transfer.wire.enums import Role

    def handle(role, state=READY):
        return SimpleNamespace(state=state, spec=SimpleNamespace(role=role))

    registry = SimpleNamespace(
        handles={
            "p": handle(Role.PREFILL),
            "d0": handle(Role.DECODE),
            "d1": handle(Role.DECODE),
            "d2": handle(Role.DECODE, state=DEAD),
        }
    )
    for running, per_worker in ((64, 72), (16, 18), (4, 6), (1, 3)):
        cfg = PdserveConfig.model_validate({"scheduler": {"max_running_requests": running}})
        adm = build_admission(cfg, registry)
        assert adm.capacity() == 2 * per_worker  # two ready decode workers
        # the fair headroom keeps one place of each batch free: the margin beyond the batch, plus one
        assert adm.headroom.slots() == 2 * (per_worker - running + 1)
    cfg = PdserveConfig.model_validate({"server": {"max_inflight_per_worker": 5}})
    assert build_admission(cfg, registry).capacity() == 10  # the flag still wins
    assert build_admission(cfg, registry).headroom.slots() == 0  # 5 in flight never fill a batch of 64
    cfg = PdserveConfig.model_validate({"server": {"fair_headroom_per_worker": 0}})
    assert build_admission(cfg, registry).headroom.slots() == 0  # off


@sync
async def test_early_refusal_is_exactly_the_refusal_admit_gives():
    """``refuse_early`` (the fast 429, from key and priority only) refuses exactly the requests
    ``admit`` refuses at once for the queue bound, with the same reason and a counted refusal,
    and touches nothing otherwise: random queues of three keys (shares 2/1/1) and priorities."""
    import random

    rng = random.Random(27)
    cases = {"early": 0, "queued or displacing": 0}
    for _ in range(60):
        adm, refused, _ = make(capacity=1, max_queued=rng.randint(1, 5), shares={"a": 2.0})
        held = adm.try_grant(demand())
        assert adm.refuse_early("a", 0) is None  # room is gone, but nothing is queued yet: not certain
        tasks = await queue(
            adm,
            *(demand(key=rng.choice("abc"), priority=rng.randint(0, 3)) for _ in range(adm.limits.max_queued_requests)),
        )
        key, priority = rng.choice("abc"), rng.randint(0, 3)
        before = (adm.queued_requests, len(refused))
        try:
            adm.refuse_early(key, priority)
            early = None
        except Refused as e:
            early = e
        assert adm.queued_requests == before[0] and len(refused) == before[1] + (early is not None)
        newcomer = asyncio.create_task(adm.admit(demand(key=key, priority=priority)))
        await settle()
        if early is not None:
            cases["early"] += 1
            with pytest.raises(Refused) as e:
                await newcomer
            assert (e.value.status, e.value.reason) == (early.status, early.reason) == (429, "queue_full")
            assert e.value.message == early.message and early.retry_after_s == 1.0
        else:
            cases["queued or displacing"] += 1
            assert not newcomer.done() or newcomer.exception() is None, newcomer.exception()
        for t in [*tasks, newcomer]:
            t.cancel()
        await asyncio.gather(*tasks, newcomer, return_exceptions=True)
        adm.release(held)
    assert min(cases.values()) >= 10, cases  # both outcomes were exercised


def test_early_refusal_on_the_estimated_wait():
    """With a drain rate of 100 tokens/s and 210 tokens queued, ``max_queue_wait_s=2`` refuses early
    (``queue_wait``) as ``admit`` would; with the queue empty and room, nothing is refused."""
    clock = Clock()
    adm, refused, _ = make(capacity=1, max_wait=2.0, clock=clock)
    assert adm.refuse_early("default", 0) is None
    grants = [adm.try_grant(demand(tokens=100))]
    for _ in range(10):
        clock.t += 1.0
        adm.release(grants[-1])
        grants.append(adm.try_grant(demand(tokens=100)))

    async def scenario():
        tasks = await queue(adm, demand(tokens=150), demand(tokens=60))
        with pytest.raises(Refused) as e:
            adm.refuse_early("default", 0, min_tokens=10)
        assert (e.value.status, e.value.reason) == (429, "queue_wait") and "2.1s" in e.value.message
        assert e.value.retry_after_s == pytest.approx(2.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
    assert [r.reason for r in refused] == ["queue_wait"]
