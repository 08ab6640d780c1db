"""Worker series as a scraper of the router reads them, for in-process tests: ``scrape`` runs
schedulers' stats through the router's ``WorkerCollector`` and the Prometheus text format; ``val``
sums the samples of one series whose labels match."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.router.metrics import WorkerCollector
from server.router.registry import READY, WorkerHandle, WorkerSpec
from server.worker.core_lending import CoreLending
from server.worker.loop import worker_stats


def scrape(*scheds, cores: dict[int, CoreLending] | None = None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} as a scraper of the router reads ``scheds``' stats
    (scheduler ``i`` with core lending ``cores[i]``, if given)."""
    handles = []
    for i, s in enumerate(scheds):
        h = WorkerHandle(WorkerSpec(f"w{i}", s.role, "inproc://x"), None, state=READY, stats_at=100.0)
        h.stats = worker_stats(s, f"w{i}", "inst", "m", cores=(cores or {}).get(i))
        handles.append(h)
    reg = CollectorRegistry()
    reg.register(WorkerCollector(lambda: handles, clock=lambda: 102.5))
    fams = text_string_to_metric_families(generate_latest(reg).decode())
    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in fams for x in f.samples}


def val(m: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))
