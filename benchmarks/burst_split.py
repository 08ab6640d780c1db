"""One burst of requests against PD: how the prefill work splits between the prefill worker and the
decode worker, with and without selective disaggregation.

For each ``--local-prefill-max-tokens`` value (``--values 0,256``) this launches a 1P+1D server,
sends ``--burst`` streamed completions at once (fresh random token-id prompts of
``--input-len-range`` tokens, so no prefix cache helps; ``--output-len`` tokens each, ignore_eos),
and prints, from the server's ``/metrics`` before and after: prompt tokens the decode worker
prefilled itself (``pdserve_local_prefill_tokens_total``) and the rest (the prefill worker's), the
time each side spent computing prompts (``pdserve_request_phase_seconds`` sums of
``prefill_compute`` on the prefill worker, ``local_prefill`` on the decode worker), the local
prefill decisions by reason, and the burst's TTFT (median, max) and makespan. The runs share one
sitting, so the last table's ratios against the first value are the A/B.

    python -m benchmarks.burst_split --values 0,256 --burst 32
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import httpx

from bench.harness.subprocess_server import LaunchedServer, metric_sum, wait_idle
from bench.serve.servers import launch_argv


async def _one(http: httpx.AsyncClient, url: str, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(TTFT, end) seconds after the request was sent."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    first = None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - t0
    if first is None:
        raise RuntimeError("stream ended without a token")
    return first, time.monotonic() - t0


async def burst(url: str, prompts: list[list[int]], output_len: int) -> list[tuple[float, float]]:
    """Every prompt sent at once; their (TTFT, end)."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, trust_env=False, limits=limits) as http:
        return await asyncio.gather(*(_one(http, url, p, output_len) for p in prompts))


def phase_sum(m: dict, worker_role: str, phase: str) -> float:
    """Seconds a role's workers spent in ``phase`` (sum of the histogram), over its workers."""
    return sum(
        v
        for (n, lab), v in m.items()
        if n == "pdserve_request_phase_seconds_sum"
        and dict(lab).get("phase") == phase
        and dict(lab).get("worker", "").startswith(worker_role)
    )


def run(value: int, args) -> dict:
    """One server with ``--local-prefill-max-tokens value``: the burst's split and latencies."""
    rng = random.Random(args.seed)
    lo, hi = args.input_len_range
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(lo, hi))] for _ in range(args.burst)]
    warm = [[rng.randrange(1000, 40000) for _ in range(lo)] for _ in range(2)]
    flags = launch_argv("pd", ["--local-prefill-max-tokens", str(value), *args.server_args.split()])
    with LaunchedServer(flags) as srv:
        asyncio.run(burst(srv.url, warm, 2))
        before = wait_idle(srv.url, args.heartbeat_s)
        t0 = time.monotonic()
        res = asyncio.run(burst(srv.url, prompts, args.output_len))
        makespan = time.monotonic() - t0
        after = wait_idle(srv.url, args.heartbeat_s)

    def moved(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    local = moved("pdserve_local_prefill_tokens_total")
    reasons = {
        dict(lab)["reason"]: moved("pdserve_local_prefill_total", reason=dict(lab)["reason"])
        for (n, lab) in after
        if n == "pdserve_local_prefill_total"
    }
    ttfts = [r[0] for r in res]

    def phase_moved(role: str, phase: str) -> float:
        return phase_sum(after, role, phase) - phase_sum(before, role, phase)

    return {
        "value": value,
        "prompt_tokens": sum(map(len, prompts)),
        "decode_tokens": local,
        "prefill_s": phase_moved("prefill", "prefill_compute"),
        "local_s": phase_moved("decode", "local_prefill"),
        "reasons": {k: int(v) for k, v in reasons.items() if v},
        "ttft_med": statistics.median(ttfts),
        "ttft_max": max(ttfts),
        "makespan": makespan,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", default="0,256", help="--local-prefill-max-tokens values, one server each")
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--input-len-range", type=int, nargs=2, default=(112, 289), metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="the server's worker heartbeat (metrics freshness)")
    p.add_argument("--server-args", default="", help="more `pdserve launch` flags for every server")
    args = p.parse_args(argv)
    rows = [run(int(v), args) for v in args.values.split(",")]
    print(
        "| --local-prefill-max-tokens | prompt tokens | by prefill worker | by decode worker | prefill compute s "
        "(P) | local prefill s (D) | decisions | TTFT median s | TTFT max s | makespan s | makespan / first |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['value']} | {r['prompt_tokens']} | {r['prompt_tokens'] - r['decode_tokens']:.0f} | "
            f"{r['decode_tokens']:.0f} | {r['prefill_s']:.2f} | {r['local_s']:.2f} | {r['reasons'] or '-'} | "
            f"{r['ttft_med']:.2f} | {r['ttft_max']:.2f} | {r['makespan']:.2f} | "
            f"{r['makespan'] / rows[0]['makespan']:.2f} |"
        )


if __name__ == "__main__":
    main()
