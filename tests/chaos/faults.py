"""Faults for the chaos suite: what to do to which worker, and at which moment.

A fault waits until its victim reports work in one of ``when``'s scheduler queues (from the
router's ``/metrics``; the figures lag by up to one heartbeat), then a seeded random delay, then
acts: ``kill`` (SIGKILL; the launcher restarts the worker), ``stop`` (SIGSTOP for ``stop_s``, then
SIGCONT), ``hog`` (a busy-looping process beside the workers for the rest of the load) or
``page_size`` (SIGKILL the external decode worker and start it again with another page size).
The external decode worker is killed and started again at once by the test itself (no launcher
watches it), so the router may hear the new process before the old one's lease ran out.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from bench.harness.subprocess_server import metric_sum
from tests.chaos.chaos_cluster import Cluster, signal_worker


@dataclass(frozen=True)
class Fault:
    name: str
    action: str  # kill | stop | hog | page_size
    role: str = ""  # victim role (a local worker of it, chosen by the seeded RNG), or a worker id
    when: tuple[str, ...] = ()  # victim queues of which one must be non-empty first
    stop_s: float = 0.0


@dataclass
class Injected:
    """What was done: to whom, when (monotonic s), what the victim's queues showed just before."""

    fault: Fault
    victim: str
    t: float
    observed: str
    seen: bool = True  # the fault's moment was seen (False: injected at whatever moment, after waiting)
    hog: subprocess.Popen | None = None

    def end(self) -> None:
        """Stop what is still running (the hog)."""
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait()


def _candidates(cluster: Cluster, fault: Fault) -> list[str]:
    """Workers the fault may hit: a worker id as given, else the launcher's workers of the role."""
    if fault.role not in ("prefill", "decode"):
        return [fault.role]
    external = cluster.external.worker_id if cluster.external is not None else None
    return [w for w in cluster.worker_ids(fault.role) if w != external]


def _wait_for_work(cluster: Cluster, fault: Fault, rng: random.Random, timeout_s: float = 8.0) -> tuple[str, str, bool]:
    """Poll until a candidate shows work in one of ``fault.when``'s queues; (victim, what was seen,
    whether the moment came). The victim is drawn (seeded) among those showing it, or among all if
    none did in time."""
    candidates = _candidates(cluster, fault)
    if not fault.when:
        return rng.choice(candidates), "-", True
    deadline = time.monotonic() + timeout_s
    while True:
        m = cluster.metrics()
        seen = {
            w: {q: metric_sum(m, "pdserve_queue_requests", worker=w, queue=q) for q in fault.when} for w in candidates
        }
        busy = [w for w in candidates if any(seen[w].values())]
        if busy or time.monotonic() > deadline:
            victim = rng.choice(busy or candidates)
            what = ", ".join(f"{q}={v:g}" for q, v in seen[victim].items())
            return victim, (what if busy else f"not seen in {timeout_s:g}s ({what})"), bool(busy)
        time.sleep(0.05)


def inject(cluster: Cluster, fault: Fault, rng: random.Random, at_any_moment: bool = True) -> Injected | None:
    """Wait for the moment, then act (blocking; a ``stop`` returns after SIGCONT). The moment not
    seen: act anyway when ``at_any_moment``, else do nothing and return None (the caller runs
    another wave and tries again)."""
    victim, observed, seen = _wait_for_work(cluster, fault, rng)
    if not (seen or at_any_moment):
        return None
    time.sleep(rng.uniform(0.0, 0.15))
    t = time.monotonic()
    external = cluster.external is not None and victim == cluster.external.worker_id
    if fault.action == "kill" and external:  # no launcher restarts it: the test does, at once
        cluster.external.kill()
        cluster.external.start()
    elif fault.action == "kill":
        signal_worker(cluster, victim, signal.SIGKILL)
    elif fault.action == "stop":
        signal_worker(cluster, victim, signal.SIGSTOP)
        time.sleep(fault.stop_s)
        signal_worker(cluster, victim, signal.SIGCONT)
    elif fault.action == "hog":
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return Injected(fault, "(beside)", t, observed, seen, hog)
    elif fault.action == "page_size":
        cluster.external.kill()
        cluster.external.start("--page-size", "8")
    else:
        raise ValueError(f"unknown fault action {fault.action!r}")
    return Injected(fault, victim, t, observed, seen)


FAULTS = [
    Fault("kill -9 prefill mid-prefill", "kill", "prefill", ("waiting", "prefilling")),
    Fault("kill -9 prefill mid-transfer", "kill", "prefill", ("bootstrap", "transfer")),
    Fault("kill -9 decode mid-decode", "kill", "decode", ("running",)),
    # decode-x, the decode worker the test runs itself, retracts a request every 4 steps (a test knob)
    Fault("kill -9 decode, requests retracted", "kill", "decode-x", ("retracted",)),
    # decode-x moves its parked requests to decode-0/1: the source dies with migrations under
    # way (an offer or write lasts milliseconds, so the moment is drawn while it has parked or offered ones)
    Fault("kill -9 decode mid-migration (source)", "kill", "decode-x", ("migrating", "retracted")),
    Fault("SIGSTOP prefill 6 s (> lease)", "stop", "prefill", ("waiting", "bootstrap"), 6.0),
    Fault("SIGSTOP decode 2 s (< lease)", "stop", "decode", ("running",), 2.0),
    Fault("SIGSTOP decode 6 s (> lease)", "stop", "decode", ("running",), 6.0),
    Fault("CPU hog beside the workers", "hog"),
    Fault("decode restarted, page size 8", "page_size", "decode-x", ("running", "prealloc", "transfer")),
]
