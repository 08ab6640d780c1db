"""Workers as nodes of a fixed CPU share (``cluster.node_cpus``): one CPU-quota cgroup per worker.

A cluster's nodes each have their own compute; the workers of one host's launch share its cores.
With ``--node-cpus X`` the launcher models the nodes on one host the way ``docker run --cpus X``
does: each worker process runs in its own cgroup (cgroup v1's ``cpu`` controller) whose CFS quota
is X cores (``cpu.cfs_quota_us`` = X x ``cpu.cfs_period_us``), so a busy worker gets at most X
cores' time whatever its peers do, and an idle one gives nothing to them (core lending is off).

Contract:
- ``NodeGroups.create(worker_id)`` makes the worker's group (``<root>/<prefix>-<worker id>``)
  with the quota; a root that is missing or not writable raises ``NodeGroupError`` naming what to
  fix (nothing is created then).
- A worker joins its group before it runs anything: its child process writes its own pid to the
  group's ``cgroup.procs`` between fork and exec (``procs_file``), so its threads and children
  are in the group from their start. A restarted worker joins the same group.
- ``remove_all()`` removes every group it created, once their processes have exited (the launcher
  calls it after it reaped its workers); a group still holding a process is left and logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("pdserve.launch")

CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


class NodeGroupError(RuntimeError):
    """A worker's CPU-quota group cannot be made; the message says why and what to fix."""


@dataclass
class NodeGroups:
    """The CPU-quota groups of one launch's workers: ``cpus`` cores each, under ``root`` (cgroup v1
    cpu hierarchy), named ``<prefix>-<worker id>``. ``rmdir`` removes an empty group (``os.rmdir``
    on cgroupfs, whose control files go with the directory)."""

    cpus: float
    root: Path = CPU_CGROUP_ROOT
    prefix: str = field(default_factory=lambda: f"pdserve-{os.getpid()}")
    rmdir: Callable[[Path], None] = os.rmdir
    groups: dict[str, Path] = field(default_factory=dict)

    def quota_us(self) -> int:
        """The CFS quota of one group per ``PERIOD_US`` period (at least 1 ms, the kernel's minimum)."""
        return max(1000, round(self.cpus * PERIOD_US))

    def create(self, worker_id: str) -> Path:
        """Make ``worker_id``'s group with the quota (idempotent); its path."""
        if worker_id in self.groups:
            return self.groups[worker_id]
        if not (self.root / "cpu.cfs_quota_us").exists():
            raise NodeGroupError(
                f"--node-cpus: no cgroup v1 cpu controller at {self.root} (cpu.cfs_quota_us missing); "
                "it needs a host with that hierarchy mounted"
            )
        path = self.root / f"{self.prefix}-{worker_id}"
        try:
            path.mkdir(exist_ok=True)
            (path / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (path / "cpu.cfs_quota_us").write_text(f"{self.quota_us()}\n")
        except OSError as e:
            raise NodeGroupError(
                f"--node-cpus: cannot make the CPU-quota cgroup {path} ({e.strerror or e}); "
                f"it needs write access to {self.root} (root, or a delegated hierarchy)"
            ) from None
        self.groups[worker_id] = path
        return path

    def procs_file(self, worker_id: str) -> Path | None:
        """The ``cgroup.procs`` file ``worker_id``'s process writes its pid to (None: no group)."""
        path = self.groups.get(worker_id)
        return None if path is None else path / "cgroup.procs"

    def remove_all(self) -> None:
        """Remove every group made here; one that cannot be removed (a process left in it) is logged."""
        for worker_id, path in list(self.groups.items()):
            try:
                self.rmdir(path)
            except OSError as e:
                log.warning("--node-cpus: cgroup %s of %s not removed: %s", path, worker_id, e)
                continue
            del self.groups[worker_id]


def join_group(procs_file: Path) -> None:
    """Move the calling process into the group of ``procs_file`` (runs in a child before exec)."""
    with open(procs_file, "w") as f:
        f.write(f"{os.getpid()}\n")


def node_threads(cpus: float) -> int:
    """Torch threads of a worker on a node of ``cpus`` cores: one per whole core, one below 1.5."""
    return max(1, round(cpus))
