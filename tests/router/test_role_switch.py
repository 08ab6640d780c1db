"""The router's side of a live role switch (server.router.roles) over worker client doubles: what is
refused (404, 409: a role left empty, the same role, a worker not ready), what a switch changes
(out of rotation while it runs, the spec's role and instance after it, ready on the next heartbeat),
a refusal from the worker putting it back in rotation in its old role, and a worker that dies
mid-switch ending the switch at once (409), uncounted, not at the switch's timeout."""

from __future__ import annotations

import asyncio

import pytest

from server.router.inflight import InflightTable
from server.router.registry import READY, Registry, WorkerSpec
from server.router.roles import SwitchRefused, check_switch, switch_role
from server.router.workers import DEAD, SWITCHING
from tests.support.router_doubles import SwitchingClient
from transfer.wire.enums import Role

pytestmark = pytest.mark.unit


def registry(*specs: tuple[str, Role]) -> Registry:
    reg = Registry([WorkerSpec(w, r, f"tcp://{w}:1") for w, r in specs], SwitchingClient, InflightTable())
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


def test_a_worker_that_dies_mid_switch_ends_the_switch_at_once():
    reg = registry(*PD)
    h = reg.handles["decode-1"]
    h.client.hold = asyncio.Event()  # it evacuates and never answers: it is killed meanwhile

    async def scenario():
        switch = asyncio.create_task(switch_role(reg, "decode-1", Role.PREFILL, timeout_s=3))
        await asyncio.sleep(0.1)
        assert h.state == SWITCHING and not switch.done()
        reg.mark_dead("decode-1", "worker process exited with code -9")
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(SwitchRefused) as e:
            await switch
        return e.value, asyncio.get_running_loop().time() - t0

    refused, waited = asyncio.run(scenario())
    assert refused.status == 409 and waited < 1.0
    assert str(refused) == (
        "worker decode-1 did not switch: it is dead before answering: worker process exited with code -9"
    )
    assert h.state == DEAD and h.spec.role == Role.DECODE
