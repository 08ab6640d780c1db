"""Faults for the chaos suite: what to do to which worker, and at which moment.

A fault waits until its victim reports work in one of ``when``'s scheduler queues (from the
router's ``/metrics``; the figures lag by up to one heartbeat), then a seeded random delay, then
acts: ``kill`` (SIGKILL; the launcher restarts the worker), ``stop`` (SIGSTOP for ``stop_s``, then
SIGCONT), ``hog`` (a busy-looping process beside the workers for the rest of the load) or
``page_size`` (SIGKILL the external decode worker and start it again with another page size).
"""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from chaos_cluster import Cluster, signal_worker
from server.subprocess_server import metric_sum


@dataclass(frozen=True)
class Fault:
    name: str
    action: str  # kill | stop | hog | page_size
    role: str = ""  # victim role (a local worker of it, chosen by the seeded RNG), or a worker id
    when: tuple[str, ...] = ()  # victim queues of which one must be non-empty first
    stop_s: float = 0.0
    load: int = 1  # times the usual number of streams (more streams: KV pressure, retractions)
    max_tokens: int | None = None  # instead of each prompt's own (longer: retracted requests wait longer)


@dataclass
class Injected:
    """What was done: to whom, when (monotonic s), what the victim's queues showed just before."""

    fault: Fault
    victim: str
    t: float
    observed: str
    hog: subprocess.Popen | None = None

    def end(self) -> None:
        """Stop what is still running (the hog)."""
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait()


def _victim(cluster: Cluster, fault: Fault, rng: random.Random) -> str:
    if fault.role in ("prefill", "decode"):
        local = [w for w in cluster.worker_ids(fault.role) if cluster.external is None
                 or w != cluster.external.worker_id]
        return rng.choice(local)
    return fault.role


def _wait_for_work(cluster: Cluster, victim: str, queues: tuple[str, ...], timeout_s: float = 15.0) -> str:
    """Poll until one of ``queues`` of ``victim`` is non-empty; a description of what was seen."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        m = cluster.metrics()
        seen = {q: metric_sum(m, "pdserve_queue_requests", worker=victim, queue=q) for q in queues}
        last = ", ".join(f"{q}={v:g}" for q, v in seen.items())
        if any(seen.values()):
            return last
        time.sleep(0.05)
    return f"not seen in {timeout_s:g}s ({last})"


def inject(cluster: Cluster, fault: Fault, rng: random.Random) -> Injected:
    """Wait for the moment, then act (blocking; a ``stop`` returns after SIGCONT)."""
    victim = _victim(cluster, fault, rng)
    observed = _wait_for_work(cluster, victim, fault.when) if fault.when else "-"
    time.sleep(rng.uniform(0.0, 0.15))
    t = time.monotonic()
    if fault.action == "kill":
        signal_worker(cluster, victim, signal.SIGKILL)
    elif fault.action == "stop":
        signal_worker(cluster, victim, signal.SIGSTOP)
        time.sleep(fault.stop_s)
        signal_worker(cluster, victim, signal.SIGCONT)
    elif fault.action == "hog":
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return Injected(fault, "(beside)", t, observed, hog)
    elif fault.action == "page_size":
        cluster.external.kill()
        cluster.external.start("--page-size", "8")
    else:
        raise ValueError(f"unknown fault action {fault.action!r}")
    return Injected(fault, victim, t, observed)


FAULTS = [
    Fault("kill -9 prefill mid-prefill", "kill", "prefill", ("waiting",)),
    Fault("kill -9 prefill mid-transfer", "kill", "prefill", ("bootstrap", "transfer")),
    Fault("kill -9 decode mid-decode", "kill", "decode", ("running",)),
    Fault("kill -9 decode, requests retracted", "kill", "decode", ("retracted",), load=3, max_tokens=96),
    Fault("SIGSTOP prefill 6 s (> lease)", "stop", "prefill", ("waiting", "bootstrap"), 6.0),
    Fault("SIGSTOP decode 2 s (< lease)", "stop", "decode", ("running",), 2.0),
    Fault("SIGSTOP decode 6 s (> lease)", "stop", "decode", ("running",), 6.0),
    Fault("CPU hog beside the workers", "hog"),
    Fault("decode restarted, page size 8", "page_size", "decode-x", ("running", "prealloc", "transfer")),
]
