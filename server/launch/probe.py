"""``pdserve probe``: readiness of the pdserve process on this host, for container health checks.

A target is ``http://HOST:PORT`` (a router or launcher: ready when ``GET /health`` answers 200) or
``tcp://HOST:PORT`` (a worker's control socket: ready when it answers a ``StatsRequest`` with its
``WorkerStats``, which a worker only does once its model is loaded and it serves). Without a target
the probe reads the command line of PID 1 (the container's main process, ``pdserve worker ...`` /
``pdserve router ...`` / ``pdserve launch ...``) and derives the target from it with the real
argument parser and config loader, so one image's ``HEALTHCHECK`` fits every role. Exit code 0 =
ready, 1 = not ready (the reason on stderr), 2 = no target could be derived.

A worker's control socket takes only peers holding the cluster key: the probe uses
``--cluster-key FILE``, else the key PID 1 was given (its ``--cluster-key`` or ``PDSERVE_CLUSTER_KEY``,
through the same config loader), else ``PDSERVE_CLUSTER_SECRET_KEY``; with none it tries plain ZMTP,
and a worker that requires the key makes it fail with a message saying so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import zmq

from transfer.control_auth import ControlAuth, ControlAuthError, resolve_auth
from transfer.wire.protocol import ProtocolError, StatsRequest, WorkerStats, decode, encode

_WILDCARD = {"0.0.0.0": "127.0.0.1", "*": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class ProbeError(RuntimeError):
    """The target is not ready; the message says why."""


def local(addr: str) -> str:
    """``tcp://0.0.0.0:29500`` -> ``tcp://127.0.0.1:29500`` (a bind address as seen from this host)."""
    scheme, rest = addr.split("://", 1)
    host, _, port = rest.rpartition(":")
    host = _WILDCARD.get(host.strip("[]"), host.strip("[]"))
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def parse_stats(addr: str, parts: list[bytes]) -> WorkerStats:
    """A worker's ``WorkerStats`` reply; ``ProbeError`` for anything else."""
    try:
        msg, _ = decode(parts)
    except ProtocolError as e:
        raise ProbeError(f"worker at {addr}: {e}") from None
    if not isinstance(msg, WorkerStats):
        raise ProbeError(f"worker at {addr}: answered {type(msg).__name__}, not WorkerStats")
    return msg


def probe_worker(addr: str, timeout_s: float, auth: ControlAuth) -> WorkerStats:
    """The worker's stats (it answers them once it serves); ``ProbeError`` if it is silent (with the
    reason when the control handshake failed: another cluster key, or none)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        watch = auth.client(sock, "pdserve probe")
        sock.connect(addr)
        sock.send_multipart(encode(StatsRequest(nonce=1)))
        if not sock.poll(int(timeout_s * 1000)):
            why = f" ({watch.error})" if watch.error else ""
            raise ProbeError(f"worker at {addr}: no answer in {timeout_s:g}s{why}")
        return parse_stats(addr, sock.recv_multipart())
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


def key_from_argv(argv: list[str]) -> str | None:
    """The cluster key file a ``pdserve worker/router/launch`` command line (with this process's
    env) configures, or None."""
    from server.launch.args import load_config, parse_args

    args = parse_args(argv)
    if args.command not in ("worker", "router", "launch"):
        return None
    cfg = load_config(args, args.command)
    return cfg.cluster.cluster_key if cfg is not None else None


def probe_auth(key_file: str | None, argv: list[str] | None) -> ControlAuth:
    """The probe's ``ControlAuth``: ``key_file``, else PID 1's (``argv``), else the environment's;
    plain (insecure) when there is none."""
    if key_file is None and argv is not None:
        key_file = key_from_argv(argv)
    return resolve_auth(key_file, insecure=True)


def target_from_argv(argv: list[str]) -> str:
    """The probe target of a ``pdserve`` command line (``argv`` without the program name)."""
    from server.launch.args import load_config, parse_args

    args = parse_args(argv)
    if args.command == "worker":
        return local(args.control_addr)
    if args.command in ("router", "launch"):
        cfg = load_config(args, args.command)
        if cfg is None:
            raise ValueError("the main process's configuration is invalid")
        return local(f"http://{cfg.server.host}:{cfg.server.port}")
    raise ValueError(f"'pdserve {args.command}' serves nothing to probe")


def pid1_argv(path: str = "/proc/1/cmdline") -> list[str]:
    """PID 1's arguments after the ``pdserve`` program (or ``-m server.launch.cli``)."""
    parts = [p.decode() for p in Path(path).read_bytes().split(b"\0") if p]
    for i, p in enumerate(parts):
        if p.endswith("pdserve") or p == "server.launch.cli":
            return parts[i + 1 :]
    raise ValueError(f"PID 1 is not a pdserve process: {' '.join(parts)[:200]}")


def _own_pid1_argv() -> list[str] | None:
    """PID 1's ``pdserve`` arguments when it is a pdserve process whose command line parses, else None
    (a probe given its target still finds the key PID 1 was started with)."""
    try:
        argv = pid1_argv()
        key_from_argv(argv)
        return argv
    except (ValueError, OSError, SystemExit):
        return None


def probe(target: str, timeout_s: float, auth: ControlAuth) -> str:
    """Probe ``target`` (a worker with ``auth``); returns a one-line description, raises
    ``ProbeError`` if not ready."""
    if target.startswith(("http://", "https://")):
        probe_http(target, timeout_s)
        return f"{target}: healthy"
    if target.startswith("tcp://"):
        s = probe_worker(target, timeout_s, auth)
        return f"{s.role} worker {s.worker_id} at {target}: ready ({s.model}, {s.capacity_tokens} tokens)"
    raise ValueError(f"probe target {target!r}: expected http://HOST:PORT or tcp://HOST:PORT")


def main(args: argparse.Namespace) -> int:
    """Entry point of ``pdserve probe``."""
    try:
        argv = _own_pid1_argv() if args.target else pid1_argv()
        target = args.target or target_from_argv(argv)
        print(probe(target, args.timeout, probe_auth(args.cluster_key, argv)))
        return 0
    except ProbeError as e:
        print(f"pdserve probe: not ready: {e}", file=sys.stderr)
        return 1
    except ControlAuthError as e:
        print(f"pdserve probe: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, SystemExit) as e:
        print(f"pdserve probe: cannot derive a target ({e}); pass one, e.g. tcp://127.0.0.1:29500", file=sys.stderr)
        return 2
