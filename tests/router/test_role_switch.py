"""The router's side of a live role switch (server.router.roles) over worker client doubles: what is
refused (404, 409: a role left empty, the same role, a worker not ready), what a switch changes
(out of rotation while it runs, the spec's role and instance after it, ready on the next heartbeat),
and a refusal from the worker putting it back in rotation in its old role."""

from __future__ import annotations

import asyncio

import pytest

from server.router.inflight import InflightTable
from server.router.registry import READY, Registry, WorkerSpec
from server.router.roles import SwitchRefused, check_switch, switch_role
from server.router.workers import SWITCHING
from transfer.wire.enums import Role
from transfer.wire.protocol import RoleSwitched, WorkerStats

pytestmark = pytest.mark.unit


class RoleClient:
    """Reports its current role in every heartbeat; ``switch_role`` answers as ``answer`` says."""

    def __init__(self, spec: WorkerSpec, on_tokens, on_stats) -> None:
        self.spec, self.on_stats = spec, on_stats
        self.role, self.instance, self.answer, self.seen_states = spec.role, f"{spec.worker_id}-1", "ok", []
        self.registry: Registry | None = None

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def request_stats(self, nonce: int) -> None:
        stats = WorkerStats(
            nonce=nonce,
            worker_id=self.spec.worker_id,
            instance=self.instance,
            role=self.role,
            model="m",
            capacity_tokens=256,
            max_model_len=512,
            page_size=16,
        )
        self.on_stats(self.spec.worker_id, stats)

    async def switch_role(self, role: Role, timeout_s: float) -> RoleSwitched:
        self.seen_states.append(self.registry.handles[self.spec.worker_id].state)
        self.request_stats(0)  # a heartbeat during the switch does not bring it back into rotation
        self.seen_states.append(self.registry.handles[self.spec.worker_id].state)
        if self.answer != "ok":
            return RoleSwitched(ok=False, role=self.role, error=self.answer)
        self.role, self.instance = role, f"{self.spec.worker_id}-2"
        return RoleSwitched(ok=True, role=role, instance=self.instance, seconds=0.01)


def registry(*specs: tuple[str, Role]) -> Registry:
    reg = Registry([WorkerSpec(w, r, f"tcp://{w}:1") for w, r in specs], RoleClient, InflightTable())
    for h in reg.handles.values():
        h.client.registry = reg
        h.client.request_stats(0)
    assert all(h.state == READY for h in reg.handles.values())
    return reg


PD = (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE), ("decode-1", Role.DECODE))


@pytest.mark.parametrize(
    "worker,role,status,message",
    [
        ("decode-9", Role.PREFILL, 404, "no worker 'decode-9'; known workers: decode-0, decode-1, prefill-0"),
        ("prefill-0", Role.DECODE, 409, "switching prefill-0 would leave no ready prefill worker"),
        ("decode-1", Role.DECODE, 409, "worker decode-1 is a decode worker already"),
    ],
)
def test_refusals(worker, role, status, message):
    reg = registry(*PD)
    with pytest.raises(SwitchRefused) as e:
        check_switch(reg, worker, role)
    assert (e.value.status, str(e.value)) == (status, message)


def test_a_worker_not_ready_is_not_switched():
    reg = registry(*PD)
    reg.handles["decode-1"].state = "draining"
    with pytest.raises(SwitchRefused, match="worker decode-1 is draining, not ready"):
        check_switch(reg, "decode-1", Role.PREFILL)
    reg.handles["decode-1"].state = READY
    reg.handles["decode-0"].state = "dead"  # decode-1 is then the last ready decode worker
    with pytest.raises(SwitchRefused, match="would leave no ready decode worker"):
        check_switch(reg, "decode-1", Role.PREFILL)


def test_a_switch_takes_the_worker_out_of_rotation_and_back_in_its_new_role():
    reg = registry(*PD)
    h = reg.handles["decode-1"]
    done = asyncio.run(switch_role(reg, "decode-1", Role.PREFILL, timeout_s=5))
    assert h.client.seen_states == [SWITCHING, SWITCHING]
    assert (done.worker_id, done.old, done.new) == ("decode-1", Role.DECODE, Role.PREFILL)
    assert h.spec.role == Role.PREFILL and h.state == READY and h.instance == "decode-1-2"
    assert h.restarts == 0  # the new instance came with the answer: not a restart
    assert "decode-1 (prefill): ready" in reg.describe()
    # and now prefill-0 may switch: decode-1 prefills
    asyncio.run(switch_role(reg, "prefill-0", Role.DECODE, timeout_s=5))
    assert reg.handles["prefill-0"].spec.role == Role.DECODE


def test_a_worker_that_refuses_serves_on_in_its_old_role():
    reg = registry(*PD)
    h = reg.handles["decode-1"]
    h.client.answer = "no migration path"
    with pytest.raises(SwitchRefused, match="worker decode-1 did not switch: no migration path") as e:
        asyncio.run(switch_role(reg, "decode-1", Role.PREFILL, timeout_s=5))
    assert e.value.status == 409
    h.client.request_stats(1)
    assert h.spec.role == Role.DECODE and h.state == READY
