"""What the launcher does when one of its worker processes exits: restart it after an exponential
back-off, and give up after ``cluster.restart_limit`` restarts in a row that never got ready.

``RestartPolicy`` is the bookkeeping (no processes, no clock of its own): restart ``n`` in a row
waits ``min(restart_backoff_max_s, restart_backoff_s * 2**(n-1))``; the count starts again once a
restarted process is ready. ``WorkerSupervisor`` applies it to the launcher's processes and, when
the launcher runs the router, to the registry (dead, then restarting with the wait and the attempt
in ``/health``, or dead for good with the reason the launcher gave up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from configs.schema import ClusterConfig
from server.router.registry import READY, WorkerSpec

log = logging.getLogger("pdserve.launch")


@dataclass
class RestartPolicy:
    """Per worker: restarts in a row not yet ready, and when the next one is due (monotonic s)."""

    limit: int
    base_s: float
    max_s: float
    failures: dict[str, int] = field(default_factory=dict)
    due: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, c: ClusterConfig) -> RestartPolicy:
        """The policy of ``c``; ``restart_workers=False`` never restarts."""
        return cls(c.restart_limit if c.restart_workers else 0, c.restart_backoff_s, c.restart_backoff_max_s)

    def on_exit(self, worker_id: str, now: float) -> float | None:
        """The worker's process exited: seconds until its restart, or None once ``limit`` restarts
        in a row did not get it ready (give up)."""
        n = self.failures.get(worker_id, 0)
        if n >= self.limit:
            return None
        self.failures[worker_id] = n + 1
        delay = min(self.max_s, self.base_s * 2**n)
        self.due[worker_id] = now + delay
        return delay

    def pop_due(self, now: float) -> list[str]:
        """Workers whose restart is due now (each returned once per ``on_exit``)."""
        ids = [w for w, t in self.due.items() if t <= now]
        for w in ids:
            del self.due[w]
        return ids

    def attempt(self, worker_id: str) -> int:
        """Restarts in a row so far (0 once ready)."""
        return self.failures.get(worker_id, 0)

    def ready(self, worker_id: str) -> None:
        """The worker's current process is ready: the next exit starts counting from 1 again."""
        self.failures.pop(worker_id, None)


class WorkerSupervisor:
    """Restarts exited workers of ``procs`` by ``policy``; keeps ``registry`` (if any) informed.

    ``is_ready(spec)``: whether the worker's current process serves (the registry's view, or a
    probe when no router runs here). Call :meth:`tick` periodically from the event loop thread."""

    def __init__(
        self,
        procs,
        policy: RestartPolicy,
        registry=None,
        is_ready: Callable[[WorkerSpec], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.procs, self.policy, self.registry = procs, policy, registry
        self.is_ready = is_ready or self._registry_ready
        self.clock = clock
        self.given_up: dict[str, str] = {}  # worker id -> why the launcher stopped restarting it
        self._exit: dict[str, tuple[WorkerSpec, int, str]] = {}  # last exit: spec, code, old instance

    def _registry_ready(self, spec: WorkerSpec) -> bool:
        h = self.registry.handles.get(spec.worker_id)
        return h is not None and h.state == READY and h.instance != self._exit[spec.worker_id][2]

    def tick(self) -> list[str]:
        """Handle exits, start due restarts, reset the count of workers ready again. Returns the
        ids of workers given up on in this call."""
        now, gave_up = self.clock(), []
        for spec, rc in self.procs.new_exits():
            if not self._on_exit(spec, rc, now):
                gave_up.append(spec.worker_id)
        for wid in self.policy.pop_due(now):
            spec, rc, _ = self._exit[wid]
            log.warning(
                "restarting worker %s (%s): restart %d of at most %d in a row",
                wid,
                spec.role,
                self.policy.attempt(wid),
                self.policy.limit,
            )
            self.procs.restart(spec)
            self._mark_restarting(
                wid,
                f"restarting (restart {self.policy.attempt(wid)} of at most "
                f"{self.policy.limit} in a row): the previous process exited with code {rc}",
            )
        for wid in list(self.policy.failures):
            spec = self._exit[wid][0]
            if wid not in self.policy.due and self.is_ready(spec):
                log.info("worker %s is ready again after %d restart(s)", wid, self.policy.attempt(wid))
                self.policy.ready(wid)
        return gave_up

    def _on_exit(self, spec: WorkerSpec, rc: int, now: float) -> bool:
        """False when the launcher gives up on the worker."""
        wid = spec.worker_id
        if rc == 0:  # it drained (SIGTERM or the router's /admin/drain): it stays down on purpose
            # (a Shutdown message exits with server.worker.loop.EXIT_SHUTDOWN and is restarted)
            log.warning("worker %s (%s) exited after a drain; not restarting it", wid, spec.role)
            self.given_up[wid] = "drained: exited 0 after a drain; it stays down until the launch is restarted"
            if self.registry is not None and wid in self.registry.handles:
                self.registry.mark_drained(wid, self.given_up[wid])
            return True
        h = self.registry.handles.get(wid) if self.registry is not None else None
        old = h.instance if h is not None else ""
        self._exit[wid] = (spec, rc, old)
        delay = self.policy.on_exit(wid, now)
        if delay is None:
            why = (
                f"gave up restarting it after {self.policy.limit} restart(s) in a row that never got ready "
                f"(last exit code {rc}); its error is in the launcher's log; fix it and launch again"
                if self.policy.limit
                else f"worker process exited with code {rc} (restart_workers is off)"
            )
            log.error("worker %s (%s) exited with code %d: %s", wid, spec.role, rc, why)
            self.given_up[wid] = why
            if self.registry is not None:
                self.registry.mark_dead(wid, why, permanent=True)
            return False
        if self.registry is not None:
            self.registry.mark_dead(wid, f"worker process exited with code {rc}")
        log.warning("worker %s (%s) exited with code %d; restarting it in %.1fs", wid, spec.role, rc, delay)
        self._mark_restarting(
            wid,
            f"restarting in {delay:.1f}s (restart {self.policy.attempt(wid)} of at most "
            f"{self.policy.limit} in a row): the previous process exited with code {rc}",
        )
        return True

    def _mark_restarting(self, wid: str, reason: str) -> None:
        if self.registry is not None:
            self.registry.mark_restarting(wid, reason)
