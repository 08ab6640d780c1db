"""``pdserve probe``: readiness of the pdserve process on this host, for container health checks.

A target is ``http://HOST:PORT`` (a router or launcher: ready when ``GET /health`` answers 200) or
``tcp://HOST:PORT`` (a worker's control socket: ready when it answers a ``StatsRequest`` with a
``WorkerStats`` that says ``ready``). Without a target the probe reads the command line of PID 1
(the container's main process, ``pdserve worker ...`` / ``pdserve router ...`` / ``pdserve
launch ...``) and derives the target from it with the real argument parser and config loader, so
one image's ``HEALTHCHECK`` fits every role. Exit code 0 = ready, 1 = not ready (the reason on
stderr), 2 = no target could be derived.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import zmq

_WILDCARD = {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
# The probe speaks the two control messages it needs itself: ``transfer.protocol`` imports torch
# (through ``engine.sampling``), seconds of CPU per probe, and a health check runs every few
# seconds in every container. tests/test_roles_probe.py checks these frames against that module.
PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class WorkerStatus:
    """The fields of a worker's ``WorkerStats`` reply that readiness needs."""

    worker_id: str
    role: str
    model: str
    capacity_tokens: int
    ready: bool


class ProbeError(RuntimeError):
    """The target is not ready; the message says why."""


def local(addr: str) -> str:
    """``tcp://0.0.0.0:29500`` -> ``tcp://127.0.0.1:29500`` (a bind address as seen from this host)."""
    scheme, rest = addr.split("://", 1)
    host, _, port = rest.rpartition(":")
    host = _WILDCARD.get(host.strip("[]"), host.strip("[]"))
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def stats_request(nonce: int) -> list[bytes]:
    """The frames of a ``StatsRequest``."""
    return [b"StatsRequest", json.dumps({"version": PROTOCOL_VERSION, "nonce": nonce}).encode()]


def parse_stats(addr: str, parts: list[bytes]) -> WorkerStatus:
    """A ``WorkerStats`` reply's status; ``ProbeError`` for anything else."""
    if len(parts) < 2 or parts[0] != b"WorkerStats":
        kind = parts[0][:40] if parts else b""
        raise ProbeError(f"worker at {addr}: answered {kind!r}, not WorkerStats")
    try:
        h = json.loads(parts[1])
        if h.get("version") != PROTOCOL_VERSION:
            raise ProbeError(f"worker at {addr}: protocol version {h.get('version')!r}, the probe speaks "
                             f"{PROTOCOL_VERSION}")
        return WorkerStatus(str(h["worker_id"]), str(h["role"]), str(h["model"]), int(h["capacity_tokens"]),
                            bool(h.get("ready", True)))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ProbeError(f"worker at {addr}: bad WorkerStats: {e!r}") from None


def probe_worker(addr: str, timeout_s: float) -> WorkerStatus:
    """The worker's status; ``ProbeError`` if it is silent or not ready."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send_multipart(stats_request(1))
        if not sock.poll(int(timeout_s * 1000)):
            raise ProbeError(f"worker at {addr}: no answer in {timeout_s:g}s")
        status = parse_stats(addr, sock.recv_multipart())
        if not status.ready:
            raise ProbeError(f"worker {status.worker_id} at {addr}: not ready yet")
        return status
    finally:
        sock.close(0)
        ctx.term()


def probe_http(url: str, timeout_s: float) -> str:
    """The body of ``GET url/health`` when it is 200; ``ProbeError`` otherwise."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as e:
        raise ProbeError(f"{url}/health: {e}") from None
    if r.status_code != 200:
        raise ProbeError(f"{url}/health answered {r.status_code}: {r.text[:300]}")
    return r.text


def target_from_argv(argv: list[str]) -> str:
    """The probe target of a ``pdserve`` command line (``argv`` without the program name)."""
    from server.cli import _load_config, build_parser

    args = build_parser().parse_args(argv)
    if args.command == "worker":
        return local(args.control_addr)
    if args.command in ("router", "launch"):
        cfg = _load_config(args, args.command)
        if cfg is None:
            raise ValueError("the main process's configuration is invalid")
        return local(f"http://{cfg.server.host}:{cfg.server.port}")
    raise ValueError(f"'pdserve {args.command}' serves nothing to probe")


def pid1_argv(path: str = "/proc/1/cmdline") -> list[str]:
    """PID 1's arguments after the ``pdserve`` program (or ``-m server.cli``)."""
    parts = [p.decode() for p in Path(path).read_bytes().split(b"\0") if p]
    for i, p in enumerate(parts):
        if p.endswith("pdserve") or p == "server.cli":
            return parts[i + 1:]
    raise ValueError(f"PID 1 is not a pdserve process: {' '.join(parts)[:200]}")


def probe(target: str, timeout_s: float) -> str:
    """Probe ``target``; returns a one-line description, raises ``ProbeError`` if not ready."""
    if target.startswith(("http://", "https://")):
        probe_http(target, timeout_s)
        return f"{target}: healthy"
    if target.startswith("tcp://"):
        s = probe_worker(target, timeout_s)
        return f"{s.role} worker {s.worker_id} at {target}: ready ({s.model}, {s.capacity_tokens} tokens)"
    raise ValueError(f"probe target {target!r}: expected http://HOST:PORT or tcp://HOST:PORT")


def main(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve probe``."""
    try:
        target = args.target or target_from_argv(pid1_argv())
        print(probe(target, args.timeout))
        return 0
    except ProbeError as e:
        print(f"pdserve probe: not ready: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, SystemExit) as e:
        print(f"pdserve probe: cannot derive a target ({e}); pass one, e.g. tcp://127.0.0.1:29500", file=sys.stderr)
        return 2
