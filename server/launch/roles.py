"""Which pdserve roles one ``pdserve launch`` runs on this host, where its workers listen, and the
command line that starts each.

Roles: ``router`` plus the worker roles of the cluster mode (``prefill`` and ``decode`` in PD mode,
``colocated`` in colocated mode). ``pdserve launch --roles decode`` on one host and
``pdserve launch --roles router,prefill --worker decode=decode-0=tcp://hostB:29501`` on another
split one deployment over two machines. Worker ids and control ports are the same on every host
(``prefill-i`` at ``base_port + i``, ``decode-j`` at ``base_port + prefill + j``, ``colocated-i``
at ``base_port + i``), so the ports a host uses follow from the shared config alone.
"""

from __future__ import annotations

import socket
import sys

from configs.schema import PdserveConfig, worker_pool_tokens
from server.router.registry import WorkerSpec
from transfer.wire.enums import ALL_WORKER_ROLES, Role

WORKER_ROLES = {"colocated": (Role.COLOCATED,), "pd": (Role.PREFILL, Role.DECODE)}
_WILDCARDS = ("0.0.0.0", "::", "*", "")


def parse_roles(text: str | None, mode: str) -> frozenset[Role]:
    """``"router,decode"`` -> {"router", "decode"}; None -> every role of ``mode``.

    Raises ``ValueError`` naming the roles ``mode`` allows when one is unknown or none is given.
    """
    allowed = (Role.ROUTER, *WORKER_ROLES[mode])
    if text is None:
        return frozenset(allowed)
    roles = {r.strip() for r in text.split(",") if r.strip()}
    bad = sorted(roles - set(allowed))
    if bad or not roles:
        raise ValueError(
            f"--roles {text!r}: {mode} mode runs {', '.join(allowed)} (comma-separated)"
            + (f"; unknown: {', '.join(bad)}" if bad else "")
        )
    return frozenset(Role(r) for r in roles)


def advertised_host(cfg: PdserveConfig) -> str:
    """The host part of this host's worker addresses as other hosts (and the router) use them."""
    c = cfg.cluster
    if c.advertise_host:
        return c.advertise_host
    return socket.gethostname() if c.worker_host in _WILDCARDS else c.worker_host


def _addr(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def worker_specs(cfg: PdserveConfig, roles: frozenset[Role] | None = None) -> list[WorkerSpec]:
    """The workers of ``cfg.cluster.mode`` with a role in ``roles`` (default: all of them).

    Addresses use :func:`advertised_host`; ports count up from ``base_port`` over every worker of
    the mode, so a subset keeps the ports the full deployment gives it.
    """
    c = cfg.cluster
    host = advertised_host(cfg)
    return [
        WorkerSpec(wid, Role(role), _addr(host, port))
        for port, (role, wid) in enumerate(c.workers(), c.base_port)
        if roles is None or role in roles
    ]


def worker_config(cfg: PdserveConfig, worker_id: str) -> PdserveConfig:
    """The config handed to one worker: the API key stays in the router (argv is world-readable), and
    its KV pool is ``worker_kv_pool_tokens``'s size for it where that names it."""
    engine = cfg.engine
    if (tokens := worker_pool_tokens(cfg.cluster.worker_kv_pool_tokens).get(worker_id)) is not None:
        engine = engine.model_copy(update={"kv_pool_tokens": tokens})
    return cfg.model_copy(update={"server": cfg.server.model_copy(update={"api_key": None}), "engine": engine})


def bind_addr(spec: WorkerSpec, cfg: PdserveConfig) -> str:
    """The address worker ``spec`` binds its control socket to (``worker_host``, same port)."""
    port = int(spec.addr.rsplit(":", 1)[1])
    return _addr(cfg.cluster.worker_host, port)


def parse_worker_spec(text: str) -> WorkerSpec:
    """``ROLE=ID=ADDR`` -> ``WorkerSpec``; ``ValueError`` with the expected form otherwise."""
    parts = text.split("=", 2)
    if len(parts) != 3 or parts[0] not in ALL_WORKER_ROLES or not parts[1] or not parts[2].startswith("tcp://"):
        raise ValueError(f"--worker {text!r}: expected ROLE=ID=tcp://HOST:PORT with ROLE colocated, prefill or decode")
    return WorkerSpec(parts[1], Role(parts[0]), parts[2])


def worker_argv(spec: WorkerSpec, cfg: PdserveConfig) -> list[str]:
    """Command line of one worker process."""
    return [
        sys.executable,
        "-m",
        "server.worker.main",
        "--role",
        spec.role,
        "--worker-id",
        spec.worker_id,
        "--control-addr",
        bind_addr(spec, cfg),
        "--advertise-addr",
        spec.addr,
        "--config-json",
        worker_config(cfg, spec.worker_id).model_dump_json(),
    ]
