"""Placement of one host's pdserve processes on its CPU cores.

Workers that share cores fight: two torch processes with a thread per core each on the same
cores both run slower than either alone. ``plan_placement`` gives each worker of a local launch
its own cores and, when cores are left over, the router too; a worker then pins itself
(``os.sched_setaffinity``) and runs torch with one thread per core it owns (``apply_cpus``).

``--worker-cpus`` (``cluster.worker_cpus``):
- ``off`` (default): pin nothing; every process may run on every core.
- ``auto``: split the cores this process may use evenly among the workers (the first workers in
  launch order get one core more when they do not divide); cores left over go to the router. With
  fewer cores than workers nothing is pinned.

Unpinned workers of one launch still share the cores' *threads*: each runs torch with
``max(1, cores // workers)`` threads (``Placement.threads``), unless ``OMP_NUM_THREADS`` is set.
Without that, two busy workers on 2 cores run 4 OpenMP threads whose barriers spin-wait on
descheduled peers: the 2-prefill + 2-decode retract workload of ``tests/deploy`` took 38-83 s
a round instead of 10-14 s. One worker alone keeps torch's default (every core). A share may
still grow for a step: see ``server.worker.core_lending`` (a prefill worker runs on every core while the
others are idle).

``auto`` is not the default yet: on a 2-core host it halves the prefill worker's compute, so under
an overcommitted decode admission (low ``new_token_ratio``) the decode pool fills with pages
reserved for transfers that wait on the slower prefill, and the last running request can hit the
out-of-memory abort (seen in tests/e2e/test_pd_http.py's 32-request test). It stays opt-in until the
serving benchmark shows where it pays.
- ``ID=CPUS,ID=CPUS``: explicit, e.g. ``prefill-0=0,decode-0=1`` or ``prefill-0=0-2,decode-0=3+5``
  (``a-b`` ranges and ``+`` lists); workers not named are not pinned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Placement:
    workers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    router: tuple[int, ...] = ()
    threads: int | None = None  # torch threads of each unpinned worker (None: torch's default)

    def describe(self) -> str:
        if not self.workers:
            shared = f", torch threads per worker: {self.threads}" if self.threads else ""
            return f"placement: not pinned (every process may use every core){shared}"
        parts = [f"{wid} -> cpus {_fmt(cpus)}" for wid, cpus in self.workers.items()]
        parts.append(f"router -> cpus {_fmt(self.router)}" if self.router else "router -> shares the workers' cores")
        return "placement: " + ", ".join(parts)


def _fmt(cpus: tuple[int, ...]) -> str:
    return ",".join(map(str, cpus))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-2+5"`` -> (0, 1, 2, 5); ``ValueError`` naming the bad part."""
    cpus: list[int] = []
    for part in text.split("+"):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"--worker-cpus: {text!r} is not a cpu list (use 0, 0-3 or 0+2)")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(cpus)))


def plan_placement(worker_ids: list[str], spec: str, cpus: list[int] | None = None) -> Placement:
    """Where each of ``worker_ids`` (launch order) and the router run; see the module docstring."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    n = len(worker_ids)
    unpinned = (
        Placement(threads=max(1, len(cpus) // n)) if n > 1 and "OMP_NUM_THREADS" not in os.environ else Placement()
    )
    if spec == "off":
        return unpinned
    if spec != "auto":
        return _explicit(worker_ids, spec, cpus)
    if n < 2 or len(cpus) < n:
        return unpinned
    share, extra = divmod(len(cpus) - (1 if len(cpus) > n else 0), n)
    out, pos = {}, 0
    for i, wid in enumerate(worker_ids):
        k = share + (1 if i < extra else 0)
        out[wid], pos = tuple(cpus[pos : pos + k]), pos + k
    return Placement(out, tuple(cpus[pos:]))


def _explicit(worker_ids: list[str], spec: str, cpus: list[int]) -> Placement:
    out: dict[str, tuple[int, ...]] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        wid, sep, text = entry.partition("=")
        if not sep or wid not in worker_ids:
            raise ValueError(f"--worker-cpus: {entry!r} should be ID=CPUS with ID one of {', '.join(worker_ids)}")
        out[wid] = parse_cpu_list(text)
        if missing := sorted(set(out[wid]) - set(cpus)):
            raise ValueError(
                f"--worker-cpus: {wid} asks for cpus {_fmt(tuple(missing))}, this host has {_fmt(tuple(cpus))}"
            )
    used = {c for v in out.values() for c in v}
    return Placement(out, tuple(c for c in cpus if c not in used) if out else ())


def apply_cpus(cpus: tuple[int, ...], threads: int | None = None) -> None:
    """Pin this process to ``cpus`` and give torch one thread per core; with no ``cpus``, give torch
    ``threads`` threads (None: leave both as they are)."""
    if not cpus and not threads:
        return
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus) or threads)
