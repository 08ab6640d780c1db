"""Where one PD request's time to first token goes, hop by hop, against colocated.

Launches each mode (``--modes pd,colocated``; ``--repo`` runs another checkout too, e.g. an older
main, for an A/B in one sitting) with ``--log-level DEBUG``, all at once, and sends ``--requests``
sequential streamed completions (round-robin over the servers, one at a time, so a change in the
machine's load hits them alike) of ``--prompt-len`` random token ids (a fresh prompt each, so no prefix cache
helps) with ``max_tokens`` ``--max-tokens``, and lines up the stamps of each request on one clock:
the client's (send, first byte), the router's (arrival, sent to the workers, first token received)
and every worker's milestones (``engine.scheduler.timeline``'s DEBUG line of monotonic stamps;
CLOCK_MONOTONIC is shared by every process of the machine). Prints, per server, the median of each
stamp after the client's send and of each hop between consecutive stamps, then the TTFT ratios.

    python -m benchmarks.handoff_trace --requests 20 --prompt-len 250 --max-tokens 1
    python -m benchmarks.handoff_trace --repo /work/wt-handoff-base   # this checkout vs that one
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.harness.subprocess_server import LaunchedServer
from bench.serve.servers import launch_argv

_MARKS = re.compile(
    r"(?:\[(?P<worker>[^\]]+)\] )?(?P<logger>[\w.]+): request (?P<rid>\S+) "
    r"marks \(monotonic s\): (?P<marks>.*)$"
)

# the hops reported, in request order: (who, milestone) -> label; absent ones are left out
HOPS = (
    ("client", "send", "client send"),
    ("router", "arrived", "router receive"),
    ("router", "sent", "router sent (tokenized, routed)"),
    ("decode", "arrived", "decode: request arrived"),
    ("prefill", "arrived", "prefill: request arrived"),
    ("decode", "reserved", "decode: pages reserved, KVDestination out"),
    ("prefill", "destination", "prefill: KVDestination in"),
    ("prefill", "admitted", "prefill: compute start"),
    ("colocated", "arrived", "colocated: request arrived"),
    ("colocated", "admitted", "colocated: compute start"),
    ("prefill", "prefilled", "prefill: compute end (first token)"),
    ("colocated", "prefilled", "colocated: compute end (first token)"),
    ("prefill", "write_start", "prefill: KV write posted"),
    ("decode", "write_posted", "decode: write announced"),
    ("prefill", "write_done", "prefill: KV write seen done"),
    ("decode", "landed", "decode: KV landed"),
    ("decode", "first_token", "decode: first token sent"),
    ("router", "first_token", "router: first token received"),
    ("client", "first_byte", "client: first byte"),
)


@dataclass
class Trace:
    """One request's stamps: ``(who, milestone) -> monotonic seconds``."""

    stamps: dict[tuple[str, str], float] = field(default_factory=dict)

    def relative(self) -> dict[tuple[str, str], float]:
        t0 = self.stamps[("client", "send")]
        return {k: v - t0 for k, v in self.stamps.items()}


def role_of(worker: str | None, logger: str) -> str:
    """``router`` for the router's line, else the worker's role from its logger (its id as fallback)."""
    if worker is None or logger.startswith("server.router"):
        return "router"
    for role in ("prefill", "decode", "colocated"):
        if worker.startswith(role):
            return role
    return "colocated"


def parse_marks(log_text: str) -> dict[str, dict[str, dict[str, float]]]:
    """``rid -> role -> milestone -> seconds`` from a server's DEBUG log."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for line in log_text.splitlines():
        m = _MARKS.search(line)
        if m is None:
            continue
        marks = dict(kv.split("=", 1) for kv in m.group("marks").split())
        role = role_of(m.group("worker"), m.group("logger"))
        out.setdefault(m.group("rid"), {})[role] = {k: float(v) for k, v in marks.items()}
    return out


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process used so far: ``label -> seconds``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for label, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[label] = (int(fields[11]) + int(fields[12])) / tick
    return out


def server_pids(srv: LaunchedServer) -> dict[str, int]:
    """``router`` (the launcher) and each worker by its ``--worker-id``."""
    pids = {"router": srv.pid}
    for pid in srv.worker_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "--worker-id" in argv:
            pids[argv[argv.index("--worker-id") + 1]] = pid
    return pids


def one_request(http: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(client send, first byte of a streamed chunk carrying a token) in monotonic seconds."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    first = None
    with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic()
    if first is None:
        raise RuntimeError("stream ended without a token")
    return t0, first


def line_up(spans: list[tuple[float, float]], log_text: str) -> list[Trace]:
    """One ``Trace`` per (client send, first byte): the stamps of the request the router received
    in that window (requests to one server are sequential, so the window names it)."""
    marks = parse_marks(log_text)
    router = [(rid, roles["router"]) for rid, roles in marks.items() if "router" in roles]
    traces = []
    for t0, first in spans:
        tr = Trace({("client", "send"): t0, ("client", "first_byte"): first})
        for rid, r in router:
            if t0 <= r["arrived"] <= first:
                for role, ms in marks[rid].items():
                    tr.stamps.update({(role, k): v for k, v in ms.items()})
        traces.append(tr)
    return traces


def run_all(servers: list[tuple[str, str, Path | None]], args) -> list[tuple[str, list[Trace]]]:
    """Launch every ``(label, mode, repo)`` at once, then send the sequential requests round-robin,
    one at a time (request i goes to every server before request i+1 goes to any), so a change
    of the machine's load hits every server alike; returns each server's lined-up traces and
    prints each process's CPU time per measured request (what polling costs shows there)."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.warmup + args.requests)]
    with contextlib.ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=300, trust_env=False))
        srvs = []
        for _label, mode, repo in servers:
            flags = launch_argv(mode, ["--log-level", "DEBUG", *args.server_args.split()])  # later flags win
            srvs.append(stack.enter_context(LaunchedServer(flags, repo=repo, startup_timeout_s=args.startup_timeout_s)))
        pids = [server_pids(srv) for srv in srvs]
        spans: list[list[tuple[float, float]]] = [[] for _ in srvs]
        cpu0: list[dict[str, float]] = [{} for _ in srvs]
        for i, prompt in enumerate(prompts):
            for k, srv in enumerate(srvs):
                if i == args.warmup:
                    cpu0[k] = cpu_seconds(pids[k])
                t0, first = one_request(http, srv.url, prompt, args.max_tokens)
                if i >= args.warmup:
                    spans[k].append((t0, first))
                time.sleep(args.gap_s)
        cpu1 = [cpu_seconds(p) for p in pids]
        time.sleep(1.0)  # the last requests' DEBUG lines
        logs = [srv.log() for srv in srvs]
    out = []
    for k, (label, _, _) in enumerate(servers):
        per_req = {w: (cpu1[k][w] - cpu0[k][w]) / max(1, args.requests) * 1e3 for w in cpu1[k] if w in cpu0[k]}
        print(f"{label}: CPU ms per request: " + ", ".join(f"{w} {v:.1f}" for w, v in sorted(per_req.items())))
        traces = line_up(spans[k], logs[k])
        print(f"{label}: {len(traces)} requests, {sum(('router', 'arrived') in t.stamps for t in traces)} traced")
        out.append((label, traces))
    return out


def report(label: str, traces: list[Trace]) -> float:
    """Print the medians of each stamp (ms after the client's send) and of each hop; returns the
    median client TTFT in ms."""
    rel = [t.relative() for t in traces]
    print(f"\n## {label}\n| hop | median ms after send | median ms since previous |\n|---|---|---|")
    prev = None
    for who, name, text in HOPS:
        vals = [r[(who, name)] for r in rel if (who, name) in r]
        if not vals:
            continue
        at = statistics.median(vals) * 1e3
        gaps = [r[(who, name)] - r[prev] for r in rel if prev is not None and (who, name) in r and prev in r]
        gap = f"{statistics.median(gaps) * 1e3:.2f}" if gaps else ""
        print(f"| {text} | {at:.2f} | {gap} |")
        prev = (who, name)
    return statistics.median(r[("client", "first_byte")] for r in rel) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="pd,colocated", help="servers to launch, in order")
    p.add_argument("--repo", type=Path, default=None, help="also run every mode from this checkout (A/B)")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=250)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--gap-s", type=float, default=0.2, help="pause between requests (the workers go idle)")
    p.add_argument("--other-first", action="store_true", help="--repo's servers first in every round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=900.0, help="per server (a loaded machine is slow)")
    p.add_argument("--server-args", default="", help="more `pdserve launch` flags for every server")
    args = p.parse_args(argv)
    repos: list[tuple[str, Path | None]] = [("this", None)] + ([("other", args.repo)] if args.repo else [])
    if args.other_first:  # each round's first server can fare differently: swap to check
        repos.reverse()
    servers = [
        (f"{mode} ({tag} checkout)" if args.repo else mode, mode, repo)
        for tag, repo in repos
        for mode in args.modes.split(",")
    ]
    ttft: dict[str, float] = {}
    for label, traces in run_all(servers, args):
        ttft[label] = report(label, traces)
    print("\n| server | median TTFT ms | / first |\n|---|---|---|")
    base = next(iter(ttft.values()))
    for label, v in ttft.items():
        print(f"| {label} | {v:.1f} | {v / base:.3f} |")


if __name__ == "__main__":
    main()
