"""The one KV transport factory: backend name -> transport object.

It lives apart from ``transfer/kv_transport.py`` (the interface) so that the interface imports no
backend and the backends import only the interface: ``kv_transport`` <- backends <- ``factory``.
The backends are still imported lazily, so a process loads only the data plane it uses (NIXL and
ucxx pull in native libraries).
"""

from __future__ import annotations

from transfer.kv_transport import KVTransport
from transfer.notif_seal import seal_for

BACKENDS = ("nixl", "ucxx", "loopback")


def create_transport(kind: str, name: str, cluster=None, **kwargs) -> KVTransport:
    """The one transport factory: ``"nixl"`` -> ``NixlTransport``, ``"ucxx"`` -> ``UcxxTransport``,
    ``"loopback"`` -> ``LoopbackTransport`` (one process only).

    ``cluster`` (a ``configs.schema.ClusterConfig``, optional) supplies the backend's settings
    from the config: for ucxx ``ucxx_error_handling`` and, as the write deadline, the peer lease
    ``peer_timeout_s``. Explicit ``kwargs`` win over it. An unknown ``kind`` raises ``ValueError``.

    With a cluster key (``cluster.cluster_key`` or ``PDSERVE_CLUSTER_SECRET_KEY``) the transport
    seals the notifications it sends and drops received ones whose seal does not verify
    (``transfer.notif_seal``)."""
    transport = _backend(kind, name, cluster, **kwargs)
    if cluster is not None:
        transport.use_seal(seal_for(cluster.cluster_key))
    return transport


def migration_options(kind: str, cluster) -> dict:
    """Options of a decode worker's migration transport (it writes retracted KV from the host pool
    to a peer): for NIXL, ``copy_threads`` = ``cluster.migration_copy_threads``; none otherwise."""
    if kind == "nixl" and cluster is not None:
        return {"copy_threads": cluster.migration_copy_threads}
    return {}


def receive_options(kind: str, cluster) -> dict:
    """Options of a decode worker's main transport (it receives prompts' KV and migrations): for
    ucxx, ``copy_lanes`` = ``cluster.ucxx_copy_lanes``; none otherwise (a NIXL write is copied by
    its initiator)."""
    if kind == "ucxx" and cluster is not None:
        return {"copy_lanes": cluster.ucxx_copy_lanes}
    return {}


def _backend(kind: str, name: str, cluster, **kwargs) -> KVTransport:
    if kind == "nixl":
        from transfer.nixl_transport import NixlTransport

        return NixlTransport(name, **kwargs)
    if kind == "ucxx":
        from transfer.ucxx_transport import UcxxTransport

        if cluster is not None:
            kwargs.setdefault("error_handling", cluster.ucxx_error_handling)
            kwargs.setdefault("write_timeout_s", cluster.peer_timeout_s)
        return UcxxTransport(name, **kwargs)
    if kind == "loopback":
        from transfer.loopback import LoopbackTransport

        return LoopbackTransport(name, **kwargs)
    raise ValueError(f"unknown transport {kind!r} (expected one of {', '.join(BACKENDS)})")
