"""Worker control ports, held by the launcher for as long as the launch runs.

The launcher binds and listens on every local worker's control port before it starts any worker
(a busy port fails the launch at once, naming the port and ``--base-port``), passes each listening
socket to its worker (``--listen-fd``: ZMQ serves on it through ``ZMQ_USE_FD``) and keeps its own
copy open. A port therefore stays this launch's while its worker is restarting: another launch
on the same host can never take it in the gap (where it could, the worker's restart found the port
taken and restarted again, endlessly).
Connections that arrive while no worker runs wait in the kernel's backlog for the next process.
"""

from __future__ import annotations

import contextlib
import errno
import socket

from configs.schema import PdserveConfig
from server.launch.roles import bind_addr
from server.router.registry import WorkerSpec

__all__ = ["PortUnavailable", "host_port", "listen", "reserve_worker_ports", "suggest_base_port"]

_BACKLOG = 128


class PortUnavailable(RuntimeError):
    """A worker control port cannot be bound; the message names it and the flag to change."""


def host_port(addr: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` or ``tcp://[V6]:PORT`` -> (host, port)."""
    rest = addr.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening; ``OSError`` if the port is taken.

    ``SO_REUSEADDR`` only skips connections of an earlier run in TIME_WAIT: on Linux two listening
    sockets still cannot share a port without ``SO_REUSEPORT``, which is never set here."""
    wildcard = host in ("*", "")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0" if wildcard else host, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def suggest_base_port(host: str, count: int, start: int, tries: int = 200) -> int | None:
    """A base port from ``start`` on whose ``count`` consecutive ports can all be bound now, or None."""
    base = start
    while base + count - 1 <= 65535 and tries > 0:
        held = []
        try:
            for port in range(base, base + count):
                held.append(listen(host, port))
            return base
        except OSError:
            base, tries = base + len(held) + 1, tries - 1
        finally:
            for s in held:
                s.close()
    return None


def reserve_worker_ports(specs: list[WorkerSpec], cfg: PdserveConfig) -> dict[str, socket.socket]:
    """Listening sockets for these workers' control ports, by worker id (caller closes them).

    Raises ``PortUnavailable`` (nothing left bound) naming the first busy port, the worker, the
    ports this launch needs and a ``--base-port`` that is free for all of them right now."""
    held: dict[str, socket.socket] = {}
    for spec in specs:
        host, port = host_port(bind_addr(spec, cfg))
        try:
            held[spec.worker_id] = listen(host, port)
        except OSError as e:
            for s in held.values():
                s.close()
            raise PortUnavailable(_busy_message(spec, host, port, e, specs, cfg)) from None
    return held


def _busy_message(
    spec: WorkerSpec, host: str, port: int, e: OSError, specs: list[WorkerSpec], cfg: PdserveConfig
) -> str:
    ports = sorted(host_port(s.addr)[1] for s in specs)
    span = f"{ports[0]}-{ports[-1]}" if len(ports) > 1 else str(ports[0])
    why = e.strerror or str(e)
    if e.errno == errno.EADDRINUSE:
        why += " (another pdserve launch or program on this host listens there)"
    msg = (
        f"cannot bind worker {spec.worker_id} ({spec.role}) control port {host}:{port}: {why}; this launch's "
        f"workers need ports {span} (--base-port {cfg.cluster.base_port}): choose another --base-port"
    )
    with contextlib.suppress(OSError):
        free = suggest_base_port(host, ports[-1] - cfg.cluster.base_port + 1, ports[-1] + 1)
        if free is not None:
            msg += f", e.g. --base-port {free} (free now)"
    return msg
