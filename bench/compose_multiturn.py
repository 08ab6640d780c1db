"""``python -m bench.compose_multiturn``: the multi-turn chat workload against the shipped
``docker/compose.yaml`` deployment, once per routing policy (the cache-aware routing goal: "2P+2D on one host
and in compose").

For each policy in ``--routings`` (default ``least-loaded,cache-aware``) it brings up a fresh compose
project from ``pdserve:latest`` (``--image``) with ``--scale prefill=P --scale decode=D``, every
container given ``PDSERVE_ROUTING`` and the pool / local-prefill settings through an override file,
waits until the router lists every worker ready, runs ``pdserve bench serve --multi-turn`` (the
arguments after ``--``) against the router's loopback port, and takes the project down (``down -v``,
whatever happened, Ctrl-C and SIGTERM included). Each policy's run starts from empty caches. Then
it prints, per turn and over all requests, each policy's TTFT mean and p99 and output tok/s, the
ratios of the later policies to the first, and the KV bytes shipped per request from each run's
``/metrics``.

Only the router's port on 127.0.0.1 is connected to; the project has its own subnet
(``--subnet``) and name. Needs Docker, docker-compose and the image (``make image``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "compose.yaml"
DEFAULT_MT = [
    "--users",
    "16",
    "--turns",
    "6",
    "--input-len",
    "512",
    "--turn-input-len",
    "64",
    "--output-len",
    "64",
    "--think-time-s",
    "1",
    "--user-arrival-s",
    "1.5",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench compose-multiturn", description=__doc__.split("\n\n")[0])
    p.add_argument("--routings", default="least-loaded,cache-aware", help="policies, comma-separated (first = base)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--kv-pool-tokens", type=int, default=32768)
    p.add_argument("--local-prefill-max-tokens", type=int, default=256)
    p.add_argument(
        "--dtype",
        default=None,
        help="the workers' --dtype (default: the preset's), e.g. bfloat16 as the one-host multi-turn runs",
    )
    p.add_argument("--image", default="pdserve:latest")
    p.add_argument("--port", type=int, default=18600, help="the router's port on 127.0.0.1")
    p.add_argument("--subnet", default="10.214.241.0/24", help="the project's own subnet (must be unused)")
    p.add_argument("--out-dir", default=".", help="each policy's bench JSON: compose-multiturn-<policy>.json")
    p.add_argument("mt_args", nargs=argparse.REMAINDER, help="after --: multi-turn flags (default: the goal's 16 x 6)")
    return p


def override(routing: str, kv_pool_tokens: int, local_max: int, dtype: str | None = None) -> str:
    """The compose override: the policy and pool settings (and ``dtype`` when given) on every
    service (routers read routing, workers the rest; each ignores what is not its own)."""
    env = {
        "PDSERVE_ROUTING": routing,
        "PDSERVE_KV_POOL_TOKENS": str(kv_pool_tokens),
        "PDSERVE_LOCAL_PREFILL_MAX_TOKENS": str(local_max),
        **({"PDSERVE_DTYPE": dtype} if dtype else {}),
    }
    lines = ["services:"]
    for service in ("prefill", "decode", "router", "router-b"):
        lines.append(f"  {service}:\n    environment:")
        lines += [f'      {k}: "{v}"' for k, v in env.items()]
    return "\n".join(lines) + "\n"


def ready_counts(workers_text: str) -> tuple[int, int]:
    """(prefill, decode) workers the router's ``/health`` text lists as ready."""
    return workers_text.count("(prefill): ready"), workers_text.count("(decode): ready")


def wait_ready(url: str, prefill: int, decode: int, timeout_s: float = 400) -> float:
    """Seconds until the router at ``url`` lists ``prefill`` + ``decode`` ready workers."""
    t0, last = time.monotonic(), ""
    while time.monotonic() - t0 < timeout_s:
        try:
            r = httpx.get(f"{url}/health", timeout=5, trust_env=False)
            last = r.text
            if r.status_code == 200 and ready_counts(r.json().get("workers", "")) >= (prefill, decode):
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError(f"router {url} did not list {prefill} prefill + {decode} decode ready workers: {last[:400]}")


def run_policy(a: argparse.Namespace, routing: str, tmp: Path, key: Path) -> Path:
    """One compose project under ``routing``: up, the multi-turn bench, down. Returns its JSON path."""
    ovr = tmp / f"override-{routing}.yaml"
    ovr.write_text(override(routing, a.kv_pool_tokens, a.local_prefill_max_tokens, a.dtype))
    env = {
        **os.environ,
        "PDSERVE_PORT": str(a.port),
        "PDSERVE_PORT_B": str(a.port + 1),
        "PDSERVE_SUBNET": a.subnet,
        "PDSERVE_CLUSTER_KEY_FILE": str(key),
        "PDSERVE_IMAGE": a.image,
    }
    compose = [
        "docker-compose",
        "-p",
        f"pdmt{os.getpid()}{routing.replace('-', '')}",
        "-f",
        str(COMPOSE),
        "-f",
        str(ovr),
    ]
    out = Path(a.out_dir) / f"compose-multiturn-{routing}.json"
    try:
        subprocess.run(
            [*compose, "up", "-d", "--no-build", "--scale", f"prefill={a.prefill}", "--scale", f"decode={a.decode}"],
            check=True,
            env=env,
        )
        url = f"http://127.0.0.1:{a.port}"
        print(
            f"compose-multiturn: {routing}: ready after {wait_ready(url, a.prefill, a.decode):.0f} s", file=sys.stderr
        )
        mt = [x for x in a.mt_args if x != "--"] or DEFAULT_MT
        subprocess.run(
            [sys.executable, "-m", "bench", "serve", "--multi-turn", *mt, "--base-url", url, "--out", str(out)],
            check=True,
        )
    finally:
        subprocess.run([*compose, "down", "-v", "--remove-orphans", "-t", "5"], env=env, check=False)
    return out


def summary(payload: dict) -> dict[str, dict]:
    """Per record kind (``all``, ``turn1``..): TTFT mean / p99 ms and output tok/s of one run's JSON."""
    out = {}
    for run in payload["runs"]:
        s = run["stats"]
        ttft = s.get("ttft") or {}
        out[run["kind"]] = {
            "ttft_mean": ttft.get("mean_ms"),
            "ttft_p99": ttft.get("p99_ms"),
            "tok_s": s["output_throughput"],
            "failed": s["failed"],
        }
    return out


def compare(base: dict[str, dict], other: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    """Rows (kind, TTFT mean, TTFT p99, tok/s) of ``other / base``."""

    def r(k: str, m: str) -> str:
        a, b = base[k][m], other[k][m]
        return "-" if not a or b is None else f"{b / a:.2f}x"

    return [(k, r(k, "ttft_mean"), r(k, "ttft_p99"), r(k, "tok_s")) for k in base if k in other]


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM too runs each project's `down -v`
    routings = a.routings.split(",")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        key = tmp / "cluster.key"
        subprocess.run(
            [sys.executable, "-m", "server.launch.cli", "keygen", str(key)], check=True, stdout=subprocess.DEVNULL
        )
        os.chown(key, 10001, 10001)  # the image's user reads the secret as mounted
        payloads = {r: json.loads(run_policy(a, r, tmp, key).read_text()) for r in routings}
    sums = {r: summary(p) for r, p in payloads.items()}
    for r, s in sums.items():
        effect = (payloads[r].get("cache_effect") or {}).get("server", {})
        kv, hits = effect.get("kv_bytes_per_request"), effect.get("hit_rate", {})
        turns = ", ".join(
            f"{k} TTFT {v['ttft_mean']:.0f}/{v['ttft_p99']:.0f} ms {v['tok_s']:.1f} tok/s"
            for k, v in s.items()
            if v["ttft_mean"] is not None
        )
        hit = ", ".join(f"{role} hit rate {v:.1%}" for role, v in sorted(hits.items()))
        print(f"{r}: {turns}; KV shipped {'-' if kv is None else f'{kv / 1e6:.2f}'} MB/request; {hit}")
    for r in routings[1:]:
        print(f"\n{r} / {routings[0]}:\n| kind | TTFT mean | TTFT p99 | tok/s |\n|---|---|---|---|")
        for row in compare(sums[routings[0]], sums[r]):
            print("| " + " | ".join(row) + " |")
    return 1 if any(v["failed"] for s in sums.values() for v in s.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
