"""CPU seconds of a launched server's processes over a measured load level, per process and per
output token (the goal: the router's cost stays under 10% of one core per 100 output tok/s).

The launcher process runs the router (uvicorn, in-process); its direct children that were started
as ``python -m server.worker.main --role R --worker-id ID`` are the workers, named by their id
(``prefill-0``, ``decode-0``, ``colocated-0``). CPU time is utime + stime of ``/proc/<pid>/stat``
(all threads), so the figures do not depend on what else the machine runs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

ROUTER = "router"
ROUTER_GOAL_PCT = 10.0  # % of one core per 100 output tok/s
_TICK = os.sysconf("SC_CLK_TCK")


def stat_cpu_seconds(stat_line: str, tick: int = _TICK) -> float:
    """User + system CPU seconds from one ``/proc/<pid>/stat`` line. The command name (field 2, in
    parentheses) may hold spaces and parentheses, so fields are counted after its last ``)``."""
    rest = stat_line.rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / tick  # fields 14 (utime) and 15 (stime)


def stat_ppid(stat_line: str) -> int:
    """The parent pid (field 4) of one ``/proc/<pid>/stat`` line."""
    return int(stat_line.rsplit(")", 1)[1].split()[1])


def worker_name(argv: list[str]) -> str | None:
    """The ``--worker-id`` of a worker's command line, None for any other process."""
    if "server.worker.main" not in argv or "--worker-id" not in argv:
        return None
    i = argv.index("--worker-id") + 1
    return argv[i] if i < len(argv) else None


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def server_processes(launcher_pid: int) -> dict[str, int]:
    """``{"router": launcher_pid, worker id: pid, ...}`` for the launcher's worker children."""
    procs = {ROUTER: launcher_pid}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat_ppid(stat.read_text()) != launcher_pid:
                continue
            name = worker_name(_cmdline(int(stat.parent.name)))
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if name is not None:
            procs[name] = int(stat.parent.name)
    return procs


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds of ``pid`` so far, None if it is gone."""
    try:
        return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class CpuMeter:
    """Per-process CPU seconds between ``start()`` and ``stop()`` of the server whose launcher is
    ``launcher_pid`` (processes found again at every ``start``, since a worker may be restarted)."""

    launcher_pid: int
    cpu_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    _before: dict[str, tuple[int, float | None]] = field(default_factory=dict, init=False, repr=False)
    _t0: float = field(default=0.0, init=False, repr=False)

    def start(self) -> None:
        """Snapshot every process's CPU time now (right before the measured requests)."""
        self._before = {n: (p, cpu_seconds(p)) for n, p in server_processes(self.launcher_pid).items()}
        self._t0 = time.monotonic()

    def stop(self) -> None:
        """CPU seconds since ``start`` per process (a process gone meanwhile is left out)."""
        self.wall_s = time.monotonic() - self._t0
        self.cpu_s = {}
        for name, (pid, before) in self._before.items():
            after = cpu_seconds(pid)
            if before is not None and after is not None:
                self.cpu_s[name] = after - before


def cpu_fields(cpu_s: dict[str, float] | None, wall_s: float, output_tokens: int) -> dict:
    """The JSON fields of one run: ``cpu_s`` and ``cpu_s_per_output_token`` per process, and
    ``router_core_pct_per_100_tok_s`` = (router CPU s / wall s) x 100 / (output tok/s / 100);
    all None when the processes are unknown (a server the bench did not launch)."""
    if cpu_s is None:
        return {
            "cpu_wall_s": None,
            "cpu_s": None,
            "cpu_s_per_output_token": None,
            "router_core_pct_per_100_tok_s": None,
        }
    per_token = {n: (s / output_tokens if output_tokens else None) for n, s in cpu_s.items()}
    return {
        "cpu_wall_s": wall_s,
        "cpu_s": dict(cpu_s),
        "cpu_s_per_output_token": per_token,
        "router_core_pct_per_100_tok_s": router_pct_per_100_tok_s(cpu_s.get(ROUTER), wall_s, output_tokens),
    }


def router_pct_per_100_tok_s(router_cpu_s: float | None, wall_s: float, output_tokens: int) -> float | None:
    """% of one core the router used per 100 output tok/s (None without tokens, time or router)."""
    if router_cpu_s is None or wall_s <= 0 or output_tokens <= 0:
        return None
    core_pct = 100.0 * router_cpu_s / wall_s
    return core_pct / (output_tokens / wall_s / 100.0)


def cpu_rows(load: str, fields_: dict) -> list[tuple]:
    """Table rows (load, process, CPU s, CPU ms per output token, % of one core) of one run."""
    rows = []
    for name, s in fields_["cpu_s"].items():
        per_tok = fields_["cpu_s_per_output_token"][name]
        pct = 100.0 * s / fields_["cpu_wall_s"] if fields_["cpu_wall_s"] else None
        rows.append(
            (
                load,
                name,
                f"{s:.2f}",
                "-" if per_tok is None else f"{1000 * per_tok:.2f}",
                "-" if pct is None else f"{pct:.1f}",
            )
        )
    return rows


def router_goal_line(load: str, pct: float | None) -> str:
    """One line: the router's % of a core per 100 output tok/s against the goal."""
    if pct is None:
        return f"router {load}: no output tokens, no figure"
    verdict = "meets" if pct < ROUTER_GOAL_PCT else "misses"
    return f"router {load}: {pct:.1f}% of one core per 100 output tok/s ({verdict} the < {ROUTER_GOAL_PCT:g}% goal)"
