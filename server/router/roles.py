"""A worker's live role switch, router side (the worker's side: ``server.worker.role_switch``).

``switch_role`` for ``POST /admin/role``: the worker must be a ready prefill or decode worker and
must not be the last ready one of its role (the switch would leave that role empty: refused). The
router takes it out of rotation (state ``switching``: no new request is routed to it, ``/health``
does not fail), sends ``SwitchRole`` and waits for ``RoleSwitched``. Meanwhile the worker moves
its requests out (a decode worker's migrate to peer decode workers through this router's
``Migrations``, their streams uninterrupted) or finishes them (a prefill worker's prompt writes).
On success the worker's spec takes the new role and its new process instance, and the switch
returns once a heartbeat of the new role made it ready again, counted in
``pdserve_role_switches_total{from,to,reason}``. On a refusal or a timeout the worker is back in
rotation in its old role. A worker that dies meanwhile (the launcher's exit notice, its control
connection, the heartbeats: the registry marks it dead) ends the switch at once, refused (409 naming
why), not at ``timeout_s``: its requests fail over as for any dead worker and it comes back, if
restarted, in its launch role; nothing is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from server.router.registry import Registry
from server.router.workers import READY, STARTING, SWITCHING, WorkerSpec
from transfer.wire.enums import Role

log = logging.getLogger(__name__)


class SwitchRefused(ValueError):
    """The switch was not made; ``status``: the HTTP status to answer (404 unknown worker, 409
    otherwise)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SwitchDone:
    """A completed switch: the worker, its old and new role, and how long it took (seconds, the
    router's clock: request sent to the worker ready in its new role)."""

    worker_id: str
    old: Role
    new: Role
    seconds: float


def check_switch(registry: Registry, worker_id: str, role: Role) -> None:
    """``SwitchRefused`` unless ``worker_id`` may switch to ``role`` now (module docstring)."""
    h = registry.handles.get(worker_id)
    if h is None:
        known = ", ".join(sorted(registry.handles)) or "none"
        raise SwitchRefused(404, f"no worker {worker_id!r}; known workers: {known}")
    old = h.spec.role
    if old not in (Role.PREFILL, Role.DECODE) or role not in (Role.PREFILL, Role.DECODE):
        raise SwitchRefused(409, f"worker {worker_id} is a {old} worker: only prefill <-> decode switch")
    if old == role:
        raise SwitchRefused(409, f"worker {worker_id} is a {role} worker already")
    if h.state != READY:
        raise SwitchRefused(409, f"worker {worker_id} is {h.state}, not ready")
    peers = [o for o in registry.handles.values() if o is not h and o.spec.role == old and o.state == READY]
    if not peers:
        raise SwitchRefused(409, f"switching {worker_id} would leave no ready {old} worker")


async def switch_role(registry: Registry, worker_id: str, role: Role, timeout_s: float) -> SwitchDone:
    """Switch ``worker_id`` to ``role`` (module docstring); ``SwitchRefused`` when not made.
    ``timeout_s``: for the worker to empty itself and answer, and again for its first heartbeat."""
    check_switch(registry, worker_id, role)
    h, t0 = registry.handles[worker_id], time.monotonic()
    old = h.spec.role
    h.state, h.reason = SWITCHING, f"switching role to {role}"
    log.warning("worker %s: switching role %s -> %s", worker_id, old, role)
    try:
        answer = await _answer(h, role, timeout_s)
    except SwitchOvertaken as e:
        raise SwitchRefused(409, f"worker {worker_id} did not switch: {e}") from None
    except Exception as e:  # noqa: BLE001 - unsent or unanswered: back in rotation, said why
        _back(h, f"switch not answered: {e}")
        raise SwitchRefused(409, f"worker {worker_id} did not switch: {e or 'no answer'}") from None
    if not answer.ok:
        _back(h, answer.error or "refused")
        raise SwitchRefused(409, f"worker {worker_id} did not switch: {answer.error}")
    h.spec = WorkerSpec(worker_id, role, h.spec.addr)
    h.instance, h.up_since, h.sources_sent = answer.instance, registry.clock(), None
    h.state, h.reason = STARTING, f"switched to {role}; waiting for its heartbeat"
    h.client.request_stats(0)
    deadline = time.monotonic() + timeout_s
    while h.state != READY and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if h.state != READY:
        raise SwitchRefused(409, f"worker {worker_id} switched to {role} but is {h.state}: {h.reason}")
    done = SwitchDone(worker_id, old, role, time.monotonic() - t0)
    log.warning("worker %s is a %s worker now (%.3f s)", worker_id, role, done.seconds)
    return done


class SwitchOvertaken(RuntimeError):
    """The worker left the ``switching`` state before it answered (it died, was restarted or drained)."""


async def _answer(h, role: Role, timeout_s: float, poll_s: float = 0.05):
    """The worker's ``RoleSwitched``; ``SwitchOvertaken`` as soon as the registry takes the worker out
    of ``switching`` (a dead process never answers: waiting for ``timeout_s`` would hold the caller)."""
    ask = asyncio.ensure_future(h.client.switch_role(role, timeout_s))
    try:
        while not ask.done():
            if h.state != SWITCHING:
                raise SwitchOvertaken(f"it is {h.state} before answering: {h.reason}")
            await asyncio.wait({ask}, timeout=poll_s)
        return ask.result()
    finally:
        ask.cancel()


def _back(h, why: str) -> None:
    """A switch that did not happen: the worker serves on in its old role (ready at its next heartbeat)."""
    if h.state == SWITCHING:
        h.state, h.reason = STARTING, f"role switch not made ({why}); waiting for its heartbeat"
