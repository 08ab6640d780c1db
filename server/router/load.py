"""What the router routes by: each worker's load, blended from what the worker reports and what
this router sent it, and room numbers that no two routers share.

``BlendedLoad(worker_id)`` is a sort key, smaller is less loaded:
``(requests, KV used fraction, this router's tokens in flight)``. ``requests`` is this router's own
requests in flight on the worker now (exact) plus the other routers' as of the worker's last report:
what it reported holding (every ``queue_*`` gauge: queued, waiting for KV, running, retracted; all
routers' requests) less this router's own in flight when that report arrived
(``WorkerHandle.own_at_stats``), at least 0. Only the other routers' part is a heartbeat old: this
router's own requests that finished since the report no longer count (a report counts them until
the next one, up to a heartbeat period, which steered new requests away from the worker that just
finished some), and its own sends since the report count at once. With one router ``requests`` is
its own in-flight count. Ties go to the worker with more KV free.

``PrefillBacklog(worker_id)`` is the prompt work waiting on a worker, in uncached tokens: the
larger of what this router sent it and its cache did not hold at routing time, not yet computed
(``InflightTable.pending_prefill_tokens``: until the request's first token), and what the worker
reports waiting (gauges ``prefill_backlog_tokens`` of a prefill worker, ``local_prefill_backlog_tokens``
of a decode worker prefilling prompts itself; all routers' work, one heartbeat old). The larger,
not the sum: with one router both count the same requests.

``RoomAllocator``: a room is ``tag << 40 | n`` with ``n`` counting up from a random start; ``tag``
identifies the router (22 bits: random, or claimed in etcd so no two live routers share it), so two
routers never hand out the same room (a worker would refuse the second transfer).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass

from server.router.inflight import InflightTable
from server.router.workers import WorkerHandle

ROOM_COUNTER_BITS = 40
ROUTER_TAG_BITS = 22


@dataclass
class BlendedLoad:
    """The load sort key of each worker (see the module docstring)."""

    table: InflightTable
    handles: Mapping[str, WorkerHandle]

    def __call__(self, worker_id: str) -> tuple[float, float, int]:
        own = self.table.outstanding_requests(worker_id)
        h = self.handles.get(worker_id)
        if h is None or h.stats is None:
            return own, 0.0, self.table.outstanding(worker_id)
        g = h.stats.gauges
        others = max(0.0, sum(v for k, v in g.items() if k.startswith("queue_")) - h.own_at_stats)
        used = g.get("kv_pages_used", 0.0) / max(g.get("kv_pages_total", 0.0), 1.0)
        return own + others, round(used, 3), self.table.outstanding(worker_id)


REPORTED_BACKLOG_GAUGES = ("prefill_backlog_tokens", "local_prefill_backlog_tokens")


@dataclass
class PrefillBacklog:
    """Each worker's waiting prompt work in uncached tokens (see the module docstring)."""

    table: InflightTable
    handles: Mapping[str, WorkerHandle]

    def __call__(self, worker_id: str) -> int:
        own = self.table.pending_prefill_tokens(worker_id)
        h = self.handles.get(worker_id)
        if h is None or h.stats is None:
            return own
        return max(own, int(sum(h.stats.gauges.get(k, 0.0) for k in REPORTED_BACKLOG_GAUGES)))


class RoomAllocator:
    """Room numbers ``tag << 40 | n`` (see the module docstring)."""

    def __init__(self, tag: int | None = None) -> None:
        self.tag = random.randrange(1 << ROUTER_TAG_BITS) if tag is None else tag
        if not 0 <= self.tag < 1 << ROUTER_TAG_BITS:
            raise ValueError(f"router tag {self.tag} is not in [0, 2**{ROUTER_TAG_BITS})")
        # n starts at a random point so a restarted router with the same tag does not reuse a room soon
        self._n = itertools.count(random.randrange(1 << (ROOM_COUNTER_BITS - 1)))

    def next(self) -> int:
        """A room no other request of any router with another tag has (wraps after 2**39 rooms)."""
        return self.tag << ROOM_COUNTER_BITS | next(self._n) % (1 << ROOM_COUNTER_BITS)
