"""A worker's registration in etcd: its ``WorkerRecord`` under a lease it keeps alive.

A thread grants a lease (``lease_s``), puts the record attached to it and renews the lease every
third of its TTL. If etcd goes away the thread keeps trying; when it answers again the worker
registers anew (a new lease; the key is simply overwritten), so a router that resynchronises finds
it. ``leave()`` (the worker starts draining) revokes the lease, which deletes the key at once:
routers stop routing to the worker while it finishes what it holds. A worker that dies without
leaving disappears when its lease runs out.
"""

from __future__ import annotations

import logging
import threading

from server.discovery.etcd import EtcdClient, EtcdError
from server.discovery.target import EtcdTarget, WorkerRecord

log = logging.getLogger(__name__)


class EtcdRegistration:
    """Keeps ``record`` registered at ``target`` while the worker serves (see the module docstring)."""

    def __init__(self, target: EtcdTarget, record: WorkerRecord, lease_s: float = 10.0) -> None:
        self.target, self.record = target, record
        self.ttl = max(2, round(lease_s))
        self.client = EtcdClient(target.base_url)
        self.lease: int | None = None
        self.registered = threading.Event()  # set while the key is known to be in etcd
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="etcd-registration", daemon=True)

    def start(self) -> None:
        """Register and keep the lease alive on a thread."""
        self._thread.start()

    def _run(self) -> None:
        outage = None
        while not self._stop.is_set():
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._renew()
                if outage is not None:
                    log.warning("etcd at %s is back: registered again as %s", self.target, self.record.worker_id)
                outage = None
            except EtcdError as e:
                self.lease = None
                self.registered.clear()
                if outage is None:
                    log.error("discovery: %s; keeps trying every %.1fs", e, self.ttl / 3)
                outage = str(e)
            self._stop.wait(self.ttl / 3)

    def _renew(self) -> None:
        if self.lease is not None and self.client.keepalive(self.lease) > 0:
            return
        self.lease = self.client.grant(self.ttl)
        self.client.put(self.target.key(self.record.worker_id), self.record.model_dump_json(), self.lease)
        self.registered.set()
        log.info(
            "registered in %s as %s (%s) at %s, lease %ds",
            self.target,
            self.record.worker_id,
            self.record.role,
            self.record.addr,
            self.ttl,
        )

    def leave(self) -> None:
        """Stop renewing and delete the key now (revoke the lease); best effort, idempotent."""
        self._stop.set()
        with self._lock:
            lease, self.lease = self.lease, None
            self.registered.clear()
            if lease is None:
                return
            try:
                self.client.revoke(lease)
                log.warning("left discovery (%s): key %s deleted", self.target, self.target.key(self.record.worker_id))
            except EtcdError as e:
                log.error("could not leave discovery (the key goes when the lease ends, in %ds): %s", self.ttl, e)

    def close(self) -> None:
        """Leave, stop the thread, close the HTTP client."""
        self.leave()
        if self._thread.is_alive():
            self._thread.join(5)
        self.client.close()
