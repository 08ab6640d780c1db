"""Deterministic in-process PD pair: the real prefill and decode schedulers, built as the worker
processes build them, with their outboxes delivered by direct calls instead of sockets and the
loopback KV transport. For unit tests and benchmarks; the real path (processes, ZMQ, NIXL) is
covered by the process-level tests.

Wiring: the decode side addresses the prefill worker as ``Peer(PREFILL_ADDR)``; those messages
reach ``prefill.handle`` as from ``Conn(DECODE_CONN)``, and what the prefill side sends to that
connection comes back to ``decode.handle`` as from the peer. Heartbeats are answered the way the
worker loop answers them. Each side runs the worker loop's turns (``server.worker.turn``: a
prefill turn that finished KV handoffs pauses before computing). Token deltas for the router are
collected (``step`` returns the decode side's; the prefill side's land in ``router_inbox``); the
decode side's other messages to the router (``Conn(ROUTER)``) land in ``router_messages``.
"""

from __future__ import annotations

import itertools
import time

from configs.schema import PdserveConfig
from decode_worker.scheduler import create_decode_scheduler
from engine.model_runner import ModelRunner
from prefill_worker.scheduler import create_prefill_scheduler
from server.worker.loop import worker_stats
from server.worker.turn import Turns
from transfer.loopback import LoopbackTransport
from transfer.wire.outbox import Conn, Outbox, Peer
from transfer.wire.protocol import GenerateRequest, PrefillRequest, StatsRequest, TokenDelta, ids_frame
from transfer.wire.sampling_params import SamplingParams

PREFILL_ADDR = "inproc://p"
DECODE_CONN = b"d0"
ROUTER = b"router"
_names = itertools.count()


class PDHarness:
    def __init__(self, cfg_p: PdserveConfig, cfg_d: PdserveConfig, model_config, weights, eos=()):
        n = next(_names)
        self.p_runner = ModelRunner(cfg_p.engine, model_config, weights)
        self.d_runner = ModelRunner(cfg_d.engine, model_config, weights)
        self.transports = (LoopbackTransport(f"p{n}"), LoopbackTransport(f"d{n}"))
        self.prefill = create_prefill_scheduler(self.p_runner, cfg_p, self.transports[0], "p0", "m", threaded=False)
        self.decode = create_decode_scheduler(self.d_runner, cfg_d, self.transports[1], "d0", "m", tuple(eos))
        self.prefill_turns, self.decode_turns = Turns(self.prefill), Turns(self.decode)
        self.to_prefill: list = []
        self.to_decode: list = []
        self.router_inbox: list[TokenDelta] = []
        self.router_messages: list = []  # the decode side's messages to the router, deltas aside
        self.room = itertools.count(1)
        self.heartbeats = True  # False: the prefill side answers no heartbeat (a silent peer)

    def deliver(self, out: Outbox | None, from_decode: bool) -> list[TokenDelta]:
        """Queue ``out``'s messages for the other side; return its token deltas."""
        for m in out.messages if out else ():
            if from_decode and m.to == Conn(ROUTER):
                self.router_messages.append(m.msg)
            elif from_decode:
                assert m.to == Peer(PREFILL_ADDR), m
                self.to_prefill.append((m.msg, list(m.frames)))
            else:
                assert m.to == Conn(DECODE_CONN), m
                self.to_decode.append((m.msg, list(m.frames)))
        return out.deltas if out else []

    def submit(self, rid: str, prompt: list[int], params: SamplingParams, preempt: bool = False) -> None:
        room = next(self.room)
        self.deliver(
            self.decode.add(
                ROUTER,
                GenerateRequest(rid=rid, params=params, room=room, prefill_addr=PREFILL_ADDR, preempt=preempt),
                prompt,
            ),
            True,
        )
        msg = PrefillRequest(rid=rid, room=room, params=params, decode_worker="d0")
        self.router_inbox += self.deliver(self.prefill.handle(Conn(ROUTER), msg, [ids_frame(prompt)]), False)

    def answer(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        """Send ``rid`` to the prefill side alone as a one-token request it answers itself
        (``PrefillRequest.answer_router``: the router's route for ``max_new_tokens`` 1); its delta
        lands in ``router_inbox``."""
        msg = PrefillRequest(rid=rid, room=next(self.room), params=params, decode_worker="", answer_router=True)
        self.router_inbox += self.deliver(self.prefill.handle(Conn(ROUTER), msg, [ids_frame(prompt)]), False)

    def _exchange(self) -> list[TokenDelta]:
        """Deliver queued messages both ways until none is left; the decode side's token deltas."""
        deltas: list[TokenDelta] = []
        while self.to_prefill or self.to_decode:
            while self.to_prefill:
                msg, frames = self.to_prefill.pop(0)
                if isinstance(msg, StatsRequest):  # answered by the worker loop, not the scheduler
                    self.to_decode.append((worker_stats(self.prefill, "p0", "harness", "m"), []))
                    continue
                self.router_inbox += self.deliver(self.prefill.handle(Conn(DECODE_CONN), msg, frames), False)
            while self.to_decode:
                msg, frames = self.to_decode.pop(0)
                deltas += self.deliver(self.decode.handle(Peer(PREFILL_ADDR), msg, frames), True)
        return deltas

    def step(self) -> list[TokenDelta]:
        """One turn of each side (prefill first), messages exchanged in between; the decode
        side's token deltas. Right before the decode turn the decode side gets a heartbeat reply of
        the prefill side, as the worker loop's pinger thread would: the in-process peer is alive, so
        wall time spent in long steps (a slow or loaded machine, the prefill turn included) must
        never get it declared dead (``heartbeats = False`` silences it)."""
        deltas = self._exchange()
        self.router_inbox += self.deliver(self.prefill_turns.run().outbox, False)
        if self.heartbeats:
            stats = worker_stats(self.prefill, "p0", "harness", "m")
            deltas += self.deliver(self.decode.peer_heartbeat(PREFILL_ADDR, stats, time.monotonic()), True)
        deltas += self._exchange()
        return deltas + self.deliver(self.decode_turns.run().outbox, True)

    @property
    def busy(self) -> bool:
        return bool(self.decode.jobs or self.prefill.jobs or self.to_decode or self.to_prefill)

    def run(self, max_steps: int = 10000) -> dict:
        out: dict[str, dict] = {}
        for _ in range(max_steps):
            if not self.busy:
                break
            for d in self.step():
                o = out.setdefault(d.rid, {"tokens": [], "finish": None, "error": None})
                o["tokens"] += d.token_ids
                if d.prompt_logprobs is not None:
                    o["prompt_logprobs"] = d.prompt_logprobs
                if d.finish_reason:
                    o["finish"], o["error"] = d.finish_reason, d.error
        assert not self.busy, "PD harness did not drain"
        return out

    def check_clean(self) -> None:
        for s in (self.prefill, self.decode):
            s.check_integrity()
            assert s.kv.usage([]).used == 0
            assert s.kv.usage([], "swa") is None or s.kv.usage([], "swa").used == 0
        host = self.decode.retract.host
        if host is not None:
            assert host.num_free() == host.num_pages

    def close(self) -> None:
        self.prefill.sender.close()
        for t in self.transports:
            t.close()


def checked_harnesses(build):
    """For a pytest fixture (``yield from checked_harnesses(build)``): yields ``make``, which calls
    ``build(*args, **kwargs)`` and remembers the harness; at teardown every harness made is checked
    clean (``check_clean``: allocator invariants, nothing held) and closed."""
    made = []

    def make(*args, **kwargs):
        made.append(build(*args, **kwargs))
        return made[-1]

    yield make
    for h in made:
        h.check_clean()
        h.close()
