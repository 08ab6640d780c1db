"""Per-request timeline: where a request's milliseconds go on one worker.

Schedulers stamp milestones on the request (``Request.mark``: first stamp wins, so a retracted
and re-admitted request keeps its first pass) and hand the request to ``Timeline.done`` when it
ends. Each role names its phases as spans between two milestones; every phase with both ends
stamped is observed in a histogram (shipped to the router as ``phase_<name>``, exported as
``pdserve_request_phase_seconds{worker, phase}``) and one DEBUG line per request lists them (a
second one its milestones' monotonic stamps, for ``benchmarks.handoff_trace``).
"""

from __future__ import annotations

import logging

from engine.request import Request
from engine.scheduler.stats import PHASE_BUCKETS, Histogram
from transfer.wire.enums import Role

log = logging.getLogger(__name__)

# role -> ((phase, from milestone, to milestone), ...)
PHASES: dict[Role, tuple[tuple[str, str, str], ...]] = {
    Role.COLOCATED: (
        ("queue", "arrived", "admitted"),
        ("prefill_compute", "admitted", "prefilled"),
        ("decode", "prefilled", "finished"),
    ),
    Role.PREFILL: (
        ("bootstrap_wait", "arrived", "destination"),
        ("prefill_queue", "destination", "admitted"),
        ("prefill_compute", "admitted", "prefilled"),
        ("transfer", "write_start", "write_done"),
    ),
    Role.DECODE: (
        ("decode_queue", "arrived", "reserved"),
        ("kv_wait", "reserved", "landed"),
        ("first_token", "landed", "first_token"),
        ("decode", "first_token", "finished"),
        # prefilled by the decode worker itself (selective disaggregation)
        ("local_prefill_queue", "local_prefill", "admitted"),
        ("local_prefill", "admitted", "prefilled"),
    ),
}

# decode phases of a request the decode worker prefilled itself (decode_worker.local_prefill); such a
# request has no decode_queue, kv_wait or first_token phase, a shipped one none of these
LOCAL_PREFILL_PHASES = ("local_prefill_queue", "local_prefill")


class Timeline:
    def __init__(self, role: Role) -> None:
        self.phases = PHASES[role]
        self.histograms = {f"phase_{name}": Histogram(PHASE_BUCKETS) for name, _, _ in self.phases}

    def done(self, req: Request) -> None:
        """``req`` ended: observe each phase it went through, log them on one DEBUG line."""
        req.mark("finished")
        spans = []
        for name, a, b in self.phases:
            if a in req.marks and b in req.marks:
                dt = max(0.0, req.marks[b] - req.marks[a])
                self.histograms[f"phase_{name}"].observe(dt)
                spans.append(f"{name}={dt * 1e3:.1f}")
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s (%s) phases in ms: %s", req.rid, req.finish_reason, " ".join(spans) or "-")
            log.debug("request %s marks (monotonic s): %s", req.rid, marks_text(req.marks))


def marks_text(marks: dict[str, float]) -> str:
    """``name=seconds`` for every milestone, in stamp order: CLOCK_MONOTONIC is one clock for every
    process of a machine, so ``benchmarks.handoff_trace`` lines up the router's and each worker's stamps
    of one request."""
    return " ".join(f"{k}={v:.6f}" for k, v in sorted(marks.items(), key=lambda kv: kv[1]))
