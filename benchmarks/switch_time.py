"""How long a live role switch takes behind a prefill backlog, each way, with the launch's flags.

Launches ``pdserve launch --mode pd --decode 2`` (1 prefill + 2 decode workers, the migration path a
decode -> prefill switch needs: ``--migrate-after`` with a bound no request reaches, a host pool) and
the given extra flags (none: the default pace and chunk sizes), then:

1. **decode -> prefill**: ``--prompts`` long prompts (``--words`` words, 16 output tokens, greedy)
   sent at once, all routed to decode-1 (``--route-decode decode-1``) so that it waits for their KV
   behind prefill-0's backlog; ``--after-s`` later decode-1 switches to prefill.
2. **prefill -> decode**: the same number of new long prompts sent at once, now prefilled by
   prefill-0 and decode-1 (a prefill worker now); ``--after-s`` later decode-1 switches back while
   it holds some of them.

For each switch it prints the time the router's ``POST /admin/role`` took (the switch done, the new
role serving), the worker's own figure (its log: from the ``SwitchRole`` to the new scheduler), and
what the requests of that phase got: every status (200 expected), the slowest request, the
router's hand-backs and retries. A row whose switch answered other than 200 says so.

    python -m benchmarks.switch_time [--prompts 8] [--words 1500] [--after-s 1.5] [--log FILE] [-- extra launch flags]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time

import httpx

from bench.harness.subprocess_server import LaunchedServer, free_base_port, metric_sum, scrape_metrics
from bench.serve.client import served_model

FLAGS = ["--mode", "pd", "--decode", "2", "--migrate-after", "100000", "--host-kv-pool-gb", "0.25"]
FLAGS += ["--kv-pool-tokens", "32768", "--route-decode", "decode-1", "--log-level", "INFO"]
WORDS = (
    "the of and to in is was for on that with as by at from his her it an are were this be which or river "
    "mountain city history music science garden winter harbor village market library engine forest ocean"
).split()
SWITCHED = re.compile(r"\[decode-1\] .*switched role (\w+) -> (\w+) in ([0-9.]+) s")


def prompt(i: int, words: int) -> str:
    """A distinct long prompt per index (no shared prefix past its first words)."""
    rng = random.Random(1000 + i)
    return f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\nSummary:"


async def phase(url: str, model: str, first: int, args, role: str) -> dict:
    """Send ``args.prompts`` prompts at once, switch decode-1 to ``role`` ``args.after_s`` later; the
    switch's answer, its time at the router, and the requests' statuses and times."""

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, float]:
        t0 = time.monotonic()
        body = {"model": model, "prompt": prompt(i, args.words), "max_tokens": 16, "temperature": 0}
        r = await c.post(f"{url}/v1/completions", json=body, timeout=1800)
        return r.status_code, time.monotonic() - t0

    async with httpx.AsyncClient(trust_env=False) as c:
        sent = [asyncio.ensure_future(one(c, first + i)) for i in range(args.prompts)]
        await asyncio.sleep(args.after_s)
        t0 = time.monotonic()
        r = await c.post(f"{url}/admin/role", json={"worker": "decode-1", "role": role}, timeout=600)
        switch_s = time.monotonic() - t0
        done = await asyncio.gather(*sent)
    return {"role": role, "answer": r.status_code, "switch_s": switch_s, "requests": done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--words", type=int, default=1500)
    ap.add_argument("--after-s", type=float, default=1.5)
    ap.add_argument("--log", help="write the launch's log here")
    ap.add_argument("extra", nargs="*", help="extra pdserve launch flags (after --)")
    args = ap.parse_args()
    flags = [*FLAGS, "--port", "0", "--base-port", str(free_base_port(3)), *args.extra]
    with LaunchedServer(flags) as srv:
        model = served_model(srv.url)
        rows, before = [], scrape_metrics(srv.url)
        for n, role in enumerate(("prefill", "decode")):
            row = asyncio.run(phase(srv.url, model, n * args.prompts, args, role))
            m = scrape_metrics(srv.url)
            for k in ("handbacks", "retries"):
                name = f"pdserve_router_{k}_total"
                row[k] = metric_sum(m, name) - metric_sum(before, name)
            rows.append(row)
            before = m
        log = srv.log()
        worker = SWITCHED.findall(log)
    if args.log:
        with open(args.log, "w") as f:
            f.write(log)
    print(f"| switch | router s | worker s | statuses | slowest request s | hand-backs | retries |\n|{'---|' * 7}")
    for row, (old, new, secs) in zip(rows, worker + [("?", "?", "?")] * (len(rows) - len(worker)), strict=False):
        statuses = sorted({s for s, _ in row["requests"]})
        answer = "" if row["answer"] == 200 else f" (answered {row['answer']})"
        print(
            f"| decode-1 {old} -> {new}{answer} | {row['switch_s']:.2f} | {secs} | {statuses} | "
            f"{max(t for _, t in row['requests']):.1f} | {row['handbacks']:g} | {row['retries']:g} |"
        )
    print(f"launch flags: {' '.join(flags)}")


if __name__ == "__main__":
    main()
