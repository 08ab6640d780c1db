"""``python -m bench.two_routers`` (``pdserve bench two-routers``): does a second router in front of
the same workers keep the throughput of one, and do the routers spread the load evenly? (the goal:
"two routers: the same throughput as one at c=32, and load spread within 20 % across decode
workers").

One run starts etcd, a cluster key, ONE set of workers (default 1 prefill + 2 decode, or
``--colocated N`` replicas; a workers-only ``pdserve launch``, so they get the thread split and core
lending of an ordinary launch) and two routers (``pdserve launch --roles router``) that find the
workers through etcd, each with a room tag claimed there. Then it alternates, ``--rounds`` times:

- phase A: the closed-loop load (``--concurrency`` clients, ``--num-requests`` requests) through
  router A alone (router B is up and idle);
- phase B: the same load split round-robin over both routers.

Every phase sends the same prompts behind a tag of its own (no phase hits another's radix cache).
It prints a row per phase (tok/s, req/s, TTFT p50/p99, TPOT p50, requests per router, requests and
tokens each worker finished, as counter deltas from the routers' ``/metrics``, and their spread
(max - min) / mean), the medians of A and B and B/A, and B's split pooled over its rounds. Any
failed request (an error, or another token count than asked) stops the run: it names the request
and the error and exits 1. Every process it started is stopped on exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
import time

from bench.multirouter.cluster import ClusterSpec, RouterCluster, StartError
from bench.multirouter.phases import PhaseResult, failed, run_phase, tagged
from bench.multirouter.table import Summary, phases_table
from bench.serve.client import ClientConfig, served_model
from bench.serve.runner import closed_loop
from bench.serve.workload import PromptShape, load_counter, make_requests


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m bench.two_routers`` / ``pdserve bench two-routers``."""
    p = argparse.ArgumentParser(
        prog="pdserve bench two-routers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("cluster")
    g.add_argument("--model", default="default", help="model of the workers (default: the embedded SmolLM2-135M)")
    g.add_argument("--dtype", default="bfloat16", help="as the serving benchmarks (default bfloat16)")
    g.add_argument("--kv-pool-tokens", type=int, default=16384, help="KV pool of each worker, tokens")
    g.add_argument("--prefill", type=int, default=1, help="PD: prefill workers")
    g.add_argument("--decode", type=int, default=2, help="PD: decode workers (the spread is over these)")
    g.add_argument(
        "--colocated",
        type=int,
        default=0,
        metavar="N",
        help="N colocated workers instead of PD (the spread is over these)",
    )
    g.add_argument("--heartbeat-s", type=float, default=1.0, help="workers' heartbeat period (--health-interval-s)")
    g.add_argument("--server-args", default="", help="more 'pdserve launch' flags for the workers and routers")
    g.add_argument("--startup-timeout-s", type=float, default=600.0)
    g = p.add_argument_group("load")
    g.add_argument("--concurrency", type=int, default=32, help="closed-loop clients of every phase")
    g.add_argument("--num-requests", type=int, default=96, help="measured requests of every phase")
    g.add_argument("--input-len-range", default="112,289", metavar="LO,HI", help="prompt tokens, uniform")
    g.add_argument("--output-len", type=int, default=64, help="max_tokens of every request (ignore_eos)")
    g.add_argument("--rounds", type=int, default=2, help="A B rounds (A B A B ...: drift cancels)")
    g.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="unmeasured requests over both routers first, at --concurrency and the full lengths, so "
        "the first phase (an A) pays no first-batch costs (default: --concurrency)",
    )
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--out", help="write the phases and the summary as JSON here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _validate(a: argparse.Namespace) -> tuple[int, int]:
    """The prompt length range; ``ValueError`` naming the flag that is out of range."""
    try:
        lo, hi = (int(x) for x in a.input_len_range.split(","))
    except ValueError:
        raise ValueError(f"--input-len-range takes LO,HI, got {a.input_len_range!r}") from None
    checks = {
        "--input-len-range (1 <= LO <= HI)": 1 <= lo <= hi,
        "--output-len >= 1": a.output_len >= 1,
        "--rounds >= 1": a.rounds >= 1,
        "--concurrency >= 1": a.concurrency >= 1,
        "--num-requests >= 1": a.num_requests >= 1,
        "--warmup >= 0": a.warmup is None or a.warmup >= 0,
        "--colocated >= 0": a.colocated >= 0,
        "--heartbeat-s > 0": a.heartbeat_s > 0,
        "--prefill >= 1 and --decode >= 2 (without --colocated)": a.colocated or (a.prefill >= 1 and a.decode >= 2),
        "--colocated N needs N >= 2 (a spread needs two workers)": a.colocated != 1,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"give {'; '.join(bad)}")
    return lo, hi


def cluster_spec(a: argparse.Namespace) -> ClusterSpec:
    """The ``ClusterSpec`` the flags describe (two routers)."""
    flags = (
        "--model",
        a.model,
        "--dtype",
        a.dtype,
        "--kv-pool-tokens",
        str(a.kv_pool_tokens),
        *shlex.split(a.server_args),
    )
    return ClusterSpec(a.prefill, a.decode, a.colocated, 2, flags, a.heartbeat_s, a.startup_timeout_s)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def measure(a: argparse.Namespace, cluster: RouterCluster, lo: int, hi: int) -> tuple[list[PhaseResult], int]:
    """Warm up, then the A/B phases; (every phase run, exit status: 1 once one had a failure)."""
    counter = load_counter(a.model)
    urls, spec = cluster.urls, cluster.spec
    model = served_model(urls[0])
    body = make_requests(PromptShape(a.num_requests, lo, hi, a.output_len), counter, a.workload_seed)
    both = ClientConfig(urls[0], model, base_urls=tuple(urls))
    warmup = a.concurrency if a.warmup is None else a.warmup
    if warmup:
        warm = tagged(
            make_requests(PromptShape(warmup, lo, hi, a.output_len), counter, a.workload_seed + 1), 0, counter
        )
        _say(f"two-routers: warm-up, {warmup} requests over both routers")
        bad = failed(asyncio.run(closed_loop(both, warm, a.concurrency, progress=False)).results)
        if bad:
            raise RuntimeError(f"warm-up request {bad[0].index} failed: {bad[0].error}")
    phases: list[PhaseResult] = []
    for r in range(1, a.rounds + 1):
        for kind, cfg in (("A", ClientConfig(urls[0], model)), ("B", both)):
            name = f"{kind}{r}"
            p = run_phase(
                name,
                cfg,
                tagged(body, len(phases) + 1, counter),
                a.concurrency,
                urls,
                spec.spread_ids(),
                spec.heartbeat_s,
                not a.no_progress,
                cluster.processes(),
            )
            phases.append(p)
            s = p.stats
            _say(
                f"{name}: {s.output_throughput:.1f} tok/s, {s.request_throughput:.2f} req/s, "
                f"{len(p.failures)} failed, finished per {spec.worker_role} worker {p.split.finished}"
            )
            if p.failures:
                for f in p.failures[:10]:
                    _say(f"  {name}: request {f.index} via {cfg.url_for(f.index)} failed: {f.error}")
                return phases, 1
    return phases, 0


def report(a: argparse.Namespace, cluster: RouterCluster, phases: list[PhaseResult], tags: list[int]) -> dict:
    """Print the tables; return the JSON payload."""
    names = {u: f"router-{chr(ord('a') + i)}" for i, u in enumerate(cluster.urls)}
    print(
        f"\nrouters: {', '.join(f'{n} {u}' for u, n in names.items())}; room tags claimed in etcd: "
        f"{tags}; workers: {', '.join(cluster.spec.worker_ids())}"
    )
    print(phases_table(phases, names))
    summary = Summary.of(phases)
    print("\n" + summary.table())
    print()
    for line in [*summary.spread_lines(cluster.spec.worker_role), *summary.verdict()]:
        print(line)
    return {
        "benchmark": "pdserve bench two-routers",
        "argv": sys.argv[1:],
        "settings": vars(a),
        "routers": names,
        "router_tags": tags,
        "phases": [p.to_dict() for p in phases],
        "summary": summary.to_dict(),
    }


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cluster's __exit__: every process is stopped


def _claimed_tags(cluster: RouterCluster, timeout_s: float = 30.0) -> list[int]:
    """The routers' room tags in etcd once both are there (a router claims its tag in the background
    as it starts, and a loaded host can show it a moment after ``/health``), or what is there at
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while len(set(tags := cluster.router_tags())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return tags


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every request succeeded, 1 on a failed request or a cluster that
    did not start, 2 on invalid flags."""
    a = build_parser().parse_args(argv)
    try:
        lo, hi = _validate(a)
    except ValueError as e:
        print(f"pdserve bench two-routers: {e}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        _say(f"two-routers: starting etcd, the workers ({', '.join(cluster_spec(a).worker_ids())}) and two routers")
        with RouterCluster(cluster_spec(a)) as cluster:
            tags = _claimed_tags(cluster)
            if len(set(tags)) != 2:
                print(
                    f"pdserve bench two-routers: the routers claimed {len(set(tags))} distinct room tag(s) in etcd, "
                    f"expected 2: {tags}",
                    file=sys.stderr,
                )
                return 1
            try:
                phases, status = measure(a, cluster, lo, hi)
            except RuntimeError as e:  # a failed warm-up request
                print(f"pdserve bench two-routers: {e}", file=sys.stderr)
                return 1
            payload = report(a, cluster, phases, tags)
    except (StartError, RuntimeError) as e:
        print(f"pdserve bench two-routers: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve bench two-routers: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"results: {a.out}")
    if status:
        print("pdserve bench two-routers: a request failed (above); the figures cover the phases run so far")
    return status


if __name__ == "__main__":
    sys.exit(main())
