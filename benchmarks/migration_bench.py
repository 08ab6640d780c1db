"""Migration of retracted requests between decode workers: its two goals, measured in one run.

``python -m benchmarks.migration_bench [--part kv|serve|both] [--backend nixl|ucxx] [--copy-threads 0,2]
[--trace] [--migrate-on-retract] [--migrate-queued] [--decode-workers N] [--long N --long-max-tokens M
--long-prompt-words W --long-delay-s S --short-delay-s S] [--per-request] [--json]``

The last two lines printed are the goals' ratios (``goal serve: ...``, ``goal kv: ...``).

1. ``kv``: a 2,048-token request's KV (SmolLM2-135M geometry, fp32, page 16: 128 pages of
   737,280 bytes) written by the real transport (``--backend``, default NIXL) from a host pool registered with it
   into shuffled pages of a decode-side pool in another process, to the handle's ``done``, vs a local resume
   (``HostKVPool.load`` into shuffled pages of a pool in this process). Both destination pools are allocated as a
   decode worker's KV pool is (``cache.pool_memory.zeroed``, transparent huge pages where the host allows). NIXL
   uses the migration transport's ``--migration-copy-threads`` (``--copy-threads``; a list measures each,
   interleaved); ucxx, whose target pulls the pages, uses the same list as the target's copy lanes (the decode
   worker's ``--ucxx-copy-lanes``: that many UCX workers, each on its own thread, pull the pages in parallel;
   ``transfer/ucxx_lanes.py``). Per variant: the time inside ``write_pages`` (NIXL without copy threads: the whole
   CMA copy happens there), from its return to ``done`` (ucxx: the target pulls the pages then), and the descriptors
   left after merging runs adjacent on both sides; ``--trace`` prints every write. Goal: migration within 1.5x of
   the local resume. Median and min over ``--reps``.
2. ``serve``: ``pdserve launch --mode pd --decode 2 --route-decode decode-0`` (every request on
   one decode worker, whose small pool makes it retract: 32 streamed essay prompts of 128 greedy tokens each, 10
   pages apiece at the end, into 64-page pools, admitted at a ``new_token_ratio`` of 0.05) run twice on the same
   prompts: without and with ``--migrate-after`` (plus ``--migrate-queued`` when given: requests waiting for pages
   move before their prefill; plus ``--migrate-on-retract`` when given: live migration for balance, a request is
   offered the moment it is retracted). Each decode worker is pinned to its own half of the cores (``--decode-cores
   split``, the default: a device each, which is what migration is for; ``shared`` lets both use every core, where
   moving work to the idle one adds no compute). ``--rate R`` sends them as Poisson arrivals at R per second instead
   (the same schedule in both runs): a sustained skewed load. One untimed warm-up request first. Per run: failed
   requests, retractions and migrations (from ``/metrics``), and the end-to-end P50/P99 latency of the retracted
   requests. A request counts as retracted when the longest gap between two of its streamed tokens exceeds
   ``--gap-factor`` times the run's median inter-token gap (a parked request's stream stops while it waits). Goal:
   P99 with migration <= 0.5x without, both over each run's own retracted requests and over the same requests (those
   retracted without migration); 0 failed; tokens equal across the runs (greedy). Bound: the burst's demand is ~2.5x
   both pools, so a second decode worker at best halves the makespan, which the retracted requests' P99 follows:
   ~0.5x is the ceiling, not a margin.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

import numpy as np
import torch

from bench.transfer_bench import PAGE, VARIANTS, _decode_side, close_pair, fill_pages, page_bytes, pool_shape
from benchmarks.migration_serve import serve_part
from cache.host_pool import HostKVPool
from configs.schema import ClusterConfig

#: The decode worker's default ``--migration-copy-threads`` (what its NIXL migration transport uses).
DEFAULT_COPY = ClusterConfig.model_fields["migration_copy_threads"].default
#: The decode worker's default ``--ucxx-copy-lanes`` (its ucxx transport's receiving lanes).
DEFAULT_LANES = ClusterConfig.model_fields["ucxx_copy_lanes"].default


# ---- 1. KV: migration write vs local resume ------------------------------------------------------
def _runs(src: list[int], dst: list[int]) -> int:
    """Descriptors NIXL leaves after merging pages adjacent on both sides."""
    return 1 + sum(1 for i in range(1, len(src)) if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1) if src else 0


class _Migrator:
    """One transport variant: a decode-side process (its pool allocated as a decode worker's) and
    this process's transport over the shared host pool. ``copy_threads``: NIXL's copy threads on
    this (the writing) side, or ucxx's copy lanes on the decode side (its target pulls)."""

    def __init__(self, backend: str, copy_threads: int, host: HostKVPool, num_pages: int) -> None:
        from transfer.factory import create_transport

        kind, opts = VARIANTS[backend]
        if kind == "nixl":
            opts = {**opts, "copy_threads": copy_threads}
            target_opts = opts
        else:
            target_opts = {**opts, "copy_lanes": copy_threads}
        self.label = f"{backend} " + ("copy_threads" if kind == "nixl" else "copy_lanes") + f"={copy_threads}"
        self.kind, self.copy_threads = kind, copy_threads
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_side, args=(child, num_pages, kind, target_opts, True), daemon=True)
        self.proc.start()
        self.t = None
        if not self.conn.poll(60):
            raise RuntimeError(f"{self.label}: decode-side process published no metadata")
        md = self.conn.recv_bytes()
        self.t = create_transport(kind, f"bench-migrate-source-{len(self.label)}-{copy_threads}", **opts)
        self.t.register_pool(host.buffer, host.page_bytes)
        self.peer = self.t.add_peer(md)
        self.total, self.post, self.complete = [], [], []

    def write(self, src: np.ndarray, dst: np.ndarray, keep: bool) -> tuple[float, float]:
        """One write to ``done``: (seconds in ``write_pages``, seconds from its return to done)."""
        t0 = time.perf_counter()
        h = self.t.write_pages(self.peer, src, dst, b"migration")
        t1 = time.perf_counter()
        state = h.wait(60)
        t2 = time.perf_counter()
        h.release()
        if state != "done":
            raise RuntimeError(f"{self.label} write ended {state}: {h.error}")
        if keep:
            self.total.append(t2 - t0)
            self.post.append(t1 - t0)
            self.complete.append(t2 - t1)
        return t1 - t0, t2 - t1

    def summary(self, nbytes: int) -> dict:
        med = statistics.median(self.total)
        return {
            "label": self.label,
            "copy_threads": self.copy_threads,
            "migrate_ms_median": med * 1e3,
            "migrate_ms_min": min(self.total) * 1e3,
            "post_ms_median": statistics.median(self.post) * 1e3,
            "complete_ms_median": statistics.median(self.complete) * 1e3,
            "gbps": nbytes / med / 1e9,
        }

    def close(self) -> None:
        close_pair(self.t, self.proc, self.conn)


def kv_part(
    backend: str,
    tokens: int,
    reps: int,
    seed: int = 0,
    copy_threads: tuple[int, ...] = (DEFAULT_COPY,),
    trace: bool = False,
) -> dict:
    """Every variant (one per ``copy_threads`` value: NIXL copy threads, ucxx copy lanes) and the local
    resume, interleaved per rep on the same host pages; the headline (``migrate_ms_*``, ``ratio``) is
    the last variant."""
    from cache.host_pool import HostKV
    from cache.pool_memory import zeroed

    n = tokens // PAGE
    rng = np.random.default_rng(seed)
    host = HostKVPool(2 * n, pool_shape(1)[1:], torch.float32, pinned=torch.cuda.is_available())
    fill_pages(host.buffer.view(pool_shape(2 * n)))
    device = zeroed(pool_shape(4 * n), torch.float32, "cpu")  # a decode worker's pool, as the targets'
    threads = copy_threads
    movers: list[_Migrator] = []
    resume, descs = [], []
    try:
        for c in threads:
            movers.append(_Migrator(backend, c, host, 4 * n))
        for i in range(reps + 1):
            src = host.allocator.alloc(n)
            for m in movers:
                dst = rng.permutation(4 * n)[:n].astype(np.int32)
                descs.append(_runs(src, dst.tolist()) if m.kind == "nixl" else n + 1)
                post, done = m.write(np.asarray(src, dtype=np.int32), dst, keep=i > 0)
                if trace:
                    unit = "descriptors" if m.kind == "nixl" else "messages"
                    print(
                        f"trace rep {i} {m.label}: write_pages {post * 1e3:.2f} ms, then done after "
                        f"{done * 1e3:.2f} ms ({descs[-1]} {unit})",
                        file=sys.stderr,
                    )
            dev_pages = rng.permutation(4 * n)[:n].tolist()
            t0 = time.perf_counter()
            host.load(device.view(4 * n, -1), HostKV(src, tokens), dev_pages)  # frees the host pages
            dr = time.perf_counter() - t0
            if trace:
                print(f"trace rep {i} local resume: {dr * 1e3:.2f} ms", file=sys.stderr)
            if i:  # the first rep touches cold pages
                resume.append(dr)
    finally:
        for m in movers:
            m.close()
    nbytes = n * page_bytes()
    variants = [m.summary(nbytes) for m in movers]
    res = statistics.median(resume)
    for v in variants:
        v["ratio"] = v["migrate_ms_median"] / 1e3 / res
    head = variants[-1]
    # NIXL: descriptors after merging adjacent runs; ucxx: tagged messages (a header + one per page)
    return {
        "tokens": tokens,
        "pages": n,
        "bytes": nbytes,
        "backend": backend,
        "writes_per_migration": 1,
        "descriptors_or_messages_median": statistics.median(descs),
        "variants": variants,
        "migrate_ms_median": head["migrate_ms_median"],
        "migrate_ms_min": head["migrate_ms_min"],
        "resume_ms_median": res * 1e3,
        "resume_ms_min": min(resume) * 1e3,
        "ratio": head["ratio"],
        "goal_met": head["ratio"] <= 1.5,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _kv_flags(ap)
    _serve_flags(ap)
    _serve_setup_flags(ap)
    return ap


def _kv_flags(ap: argparse.ArgumentParser) -> None:
    """The part to run and the kv part's flags."""
    ap.add_argument("--part", choices=("kv", "serve", "both"), default="both")
    ap.add_argument("--backend", choices=("nixl", "ucxx"), default="nixl")
    ap.add_argument("--tokens", type=int, default=2048, help="kv: the request's tokens")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--copy-threads",
        default=None,
        help="kv: NIXL: the migration transport's copy threads (--migration-copy-threads, default "
        f"{DEFAULT_COPY}); ucxx: the target's copy lanes (--ucxx-copy-lanes, default {DEFAULT_LANES}); "
        "a comma list (0,2) measures each, interleaved in one run, the last one is the headline",
    )
    ap.add_argument("--trace", action="store_true", help="kv: print every write's phases to stderr")


def _serve_flags(ap: argparse.ArgumentParser) -> None:
    """The serve part's load: requests, arrivals, lengths."""
    ap.add_argument("--requests", type=int, default=32, help="serve: streamed requests")
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="serve: Poisson arrivals at this many requests/s (the same schedule in both runs); "
        "0 = all at once (one burst)",
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--long",
        type=int,
        default=0,
        help="serve: the first N requests are long (--long-max-tokens, a longer prompt): a mixed-length "
        "skewed load, where the short ones are parked while the long ones hold the pool",
    )
    ap.add_argument("--long-max-tokens", type=int, default=512)
    ap.add_argument(
        "--long-prompt-words",
        type=int,
        default=0,
        help="serve: the --long requests' prompts open with this many words of background notes",
    )
    ap.add_argument(
        "--short-delay-s",
        type=float,
        default=0.0,
        help="serve: the other (short) requests are sent this long after the --long ones (long answers "
        "under way when short ones arrive)",
    )
    ap.add_argument(
        "--long-delay-s",
        type=float,
        default=0.0,
        help="serve: the --long requests are sent this long after the short ones (short answers under "
        "way when long essays arrive: the victims, most output first, are then the short ones)",
    )


def _serve_setup_flags(ap: argparse.ArgumentParser) -> None:
    """The serve part's servers (pools, migration, cores) and what it prints."""
    ap.add_argument("--pool-tokens", type=int, default=1024, help="serve: every worker's KV pool (decode-0 retracts)")
    ap.add_argument("--migrate-after", default="4", help="serve: the --migrate-after of the run with migration")
    ap.add_argument(
        "--gap-factor",
        type=float,
        default=5.0,
        help="serve: a retracted request's longest token gap exceeds this x the median gap",
    )
    ap.add_argument(
        "--migrate-queued",
        action="store_true",
        help="serve: the run with migration also moves requests waiting for pages (before their prefill)",
    )
    ap.add_argument(
        "--migrate-on-retract",
        action="store_true",
        help="serve: the run with migration also offers a request the moment it is retracted",
    )
    ap.add_argument(
        "--step-delay-s",
        type=float,
        default=0.0,
        help="serve: every worker sleeps this long after each step (--test-step-delay-s): model-like "
        "steps whose time does not come out of the host's shared cores",
    )
    ap.add_argument(
        "--decode-cores",
        choices=("split", "shared"),
        default="split",
        help="serve: split: each decode worker pinned to its own half of the cores (a device each); "
        "shared: every worker on every core",
    )
    ap.add_argument(
        "--decode-workers",
        type=int,
        default=2,
        help="serve: decode workers (decode-0 gets every request; the others are its peers and "
        "share the other half of the cores under --decode-cores split)",
    )
    ap.add_argument("--server-args", default="", help="serve: more pdserve launch flags for both runs")
    ap.add_argument("--per-request", action="store_true", help="serve: print every request's e2e and longest gap")
    ap.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out = {}
    if args.part in ("kv", "both"):
        spec = args.copy_threads or str(DEFAULT_COPY if args.backend == "nixl" else DEFAULT_LANES)
        threads = tuple(int(x) for x in spec.split(","))
        out["kv"] = kv_part(args.backend, args.tokens, args.reps, copy_threads=threads, trace=args.trace)
    if args.part in ("serve", "both"):
        out["serve"] = serve_part(args)
    print(json.dumps(out, indent=None if args.json else 2))
    for line in goal_lines(out):
        print(line)


def _num(x: float | None, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:.3g}{unit}"


def goal_lines(out: dict) -> list[str]:
    """The two goals as one line each, for the parts that ran: the serve part's P99 ratio
    of the retracted requests (with / without migration; goal <= 0.5, 0 failed, tokens identical)
    and the kv part's migration / local resume time of one request (goal <= 1.5)."""
    lines = []
    if (s := out.get("serve")) is not None:
        w, o = s["with"], s["without"]
        lines.append(
            f"goal serve: P99 e2e of retracted requests with/without migration = {_num(s['p99_ratio'])} "
            f"({_num(w['p99_s'], 's')} / {_num(o['p99_s'], 's')}), of the requests retracted without it "
            f"{_num(s.get('matched_p99_ratio'))} (goal: both <= 0.5), failed {w['failed']}+"
            f"{o['failed']}, tokens identical {s['tokens_identical']}, migrations {w['migrations']:g}, "
            f"queued moves {w.get('queued_moves', 0):g}, retracted requests "
            f"{w['retracted_requests']}/{o['retracted_requests']}, all requests' P99 "
            f"{_num(w['all_p99_s'] / o['all_p99_s'] if o['all_p99_s'] else None)}x, their longest stall's "
            f"P99 {_num(s.get('stall_p99_ratio'))}x: "
            f"{'met' if s['goal_met'] else 'NOT met'}"
        )
    if (k := out.get("kv")) is not None:
        lines.append(
            f"goal kv: {k['tokens']}-token migration / local resume = {_num(k['ratio'])} "
            f"({k['migrate_ms_median']:.3g} ms / {k['resume_ms_median']:.3g} ms median, {k['backend']}; "
            f"goal <= 1.5): {'met' if k['goal_met'] else 'NOT met'}"
        )
    return lines


if __name__ == "__main__":
    main()
