"""``--discovery`` values: ``etcd://HOST:PORT[/prefix]`` or ``dns://NAME:PORT``.

``parse_discovery`` turns the flag into an ``EtcdTarget`` or a ``DnsTarget`` and refuses anything
else with a message naming the accepted forms. ``WorkerRecord`` is what a worker registers under
``{prefix}workers/{worker_id}`` in etcd (JSON, with a version).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

from transfer.wire.enums import ALL_WORKER_ROLES, Role

RECORD_VERSION = 1
DEFAULT_ETCD_PREFIX = "/pdserve/"
FORMS = (
    "etcd://HOST:PORT[/prefix] (workers register, routers watch) or dns://NAME:PORT[?role=decode] (a "
    "headless Service: every A/AAAA record is a worker)"
)


class DiscoveryError(ValueError):
    """A ``--discovery`` value that is not one of the accepted forms (the message says which)."""


@dataclass(frozen=True)
class EtcdTarget:
    """An etcd v3 JSON gateway (``base_url``: http://HOST:PORT) and the key prefix of this cluster."""

    base_url: str
    prefix: str

    @property
    def workers_prefix(self) -> str:
        """The prefix every worker key has."""
        return f"{self.prefix}workers/"

    def key(self, worker_id: str) -> str:
        """The key worker ``worker_id`` registers under."""
        return f"{self.workers_prefix}{worker_id}"

    def __str__(self) -> str:
        return f"etcd://{self.base_url.removeprefix('http://')}{self.prefix}"


@dataclass(frozen=True)
class DnsTarget:
    """A DNS name whose A/AAAA records are the workers of ``role``, each listening on ``port``."""

    name: str
    port: int
    role: Role

    def __str__(self) -> str:
        return f"dns://{self.name}:{self.port}?role={self.role}"


class WorkerRecord(BaseModel):
    """A worker's registration: who it is and where routers and peers reach it (``addr``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int = RECORD_VERSION
    worker_id: str
    role: Role
    model: str
    cluster_id: str = ""
    addr: str  # the advertised control address (what routers connect to)
    bind_addr: str = ""  # the address its control socket is bound to (for operators)


def _dns_role(name: str, query: str) -> Role:
    """``?role=R`` when given, else the first label of the name when it is a role (decode.ns.svc)."""
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == "role":
            if value not in ALL_WORKER_ROLES:
                raise DiscoveryError(f"dns discovery: role {value!r} is not prefill, decode or colocated")
            return Role(value)
    first = name.split(".", 1)[0]
    for role in (Role.PREFILL, Role.DECODE, Role.COLOCATED):
        if first == role or first.startswith(f"{role}-") or first.endswith(f"-{role}"):
            return role
    raise DiscoveryError(f"dns discovery: cannot tell the role of {name!r}; add ?role=prefill|decode|colocated")


def parse_targets(text: str) -> list[EtcdTarget | DnsTarget]:
    """Every target of a comma-separated ``--discovery`` value; ``DiscoveryError`` if one is bad."""
    targets = [parse_discovery(t.strip()) for t in text.split(",") if t.strip()]
    if not targets:
        raise DiscoveryError(f"--discovery {text!r}: expected {FORMS}")
    return targets


def parse_discovery(text: str) -> EtcdTarget | DnsTarget:
    """The target of a ``--discovery`` value; ``DiscoveryError`` naming the accepted forms."""
    parts = urlsplit(text)
    if parts.scheme not in ("etcd", "dns") or not parts.hostname or parts.port is None:
        raise DiscoveryError(f"--discovery {text!r}: expected {FORMS}")
    if parts.scheme == "etcd":
        prefix = parts.path or DEFAULT_ETCD_PREFIX
        prefix = prefix if prefix.endswith("/") else prefix + "/"
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return EtcdTarget(f"http://{host}:{parts.port}", prefix)
    return DnsTarget(parts.hostname, parts.port, _dns_role(parts.hostname, parts.query))
