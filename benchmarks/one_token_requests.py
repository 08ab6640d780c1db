"""Back-to-back one-token requests (lm-eval's scoring pattern), PD against colocated, default flags.

Launches ``pdserve launch --mode pd`` and ``--mode colocated`` in turn (each with the given extra
flags), sends one warm-up request, then ``--requests`` sequential completions with ``max_tokens`` 1
and a distinct prompt each, and prints each mode's time to first token (the whole request: its one
token is its first) and how many worker steps ran on borrowed cores
(``pdserve_worker_borrowed_core_steps_total``, ``server.worker.core_lending``). ``--repo`` runs
another checkout (e.g. an older commit) for an A/B on the same machine.

    python -m benchmarks.one_token_requests [--requests 8] [--repo DIR] [-- extra launch flags]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import httpx

from bench.harness.subprocess_server import LaunchedServer, free_base_port, metric_sum, wait_idle

HEARTBEAT_S = 1.0  # the default ``health_interval_s``: fresh worker metrics take one


def prompt(i: int) -> str:
    """A distinct prompt per request: a repeated one would be cached and prefill a few tokens only."""
    return f"Passage {i}. " + "The history of the printing press begins in the fifteenth century. " * 4


def measure(mode: str, n: int, extra: list[str], repo: Path | None) -> dict:
    """TTFTs (ms) of ``n`` sequential one-token requests and the borrowed steps they caused."""
    args = ["--mode", mode, "--port", "0", "--base-port", str(free_base_port(8)), *extra]
    with LaunchedServer(args, repo=repo) as srv, httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        body = {"max_tokens": 1, "temperature": 0}
        c.post("/v1/completions", json={**body, "prompt": "warm up " * 20}).raise_for_status()
        before = wait_idle(srv.url, HEARTBEAT_S)
        ttft = []
        for i in range(n):
            t0 = time.perf_counter()
            c.post("/v1/completions", json={**body, "prompt": prompt(i)}).raise_for_status()
            ttft.append(1000 * (time.perf_counter() - t0))
        after = wait_idle(srv.url, HEARTBEAT_S)
        verdicts = [line for line in srv.log().splitlines() if "core lending" in line or "step matmuls" in line]
    name = "pdserve_worker_borrowed_core_steps_total"
    return {"ttft_ms": ttft, "borrowed": metric_sum(after, name) - metric_sum(before, name), "log": verdicts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.one_token_requests", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--repo", type=Path, default=None, help="checkout to run (default: this one)")
    p.add_argument("extra", nargs="*", help="more `pdserve launch` flags (after --)")
    args = p.parse_args(argv)
    rows = {mode: measure(mode, args.requests, args.extra, args.repo) for mode in ("pd", "colocated")}
    print(f"{args.requests} sequential requests, max_tokens 1 (TTFT in ms):")
    print(f"{'mode':<10} {'median':>7} {'first':>7} {'min':>7} {'max':>7}  borrowed core steps")
    for mode, r in rows.items():
        t = r["ttft_ms"]
        print(f"{mode:<10} {statistics.median(t):7.0f} {t[0]:7.0f} {min(t):7.0f} {max(t):7.0f}  {r['borrowed']:.0f}")
    for mode, r in rows.items():  # whether each worker borrows at all (its start-up measurement)
        print("\n".join(f"{mode}: {line}" for line in r["log"]))
    ratio = statistics.median(rows["pd"]["ttft_ms"]) / statistics.median(rows["colocated"]["ttft_ms"])
    print(f"PD / colocated median TTFT: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
