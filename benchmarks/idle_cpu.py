"""Idle CPU of a launched server: % of one core used by the launcher/router and each worker while
no request is in flight (goal: < 2% each).

``python -m benchmarks.idle_cpu [--mode pd|colocated] [--seconds 20] [-- extra launch flags]``
CPU time is read from ``/proc/<pid>/stat`` (utime + stime), so the figure does not depend on how
busy the rest of the machine is.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.harness.subprocess_server import LaunchedServer, free_base_port

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _name(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"--worker-id" in argv:
        return argv[argv.index(b"--worker-id") + 1].decode()
    return "launcher+router"


def measure_idle(mode: str, seconds: float, settle_s: float, extra: list[str]) -> dict[str, float]:
    """% of a core per process of a ``pdserve launch --mode mode`` left idle for ``seconds``."""
    args = ["--mode", mode, "--port", "0", "--base-port", str(free_base_port(8)), *extra]
    with LaunchedServer(args) as srv:
        time.sleep(settle_s)  # start-up work (model load, warm-up) is not idle time
        pids = [srv.proc.pid, *srv.worker_pids()]
        before, t0 = {p: cpu_seconds(p) for p in pids}, time.monotonic()
        time.sleep(seconds)
        after, dt = {p: cpu_seconds(p) for p in pids}, time.monotonic() - t0
        return {_name(p): 100.0 * (after[p] - before[p]) / dt for p in pids}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.idle_cpu", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["pd", "colocated"], default="pd")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    p.add_argument("extra", nargs="*", help="more `pdserve launch` flags (after --)")
    args = p.parse_args(argv)
    usage = measure_idle(args.mode, args.seconds, args.settle_s, args.extra)
    print(f"idle CPU over {args.seconds:g}s, {args.mode} mode (% of one core):")
    for name, pct in usage.items():
        print(f"  {name:>16}: {pct:5.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
