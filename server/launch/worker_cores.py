"""How a launch's workers use this host's cores: core lending's ledger and arguments, and the
planner's view of it (``server.planner_cores``)."""

from __future__ import annotations

import logging
import os

from configs.schema import PdserveConfig
from server.router.registry import WorkerSpec
from server.worker.core_lending import CoreLedger, borrows
from server.worker.placement import Placement

log = logging.getLogger("pdserve.launch")


def core_lending(mode: str, local: list[WorkerSpec], plan: Placement) -> tuple[int, dict[str, list[str]]] | None:
    """(ledger memfd, extra argv per worker id) when this launch's workers lend each other idle
    cores (``cluster.core_lending`` ``mode``: unpinned workers that share the host's threads), else None."""
    total = len(os.sched_getaffinity(0))
    if mode == "off" or plan.workers or not plan.threads or total <= plan.threads:
        return None
    _, fd = CoreLedger.create(len(local))
    extra = {}
    for slot, spec in enumerate(local):
        lend = ["--lend-threads", str(total)] if borrows(mode, spec.role) else []
        extra[spec.worker_id] = ["--core-ledger-fd", str(fd), "--core-slot", str(slot), *lend]
    names = [s.worker_id for s in local if borrows(mode, s.role)]
    log.info("core lending: %s run on all %d cores while the other workers are idle", ", ".join(names) or "none", total)
    return fd, extra


def with_planner_cores(cfg: PdserveConfig, shared: bool) -> PdserveConfig:
    """``cfg`` with ``server.planner_cores`` ``auto`` resolved: ``shared`` when this launch's workers
    lend each other cores (``shared``: a move then adds no compute to a role), else ``own``."""
    if cfg.server.planner_cores != "auto":
        return cfg
    server = cfg.server.model_copy(update={"planner_cores": "shared" if shared else "own"})
    return cfg.model_copy(update={"server": server})
