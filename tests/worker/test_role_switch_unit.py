"""A worker's role switcher (server.worker.role_switch) over a scheduler double with a real KV
manager: what it refuses at once, that it waits for the worker to hold nothing, gives up past its
timeout (the old scheduler serves on), and on success returns the pages the radix cache kept,
closes the old transports and serves the rebuilt scheduler. (With real processes:
tests/e2e/test_role_switch_e2e.py.)"""

from __future__ import annotations

import pytest

from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator
from server.worker.role_switch import RoleSwitcher
from transfer.wire.enums import Role

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Closable:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def close(self) -> None:
        self.log.append(self.name)


class Sender(Closable):
    def __init__(self, log: list[str]) -> None:
        super().__init__(log, "sender")
        self.transport = Closable(log, "transport")


class PrefillDouble:
    """What the switcher reads of a prefill scheduler: role, held requests, KV manager, sender."""

    role = Role.PREFILL

    def __init__(self) -> None:
        self.kv = KVManager(PageAllocator(8), 4, enable_radix_cache=True)
        self.held: set[str] = set()
        self.closed: list[str] = []
        self.sender = Sender(self.closed)

    def held_rids(self) -> set[str]:
        return set(self.held)

    def check_integrity(self) -> None:
        pass


def switcher(clock: Clock, built: list[Role]) -> RoleSwitcher:
    def rebuild(role: Role):
        built.append(role)
        return f"new {role} scheduler"

    return RoleSwitcher(rebuild, timeout_s=10.0, clock=clock)


def test_refused_at_once():
    s, built = PrefillDouble(), []
    sw = switcher(Clock(), built)
    assert sw.begin(s, b"r", Role.PREFILL).error == "already a prefill worker"
    assert "prefill <-> decode only" in sw.begin(s, b"r", Role.COLOCATED).error
    assert sw.pending is None and built == []
    assert sw.begin(s, b"r", Role.DECODE) is None
    assert sw.begin(s, b"r", Role.DECODE).error == "a switch to decode is under way"


def test_switches_once_nothing_is_held_and_gives_every_page_back():
    clock, built, s = Clock(), [], PrefillDouble()
    kv = s.kv
    pages = kv.allocator.alloc(2)
    kv.tree.insert(list(range(8)), pages)  # a finished prompt's pages kept in the radix cache
    assert kv.allocator.num_free() == 6
    s.held = {"a"}  # a prompt write still in flight
    sw = switcher(clock, built)
    assert sw.begin(s, b"router", Role.DECODE) is None
    clock.t = 5.0
    assert sw.after_turn(s) is None and built == [] and s.closed == []
    s.held = set()
    new, answer, to = sw.after_turn(s)
    assert (new, answer.ok, answer.role, answer.seconds, to) == (
        "new decode scheduler",
        True,
        Role.DECODE,
        5.0,
        b"router",
    )
    assert built == [Role.DECODE] and s.closed == ["sender", "transport"]
    assert kv.allocator.num_free() == 8 and sw.pending is None


def test_gives_up_past_its_timeout_and_serves_on():
    clock, built, s = Clock(), [], PrefillDouble()
    s.held = {"a"}
    sw = switcher(clock, built)
    sw.begin(s, b"router", Role.DECODE)
    clock.t = 10.5
    same, answer, _ = sw.after_turn(s)
    assert same is s and not answer.ok and answer.role == Role.PREFILL
    assert answer.error == "1 request(s) still held after 10s; serving on as a prefill worker"
    assert built == [] and s.closed == [] and sw.pending is None
