"""An HMAC seal on KV transfer notifications, keyed from the cluster key.

The data plane (NIXL or ucxx over UCX) has no authentication of its own: its completion
notification (the ``TransferManifest`` JSON a decode worker acts on) carries only a CRC, which
anyone can compute. With a cluster key, every transport of the deployment seals each notification
it sends with HMAC-SHA256 under a key derived from the cluster's secret key, bound to the sender's
transport name, and drops every notification whose seal does not verify (a peer without the
cluster key cannot forge a completion, nor replay one under another sender's name). Without a
cluster key (``--insecure-control-plane``) notifications travel as before.

Sealed notification: ``MAGIC`` (4 bytes) | HMAC-SHA256 tag in hex (64 ASCII bytes: NIXL carries
notifications as strings) | the notification. The tag covers ``sender name (UTF-8) | 0x00 |
notification``.

What it does not do: the seal authenticates the notification, not the KV bytes (hashing every page
would cost a pass over the KV); it does not hide anything (UCX does not encrypt); it does not
stop a peer that reaches the UCX port from writing pool pages (``docs/deploy/security.md``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping

from transfer.cluster_key import ClusterKey, read_key_file
from transfer.control_auth import ENV_SECRET

log = logging.getLogger(__name__)

MAGIC = b"PDS1"
TAG_CHARS = 64
_LABEL = b"pdserve kv notification seal v1"


class NotifSeal:
    """Seals and opens notifications under one key (``for_key`` derives it from a cluster key)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError(f"a notification seal key has at least 16 bytes, got {len(key)}")
        self._key = key
        self.refused = 0  # notifications dropped by ``open`` (forged, unsealed or cut short)

    @classmethod
    def for_key(cls, key: ClusterKey) -> NotifSeal:
        """The seal of a deployment: HMAC-SHA256(secret key, label), the same on every holder."""
        return cls(hmac.new(key.secret, _LABEL, hashlib.sha256).digest())

    def _tag(self, sender: str, notif: bytes) -> bytes:
        return hmac.new(self._key, sender.encode() + b"\0" + notif, hashlib.sha256).hexdigest().encode()

    def seal(self, sender: str, notif: bytes) -> bytes:
        """``notif`` as transport ``sender`` sends it: magic, tag, notification."""
        return MAGIC + self._tag(sender, notif) + notif

    def open(self, sender: str, sealed: bytes) -> bytes | None:
        """The notification inside ``sealed`` when its seal verifies for ``sender``; else None
        (counted in ``refused`` and logged)."""
        head = len(MAGIC) + TAG_CHARS
        if len(sealed) >= head and sealed[: len(MAGIC)] == MAGIC:
            notif = sealed[head:]
            if hmac.compare_digest(sealed[len(MAGIC) : head], self._tag(sender, notif)):
                return notif
            why = "its seal does not verify (another cluster key, or forged)"
        else:
            why = "it is not sealed (a peer without the cluster key, or --insecure-control-plane)"
        self.refused += 1
        log.error("dropped a KV transfer notification claiming to come from %r: %s", sender, why)
        return None


def seal_for(cluster_key_file: str | None, environ: Mapping[str, str] | None = None) -> NotifSeal | None:
    """The seal of the cluster key this process runs with (``--cluster-key FILE`` or
    ``PDSERVE_CLUSTER_SECRET_KEY``, as ``transfer.control_auth.resolve_auth`` reads them), or None
    without one. A key that cannot be read raises ``ClusterKeyError`` (the worker has already
    refused to start over it)."""
    environ = os.environ if environ is None else environ
    if cluster_key_file:
        return NotifSeal.for_key(read_key_file(cluster_key_file))
    if secret := environ.get(ENV_SECRET):
        return NotifSeal.for_key(ClusterKey.from_secret(secret, ENV_SECRET))
    return None
