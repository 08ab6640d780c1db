"""The router's index of what each worker's radix cache holds, fed by the workers' KV event feeds.

Per worker (the router's id for it): the set of chained page hashes (``cache.page_hash``) its tree
holds, the worker process (``instance``) and the feed sequence number last applied. A worker's
state is ``synced`` once a ``KvSnapshot`` of its current process was applied and no message was
missed since; until then it answers 0 cached pages and the subscriber asks for a snapshot.

Rules (``apply_events`` / ``apply_snapshot``):

* a message of another process than the one known resets the worker (a restart): not synced;
* a snapshot replaces the worker's set and its ``seq``;
* events with ``seq == last + 1`` are applied; ``seq <= last`` (already covered by a snapshot) are
  ignored; a larger ``seq`` is a gap: the set is dropped, not synced, until the next snapshot;
* a heartbeat reporting a later ``seq`` than the index reached, still unmatched a while later
  (the subscriber's grace), means the last messages were lost (a gap no later message showed):
  ``mark_lost``;
* events while not synced are ignored (the snapshot that comes later covers them: it travels on
  the same feed, after them).

``cached_pages(worker, hashes)`` is the number of leading hashes of a request's pages the worker
holds (the longest cached prefix, in pages). Memory is bounded: at most ``max_pages`` hashes per
worker (the oldest stored go first when a worker reports more, which only makes the index answer
shorter prefixes than the worker holds, never longer). Not thread safe: the event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_PAGES = 1 << 20  # per worker: 1M hashes is ~100 MB of Python dict at worst


@dataclass
class WorkerCache:
    """What one worker holds, as far as its feed told (see the module docstring)."""

    instance: str = ""
    seq: int = 0
    synced: bool = False
    hashes: OrderedDict[int, None] = field(default_factory=OrderedDict)


@dataclass
class IndexCounters:
    """Cumulative counts of what the index applied (for the router's metrics)."""

    events: int = 0  # KvEvents messages applied
    snapshots: int = 0  # KvSnapshot messages applied (re-syncs)
    gaps: int = 0  # sequence gaps and new processes seen (each needs a re-sync)
    dropped: int = 0  # hashes dropped over ``max_pages``


class KvIndex:
    """Per-worker page-hash sets (see the module docstring)."""

    def __init__(self, max_pages: int = DEFAULT_MAX_PAGES) -> None:
        if max_pages <= 0:
            raise ValueError(f"max_pages must be positive, got {max_pages}")
        self.max_pages = max_pages
        self.workers: dict[str, WorkerCache] = {}
        self.counters = IndexCounters()

    def _entry(self, worker_id: str, instance: str) -> WorkerCache:
        w = self.workers.setdefault(worker_id, WorkerCache(instance=instance))
        if w.instance != instance:
            self.counters.gaps += w.synced
            w.instance, w.seq, w.synced = instance, 0, False
            w.hashes.clear()
        return w

    def apply_snapshot(self, worker_id: str, instance: str, seq: int, hashes: Sequence[int]) -> None:
        """Replace what ``worker_id`` holds with ``hashes`` as of feed message ``seq``."""
        w = self._entry(worker_id, instance)
        w.hashes = OrderedDict.fromkeys(hashes)
        w.seq, w.synced = seq, True
        self.counters.snapshots += 1
        self._bound(w)

    def apply_events(
        self, worker_id: str, instance: str, seq: int, events: Sequence[tuple[str, Sequence[int]]]
    ) -> bool:
        """Apply one ``KvEvents`` message; False when the worker needs a snapshot (not synced, a
        new process, or a gap), True when it is in sync after this message."""
        w = self._entry(worker_id, instance)
        if not w.synced:
            return False
        if seq <= w.seq:
            return True
        if seq != w.seq + 1:
            w.synced = False
            w.hashes.clear()
            self.counters.gaps += 1
            return False
        for kind, hashes in events:
            if kind == "stored":
                w.hashes.update(dict.fromkeys(hashes))
            elif kind == "removed":
                for h in hashes:
                    w.hashes.pop(h, None)
            elif kind == "cleared":
                w.hashes.clear()
        w.seq = seq
        self.counters.events += 1
        self._bound(w)
        return True

    def _bound(self, w: WorkerCache) -> None:
        while len(w.hashes) > self.max_pages:
            w.hashes.popitem(last=False)
            self.counters.dropped += 1

    def observe_instance(self, worker_id: str, instance: str) -> bool:
        """The worker's heartbeat names its process: True when that is a new process of a worker
        the index knew (its set is dropped, not synced, until a snapshot of the new process)."""
        known = self.workers.get(worker_id)
        restarted = known is not None and bool(known.instance) and known.instance != instance
        self._entry(worker_id, instance)
        return restarted

    def mark_lost(self, worker_id: str) -> None:
        """The worker's feed went further than this index saw (its heartbeat reported a later
        ``seq`` and no message came): drop its set, not synced, until the next snapshot."""
        w = self.workers.get(worker_id)
        if w is not None and w.synced:
            w.synced = False
            w.hashes.clear()
            self.counters.gaps += 1

    def seq(self, worker_id: str) -> int:
        """The last feed message number applied for ``worker_id`` (0 when none)."""
        w = self.workers.get(worker_id)
        return w.seq if w is not None else 0

    def needs_snapshot(self, worker_id: str) -> bool:
        """True unless a snapshot of the worker's current process was applied with no gap since."""
        w = self.workers.get(worker_id)
        return w is None or not w.synced

    def cached_pages(self, worker_id: str, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the worker holds (0 when not synced or unknown)."""
        w = self.workers.get(worker_id)
        if w is None or not w.synced:
            return 0
        n = 0
        for h in hashes:
            if h not in w.hashes:
                break
            n += 1
        return n

    def held(self, worker_id: str) -> frozenset[int]:
        """Every hash the index holds for ``worker_id`` (tests compare it with the worker's tree)."""
        w = self.workers.get(worker_id)
        return frozenset(w.hashes) if w is not None else frozenset()

    def size(self, worker_id: str) -> int:
        """Hashes held for ``worker_id``."""
        w = self.workers.get(worker_id)
        return len(w.hashes) if w is not None else 0

    def forget(self, worker_id: str) -> None:
        """Drop a worker that left."""
        self.workers.pop(worker_id, None)
