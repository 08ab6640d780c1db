"""The decode side of a ``PDHarness`` taking back its prompts, as a decode worker switching role does."""

from __future__ import annotations

import time

from bench.harness.pd_harness import DECODE_CONN, PREFILL_ADDR, PDHarness
from decode_worker.evacuate import release_unprefilled
from server.worker.loop import worker_stats
from transfer.wire.outbox import Conn


def ask_back(h: PDHarness) -> list:
    """The decode side asks back what it may (``release_unprefilled``); the prefill side's answers,
    delivered back to the decode side."""
    h.deliver(release_unprefilled(h.decode), True)
    answers = []
    while h.to_prefill:
        msg, frames = h.to_prefill.pop(0)
        out = h.prefill.handle(Conn(DECODE_CONN), msg, frames)
        answers += [m.msg for m in out.messages]
        h.deliver(out, False)
    return answers


def reserve(h: PDHarness, rid: str, prompt: list[int], params) -> None:
    """Submit ``rid`` and run decode turns alone until its destination reached the prefill worker
    (its pages reserved): the prefill worker has not computed anything of it."""
    h.submit(rid, prompt, params)
    for _ in range(20):
        stats = worker_stats(h.prefill, "p0", "harness", "m")
        h.deliver(h.decode.peer_heartbeat(PREFILL_ADDR, stats, time.monotonic()), True)
        h.deliver(h.decode_turns.run().outbox, True)
        h._exchange()
        if any(j.req.rid == rid and j.dest is not None for j in h.prefill.jobs.values()):
            return
    raise AssertionError("no destination reached the prefill worker")
