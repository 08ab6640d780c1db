"""The launcher's worker child processes: start (with their inherited listening socket), watch
for exits, restart, stop. Children ignore SIGINT (the launcher stops them itself) and get SIGTERM
from the kernel if the launcher dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from server.launch.node_cgroups import NodeGroupError, NodeGroups, join_group
from server.router.registry import WorkerSpec

__all__ = ["WorkerProcesses", "ExternalWorkers"]

log = logging.getLogger("pdserve.launch")

_PR_SET_PDEATHSIG = 1


def _child_setup(procs_file: Path | None = None) -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if procs_file is not None:  # its node's CPU quota holds from the first instruction on
        join_group(procs_file)


class WorkerProcesses:
    """The launcher's worker children: start, watch for exits, stop (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        specs: list[WorkerSpec],
        argv: Callable[[WorkerSpec], list[str]],
        fds: dict[str, int] | None = None,
        shared_fds: tuple[int, ...] = (),
        env: dict[str, str] | None = None,
        groups: NodeGroups | None = None,
    ) -> None:
        """``fds``: per worker id, a file descriptor its process inherits (its listening socket);
        ``shared_fds``: inherited by every worker (the core ledger); ``env``: variables added to
        this process's environment for every worker (the launch's ephemeral cluster key);
        ``groups``: each worker runs in its own CPU-quota group (``--node-cpus``), made here and
        removed by ``stop``."""
        self.groups = groups
        try:
            for s in specs if groups is not None else ():
                groups.create(s.worker_id)
        except NodeGroupError:
            groups.remove_all()
            raise
        self.argv = argv
        self.env = {**os.environ, **env} if env else None
        self.fds = dict(fds or {})
        self.shared_fds = tuple(shared_fds)
        self.procs = {s.worker_id: (s, self._popen(s)) for s in specs}
        self._reported: set[str] = set()

    def _popen(self, spec: WorkerSpec) -> subprocess.Popen:
        fd = self.fds.get(spec.worker_id)
        own = () if fd is None else (fd,)
        procs_file = self.groups.procs_file(spec.worker_id) if self.groups is not None else None
        setup = functools.partial(_child_setup, procs_file)
        return subprocess.Popen(self.argv(spec), preexec_fn=setup, pass_fds=own + self.shared_fds, env=self.env)

    def restart(self, spec: WorkerSpec) -> None:
        """Start a fresh process for a worker whose process exited (it rejoins by heartbeat)."""
        self.procs[spec.worker_id] = (spec, self._popen(spec))
        self._reported.discard(spec.worker_id)

    def new_exits(self) -> list[tuple[WorkerSpec, int]]:
        """Workers that exited since the last call, with their exit codes."""
        out = []
        for wid, (spec, p) in self.procs.items():
            if wid not in self._reported and p.poll() is not None:
                self._reported.add(wid)
                out.append((spec, p.returncode))
        return out

    def live_pids(self) -> list[int]:
        """Pids of the worker processes not known to have exited (unreaped: ``new_exits`` reports
        an exit, reaping it)."""
        return [p.pid for wid, (_, p) in self.procs.items() if p.returncode is None and wid not in self._reported]

    def stop(self, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to every live worker (SIGTERM: drain; SIGUSR1: drain without the quiet
        period, when no router is left to route to them), wait up to ``grace_s``, SIGKILL the rest;
        reap all; close ``shared_fds``; remove the CPU-quota groups."""
        live = [p for _, p in self.procs.values() if p.poll() is None]
        for p in live:
            p.send_signal(sig)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pid %d did not stop in %.0fs; killing it", p.pid, grace_s)
                p.kill()
                p.wait()
        for fd in self.shared_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.shared_fds = ()
        if self.groups is not None:
            self.groups.remove_all()


class ExternalWorkers:
    """Workers this process did not start (``pdserve router``): nothing to watch, restart or stop."""

    def new_exits(self) -> list[tuple[WorkerSpec, int]]:
        return []

    def live_pids(self) -> list[int]:
        return []

    def restart(self, spec: WorkerSpec) -> None:  # pragma: no cover - never called without exits
        raise AssertionError("external workers are not restarted by the router")

    def stop(self, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
        pass
