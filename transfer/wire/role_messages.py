"""Control messages of a live role switch (router <-> worker: ``server.worker.role_switch``).
Re-exported by ``transfer.wire.protocol``, which registers them."""

from __future__ import annotations

from transfer.wire.enums import Role
from transfer.wire.message import Message


class SwitchRole(Message):
    """Router -> worker: become a ``role`` worker (prefill or decode) without a restart, the weights
    kept loaded. The worker takes nothing new from then on, moves or finishes what it holds, builds
    the new role's scheduler and answers ``RoleSwitched``."""

    role: Role


class RoleSwitched(Message):
    """Worker -> router: the answer to ``SwitchRole``. ``ok``: the worker now serves as ``role``
    (its heartbeats say so, under a new process ``instance``); else ``error`` says why it did not
    switch (it goes on in its old role). ``seconds``: from the ``SwitchRole`` to serving."""

    ok: bool
    role: Role
    error: str | None = None
    seconds: float = 0.0
    instance: str = ""  # the worker's new process instance (its heartbeats from now on), when ok
