"""Worker-client doubles for the router's registry and session tests: a client that records what
the router sends it, a colocated one that also answers heartbeats and plays scripted deltas, and a
registry of ready workers named by role (``p0``, ``d1``, ``c0``), and a client that switches role
when asked (``SwitchingClient``, for the role switch and planner tests)."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from server.router.inflight import InflightTable
from server.router.registry import ROUTING_POLICIES, Registry, WorkerSpec
from transfer.wire.enums import Role
from transfer.wire.protocol import HistogramData, RoleSwitched, TokenDelta, WorkerStats

ROLES = {"p": "prefill", "d": "decode", "c": "colocated"}


def fake_stats(worker_id: str, role: str, nonce: int, instance: str = "", **fields) -> WorkerStats:
    """A heartbeat answer of a small worker (256 tokens of KV, page 16, model "m"); ``fields``
    override or add ``WorkerStats`` fields."""
    base = {"model": "m", "capacity_tokens": 256, "max_model_len": 512, "page_size": 16}
    return WorkerStats(nonce=nonce, worker_id=worker_id, instance=instance, role=role, **(base | fields))


class Sent(NamedTuple):
    """One message the router sent a worker: its kind ("generate", "prefill", or "answer": a
    prefill it answers itself), request id, resumed ids and parameters."""

    kind: str
    rid: str
    resume: list[int] | None
    params: object


class RecordingClient:
    """Records what the router sends to one worker (``sent``) and the ids it aborts (``aborted``)."""

    def __init__(self, spec: WorkerSpec, on_tokens=None, on_stats=None) -> None:
        self.spec, self.on_tokens, self.on_stats = spec, on_tokens, on_stats
        self.sent: list[Sent] = []
        self.aborted: list[str] = []

    def rids(self) -> list[str]:
        """The request ids sent, in order."""
        return [s.rid for s in self.sent]

    def prefill(self, rid, room, ids, params, *a, answer_router: bool = False) -> None:
        self.sent.append(Sent("answer" if answer_router else "prefill", rid, None, params))

    def generate(self, rid, ids, params, **k) -> None:
        self.sent.append(Sent("generate", rid, k.get("resume_output_ids"), params))

    def abort(self, rids, reason) -> None:
        self.aborted += rids


class ScriptedColocated(RecordingClient):
    """A colocated worker double for a router built by ``build_context``: answers heartbeats at
    once and plays, for each request, the deltas ``script(rid, resume_output_ids)`` returns."""

    def __init__(self, spec: WorkerSpec, on_tokens, on_stats, script) -> None:
        super().__init__(spec, on_tokens, on_stats)
        self.script = script

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def request_stats(self, nonce: int) -> None:
        self.on_stats(self.spec.worker_id, fake_stats(self.spec.worker_id, "colocated", nonce, model="fake-model"))

    def generate(self, rid, ids, params, **k) -> None:
        super().generate(rid, ids, params, **k)
        deltas: list[TokenDelta] = self.script(rid, k.get("resume_output_ids"))
        loop = asyncio.get_running_loop()
        for d in deltas:
            loop.call_soon(self.on_tokens, self.spec.worker_id, d)


def ready_registry(mode: str, *ids: str, client: type[RecordingClient] = RecordingClient) -> Registry:
    """A registry of ready recording workers (``client``) named like ``p0``/``d1``/``c0`` (role from
    the first letter), each with a 100-token pool and context, under ``mode``'s routing policy."""
    specs = [WorkerSpec(w, ROLES[w[0]], f"tcp://{w}") for w in ids]
    reg = Registry(specs, lambda s, *a: client(s), InflightTable(), timeout_s=2.0, policy=ROUTING_POLICIES[mode])
    for s in specs:
        stats = WorkerStats(
            worker_id=s.worker_id, role=s.role, model="m", capacity_tokens=100, max_model_len=100, page_size=1
        )
        reg.on_stats(s.worker_id, stats)
    return reg


class SwitchingClient:
    """A worker that reports its current role (and ``counters``/``gauges``/``histograms``) in every
    heartbeat and answers ``switch_role``: with ``answer`` "ok" it takes the role under a new
    instance, otherwise it refuses with ``answer`` as the error. ``switches``: the roles asked for;
    ``seen_states``: its registry state (``registry``, when set) as the switch began and after a
    heartbeat sent during it; ``hold``: an event the answer waits for (a switch in progress)."""

    def __init__(self, spec: WorkerSpec, on_tokens=None, on_stats=None) -> None:
        self.spec, self.on_stats, self.role, self.instance = spec, on_stats, spec.role, f"{spec.worker_id}-1"
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.histograms: dict[str, HistogramData] = {}
        self.switches: list[Role] = []
        self.seen_states: list[str] = []
        self.answer, self.hold = "ok", None
        self.registry: Registry | None = None

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def abort(self, rids, reason) -> None:
        pass

    def request_stats(self, nonce: int) -> None:
        extra = {"counters": self.counters, "gauges": self.gauges, "histograms": self.histograms}
        self.on_stats(self.spec.worker_id, fake_stats(self.spec.worker_id, self.role, nonce, self.instance, **extra))

    async def switch_role(self, role: Role, timeout_s: float) -> RoleSwitched:
        self.switches.append(role)
        if self.registry is not None:
            self.seen_states.append(self.registry.handles[self.spec.worker_id].state)
            self.request_stats(0)  # a heartbeat during the switch does not bring it back into rotation
            self.seen_states.append(self.registry.handles[self.spec.worker_id].state)
        if self.hold is not None:
            await asyncio.wait_for(self.hold.wait(), timeout_s)
        if self.answer != "ok":
            return RoleSwitched(ok=False, role=self.role, error=self.answer)
        self.role, self.instance = role, f"{self.spec.worker_id}-2"
        return RoleSwitched(ok=True, role=role, instance=self.instance, seconds=0.01)
