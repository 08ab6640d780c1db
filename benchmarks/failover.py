"""Failover of streaming requests: the goal figures in one run.

``python -m benchmarks.failover [--streams 24] [--max-tokens 128] [--replicas 2] [--prefill 2]
[--transfer-backend ucxx] [--kill-at 0.25] [--seed 0] [--dtype float32] [--continuation-forward-tokens N]
[--json] [--log-level DEBUG --log-file PATH]``

Launches the embedded model as 1 prefill + 2 decode workers (``--prefill N``: N prefill workers;
``--replicas 2``: two colocated replicas instead), streams ``--streams`` concurrent completions of
``--max-tokens`` tokens (``ignore_eos``; cycling through greedy, seeded temperature, ``json_schema``,
``n=2``, ``logprobs`` and stop strings) once without a fault, then the same bodies again with ``kill -9`` of the decode
worker (replica) running the most requests once the clients hold ``--kill-at`` of all tokens.
Prints:

- failed requests (goal 0) and outputs identical to the fault-free run (text, token ids, finish
  reason, logprobs within 1e-3, usage; goal: all);
- detection: from the kill to the router's ``worker <id> is dead`` log line (goal < 1 s);
- the largest inter-token gap any client saw in each run, the router's stall histogram
  (``pdserve_failover_stall_seconds``: last token from the dead worker to the first of the
  continuation), the failovers and the recomputed tokens, and two bounds, each timed on the
  settled server afterwards with fresh prompts (``max_tokens`` 1, no cache hit), so they move with
  the host's speed and load:

  - ``bound_one_s`` (the goal): detection + one prefill of ONE continuation: a prompt as long as the
    longest prompt plus the most tokens any one choice had received at the kill, sent alone;
  - ``bound_all_s``: detection + the recompute of everything the dead worker held, batched: as many
    fresh prompts at once as there were continuations, each of the mean prompt length plus the
    recomputed tokens per continuation (from the router's counters), until the last first token.

  A gap between the two is the burst's cost: each continuation waiting for the others' compute.

- the distribution of each stream's largest gap (p50, p90, max over the streams of the faulted run;
  ``gap_fault_free``: the same of the run without a fault) and of ``resume_after_kill_s``: from the
  kill to each stream's first token after it, over the streams alive at the kill (the survivor's own
  streams resume with their next step, the continued ones after detection and their recompute;
  ``resume_after_detection_s``: those that resumed only after the router's ``is dead`` line, the
  continued ones; ``resumes_s``: every one, sorted);
- what the workers computed for the continuations (``pdserve_continuation_prefill_tokens_total``) against
  what their radix caches held (``pdserve_continuation_cached_tokens_total``), summed over the workers
  and by worker (``failovers_same_prefill``: the continuations sent to the prefill worker of their
  failed route, which holds their prompt), beside ``prompt_page_tokens``: the prompt tokens in
  whole pages of the streams that resumed only after the router's ``is dead`` line (the continued
  ones; each choice of an ``n = 2`` request counted), the most a cache that holds each continued
  prompt can give them (a radix cache holds whole pages only: a prompt shorter than a page has
  nothing cached).

``--continuation-forward-tokens N`` launches the workers with that cap (shortest continuation first,
at most ``N`` of their tokens per forward); 0, the default, leaves it off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
import uuid

import httpx

from bench.harness.subprocess_server import LaunchedServer, free_base_port, metric_sum, scrape_metrics, wait_idle
from benchmarks.failover_load import astream, dead_at, first_difference, mixed_bodies, same_output, worker_pid

HEARTBEAT_S = 0.2
PAGE_SIZE = 16
WORDS = (
    "river stone light garden window morning paper music silver forest engine voice winter harbor "
    "letter market bridge candle orange summer keeper tower ocean storm"
).split()


def launch_args(ns: argparse.Namespace) -> list[str]:
    """``pdserve launch`` flags of the run: PD 1+2 or colocated replicas, pools large enough for every
    stream on one worker (the survivor takes them all)."""
    pd = ["--mode", "pd", "--prefill", str(ns.prefill), "--decode", "2"]
    topo = ["--mode", "colocated", "--replicas", str(ns.replicas)] if ns.replicas else pd
    extra = ["--transfer-backend", ns.transfer_backend] if ns.transfer_backend else []
    extra += ["--base-port", str(ns.base_port)]
    return [
        *topo,
        *extra,
        "--port",
        "0",
        "--kv-pool-tokens",
        "16384",
        "--page-size",
        str(PAGE_SIZE),
        "--dtype",
        ns.dtype,
        "--health-interval-s",
        str(HEARTBEAT_S),
        "--log-level",
        ns.log_level,
        *(
            ["--continuation-forward-tokens", str(ns.continuation_forward_tokens)]
            if ns.continuation_forward_tokens
            else []
        ),
    ]


def continuation_tokens_by_worker(m: dict, before: dict) -> dict[str, dict[str, int]]:
    """{worker: {"computed": n, "cached": n}} of the continuation counters' change from ``before``
    to ``m``, for the workers where either moved."""
    names = {
        "computed": "pdserve_continuation_prefill_tokens_total",
        "cached": "pdserve_continuation_cached_tokens_total",
    }
    workers = sorted({dict(lab).get("worker") for (n, lab) in m if n in names.values()} - {None})
    out = {
        w: {k: int(metric_sum(m, n, worker=w) - metric_sum(before, n, worker=w)) for k, n in names.items()}
        for w in workers
    }
    return {w: v for w, v in out.items() if any(v.values())}


def prompt_page_tokens(records: list[dict], detect_s: float | None, page: int) -> int:
    """The prompt tokens in whole pages of the streams that resumed only after the detection (the
    continued ones), each choice counted: what a cache holding every continued prompt gives them."""
    if detect_s is None:
        return 0
    continued = [r for r in records if r["resume_s"] is not None and r["resume_s"] >= detect_s]
    return sum((r["usage"]["prompt_tokens"] // page) * page * len(r["choices"]) for r in continued)


def spread(values: list[float]) -> dict[str, float]:
    """p50, p90 (nearest rank) and max of ``values``, rounded to ms; empty for none."""
    v = sorted(values)
    if not v:
        return {}
    at = {q: v[max(0, math.ceil(q * len(v)) - 1)] for q in (0.5, 0.9)}
    return {"p50": round(at[0.5], 3), "p90": round(at[0.9], 3), "max": round(v[-1], 3)}


async def run_load(url: str, bodies: list[dict], on_chunk=None) -> list[dict]:
    """Every body at once, one connection each."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, trust_env=False) as c:
        return await asyncio.gather(*(astream(c, b, on_chunk) for b in bodies))


def busiest(url: str, workers: list[str]) -> str:
    """The one of ``workers`` with the most running requests in the router's view (ties: first)."""
    m = scrape_metrics(url)
    return max(workers, key=lambda w: metric_sum(m, "pdserve_queue_requests", worker=w, queue="running"))


async def faulted_run(server: LaunchedServer, bodies: list[dict], workers: list[str], kill_tokens: int) -> tuple:
    """The load with ``kill -9`` of the busiest of ``workers`` once the clients hold ``kill_tokens``
    tokens; (records, victim, wall time of the kill, tokens the clients held then)."""
    reached = asyncio.Event()
    held: dict[int, int] = {}  # tokens each stream holds, by its record's id
    most: dict[int, int] = {}  # the most tokens one of its choices holds, by its record's id
    killed: list[float] = []  # monotonic time of the kill, once made
    resumed: dict[int, float] = {}  # seconds from the kill to its first token after it, by its record's id

    def counting(out: dict) -> None:
        if killed and out["tokens"] > held.get(id(out), 0) and id(out) not in resumed:
            resumed[id(out)] = time.monotonic() - killed[0]
        held[id(out)] = out["tokens"]
        most[id(out)] = max((len(c["token_ids"]) for c in out["choices"].values()), default=0)
        out.setdefault("held_at_kill", None)
        if sum(held.values()) >= kill_tokens:
            reached.set()

    task = asyncio.create_task(run_load(server.url, bodies, counting))
    await reached.wait()
    victim = await asyncio.to_thread(busiest, server.url, workers)
    pid = worker_pid(server, victim)
    at_tokens = sum(held.values())
    t_kill = time.time()
    print(f"kill -9 {victim} at monotonic {time.monotonic():.6f}", file=sys.stderr)
    killed.append(time.monotonic())
    os.kill(pid, signal.SIGKILL)
    snapshot, choice_snapshot = dict(held), dict(most)
    records = await task
    for r in records:
        r["held_at_kill"] = snapshot.get(id(r), 0)
        r["choice_held_at_kill"] = choice_snapshot.get(id(r), 0)
        r["resume_s"] = resumed.get(id(r))  # None: it had ended before the kill
    return records, victim, t_kill, at_tokens


def fresh_prompt(tokens: int) -> str:
    """A prompt of about ``tokens`` tokens that no cache holds (a random word first)."""
    return f"{uuid.uuid4().hex} " + " ".join(WORDS[i % len(WORDS)] for i in range(max(tokens - 12, 1)))


async def _first_tokens(url: str, prompts: list[str]) -> float:
    """Seconds until every one of ``prompts``, sent at once (``max_tokens`` 1), has its answer."""
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as c:

        async def one(p: str) -> None:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 1, "temperature": 0})
            r.raise_for_status()

        t0 = time.monotonic()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.monotonic() - t0


def prefill_time(url: str, tokens: int, count: int = 1) -> float:
    """Seconds to the last first token of ``count`` fresh (uncached) prompts of about ``tokens``
    tokens each, sent at once, ``max_tokens`` 1 (``count`` 1: one prefill alone)."""
    return asyncio.run(_first_tokens(url, [fresh_prompt(tokens) for _ in range(max(count, 1))]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--replicas", type=int, default=0, help="colocated replicas instead of 1 prefill + 2 decode")
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers beside the 2 decode workers (PD)")
    ap.add_argument("--transfer-backend", choices=["nixl", "ucxx"], default=None)
    ap.add_argument("--kill-at", type=float, default=0.25, help="fraction of all tokens the clients hold at the kill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "auto"],
        default="float32",
        help="the workers' dtype; float32 (the exact mode) is where a continuation is identical to the "
        "fault-free run: in bfloat16 its one prefill of the sent tokens rounds differently from the decode "
        "steps that produced them, so later tokens may differ",
    )
    ap.add_argument(
        "--continuation-forward-tokens",
        type=int,
        default=0,
        help="the workers' continuation_forward_tokens: shortest continuation first, at most N of their "
        "tokens per forward (0: off)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log-level", default="INFO", help="the launch's log level (DEBUG: per-request marks)")
    ap.add_argument("--log-file", default=None, help="write the launch's log (router and workers) there at the end")
    ns = ap.parse_args(argv)
    # the workers' ports: free ones, so the run does not collide with another launch on the host
    ns.base_port = free_base_port(ns.replicas or ns.prefill + 2)

    mixes = mixed_bodies(ns.streams, ns.max_tokens, WORDS, ns.seed)
    bodies = [b for _, b in mixes]
    expected = sum(b.get("n", 1) for b in bodies) * ns.max_tokens
    workers = [f"colocated-{i}" for i in range(ns.replicas)] if ns.replicas else ["decode-0", "decode-1"]
    with LaunchedServer(launch_args(ns), startup_timeout_s=600) as server:  # a loaded host starts slowly
        ref = asyncio.run(run_load(server.url, bodies))
        bad_ref = [i for i, r in enumerate(ref) if r["errors"]]
        assert not bad_ref, f"the fault-free run failed requests {bad_ref}: {ref[bad_ref[0]]['errors']}"
        before = wait_idle(server.url, HEARTBEAT_S)
        got, victim, t_kill, at_tokens = asyncio.run(faulted_run(server, bodies, workers, int(ns.kill_at * expected)))
        detected = dead_at(server.log(), victim, t_kill)
        m = scrape_metrics(server.url)

        def moved(name: str, **labels: str) -> float:
            return metric_sum(m, name, **labels) - metric_sum(before, name, **labels)

        failovers = moved("pdserve_failovers_total", outcome="continued")
        other = moved("pdserve_failovers_total") - failovers
        recomputed = moved("pdserve_failover_recomputed_tokens_total")
        same_prefill = moved("pdserve_failover_same_prefill_total")
        computed = moved("pdserve_continuation_prefill_tokens_total")
        cached = moved("pdserve_continuation_cached_tokens_total")
        by_worker = continuation_tokens_by_worker(m, before)
        stall_n = moved("pdserve_failover_stall_seconds_count")
        stall_mean = moved("pdserve_failover_stall_seconds_sum") / stall_n if stall_n else 0.0
        prompt_tokens = max(r["usage"]["prompt_tokens"] for r in ref)
        mean_prompt = sum(r["usage"]["prompt_tokens"] for r in ref) / len(ref)
        sent = max((r["choice_held_at_kill"] for r in got), default=0)
        longest = prompt_tokens + min(sent, ns.max_tokens)
        each = round(mean_prompt + recomputed / failovers) if failovers else 0
        deadline = time.monotonic() + 180  # the launcher restarts the victim; prefill on a settled server
        while metric_sum(scrape_metrics(server.url), "pdserve_worker_up") < len(workers) + (
            0 if ns.replicas else ns.prefill
        ):
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        prefill_s = min(prefill_time(server.url, longest) for _ in range(3))
        batch_s = min(prefill_time(server.url, each, int(failovers)) for _ in range(2)) if failovers else 0.0
        if ns.log_file:
            with open(ns.log_file, "w") as f:
                f.write(server.log())

    failed = [i for i, r in enumerate(got) if r["errors"] or r["status"] != 200]
    identical = sum(same_output(g, r) for g, r in zip(got, ref))
    detect_s = None if detected is None else detected - t_kill
    gap, gap_ref = max(r["gap_s"] for r in got), max(r["gap_s"] for r in ref)
    resumes = sorted(r["resume_s"] for r in got if r["resume_s"] is not None)
    bound, bound_all = (detect_s or 0.0) + prefill_s, (detect_s or 0.0) + batch_s
    res = {
        "launch": " ".join(launch_args(ns)),
        "streams": ns.streams,
        "max_tokens": ns.max_tokens,
        "victim": victim,
        "tokens_at_kill": f"{at_tokens}/{expected}",
        "failed": len(failed),
        "identical": f"{identical}/{len(bodies)}",
        "identical_by_mix": {
            name: f"{sum(same_output(g, r) for (n, _), g, r in zip(mixes, got, ref) if n == name)}"
            f"/{sum(1 for n, _ in mixes if n == name)}"
            for name in sorted({n for n, _ in mixes})
        },
        "differing (mix, choice, first index, tokens held at the kill)": [
            (n, *d, g["held_at_kill"])
            for (n, _), g, r in zip(mixes, got, ref)
            if (d := first_difference(g, r)) is not None
        ],
        "failovers_continued": int(failovers),
        "failovers_other_outcomes": int(other),
        "failovers_same_prefill": int(same_prefill),
        "recomputed_tokens": int(recomputed),
        "continuation_prefill_computed_tokens": int(computed),
        "continuation_prefill_cached_tokens": int(cached),
        "continuation_tokens_by_worker": by_worker,
        "prompt_page_tokens": prompt_page_tokens(got, detect_s, PAGE_SIZE),
        "detection_s": None if detect_s is None else round(detect_s, 3),
        "max_gap_s": round(gap, 3),
        "max_gap_fault_free_s": round(gap_ref, 3),
        "gap_s": spread([r["gap_s"] for r in got]),
        "gap_fault_free_s": spread([r["gap_s"] for r in ref]),
        "resume_after_kill_s": spread(resumes),
        "resume_after_detection_s": spread([t for t in resumes if detect_s is not None and t >= detect_s]),
        "resumes_s": [round(t, 3) for t in resumes],
        "stall_mean_s": round(stall_mean, 3),
        "prefill_s": round(prefill_s, 3),
        "prefill_tokens": longest,
        "bound_one_s": round(bound, 3),
        "batch_prefill_s": round(batch_s, 3),
        "batch_prefill": f"{int(failovers)} x {each} tokens",
        "bound_all_s": round(bound_all, 3),
    }
    if ns.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    det = "not found in the log" if detect_s is None else f"{detect_s:.3f} s"
    print(f"goal failed: {len(failed)} (goal 0); identical: {identical}/{len(bodies)} (goal all)")
    print(f"goal detection: {det} (goal < 1 s)")
    print(
        f"goal gap: largest inter-token gap {gap:.3f} s (fault-free {gap_ref:.3f} s) vs detection + one idle "
        f"prefill of one continuation, {longest} tokens ({prefill_s:.3f} s) = {bound:.3f} s; detection + the "
        f"batched recompute of all {int(failovers)} continuations ({batch_s:.3f} s) = {bound_all:.3f} s"
    )
    return 0 if not failed and identical == len(bodies) else 1


if __name__ == "__main__":
    sys.exit(main())
