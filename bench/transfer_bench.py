"""KV page transfer benchmark: each data plane (NIXL WRITE, ucxx tagged pages) between two
processes vs an in-process numpy memcpy of the same pages, measured side by side in one run.

``pdserve bench transfer [--backend nixl,ucxx] [--ucxx-error-handling off|on|both] [--dead-peer]``
or ``python -m bench.transfer_bench [--tokens 128 512 2048] [--reps 10] [--json] ...``

Pools are page-major fp32 like SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, page 16 tokens
-> 737,280 bytes per page. A ``--tokens`` request is ``tokens / 16`` pages taken from shuffled
prefill pages and written into shuffled (free-list order) decode pages of a separate decode
process, which polls notifications in a tight loop. Reported per write: milliseconds from
``write_pages`` to handle ``done`` (median and min over ``--reps`` after a warm-up; the first,
cold write into never-touched pages is reported separately) and GB/s. Also a contiguous->contiguous
write (NIXL merges it into one descriptor) and the numpy baselines in one process: fancy-index
gather/scatter ``dst[d] = src[s]`` (two copies) and a per-page copy loop (one copy, the
"memcpy" the ratios divide by). ``--dead-peer`` also times how long a write to a killed decode
process takes to be reported failed (ucxx without error handling: its write deadline).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np
import torch

from cache.page_allocator import ceil_div

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 30, 3, 64, 16


def pool_shape(num_pages: int) -> tuple[int, ...]:
    return (num_pages, LAYERS, 2, PAGE, KV_HEADS, HEAD_DIM)


def page_bytes() -> int:
    return LAYERS * 2 * PAGE * KV_HEADS * HEAD_DIM * 4


def fill_pages(buf: torch.Tensor) -> None:
    words = buf.view(buf.shape[0], -1).view(torch.int32)
    words.copy_(
        torch.arange(buf.shape[0], dtype=torch.int32)[:, None] * 7919
        + torch.arange(words.shape[1], dtype=torch.int32)[None, :]
    )


#: Backend variants: label -> (backend, transport options).
VARIANTS = {
    "nixl": ("nixl", {}),
    "ucxx": ("ucxx", {"error_handling": False}),
    "ucxx-eh": ("ucxx", {"error_handling": True}),
}


def _decode_side(conn, num_pages: int, backend: str, opts: dict, real_pool: bool = False) -> None:
    """Target: zeroed pool, publish metadata, poll notifications; verify pages on request.
    ``real_pool``: the pool is allocated as a decode worker's is (``cache.pool_memory.zeroed``: on
    transparent huge pages where the host allows), else a plain ``torch.zeros``."""
    from cache.pool_memory import zeroed
    from transfer.factory import create_transport

    t = create_transport(backend, "bench-decode", **opts)
    shape = pool_shape(num_pages)
    buf = zeroed(shape, torch.float32, "cpu") if real_pool else torch.zeros(shape, dtype=torch.float32)
    t.register_pool(buf, page_bytes())
    conn.send_bytes(t.local_metadata())
    n_notifs = 0
    while True:
        n_notifs += len(t.poll_notifs())
        if conn.poll():
            cmd = conn.recv()
            if cmd[0] == "bye":
                break
            if cmd[0] == "verify":  # (src ids, dst ids, notifs expected so far)
                _, src, dst, want = cmd
                deadline = time.monotonic() + 10
                while n_notifs < want and time.monotonic() < deadline:
                    n_notifs += len(t.poll_notifs())
                ref = torch.zeros(pool_shape(max(src) + 1), dtype=torch.float32)
                fill_pages(ref)
                words = lambda x, i: x[i].reshape(-1).view(torch.int32)  # noqa: E731 (bitwise, NaN-safe)
                ok = all(torch.equal(words(buf, d), words(ref, s)) for s, d in zip(src, dst))
                conn.send({"ok": ok, "notifs": n_notifs})
        time.sleep(0.0001)
    t.close()


def close_pair(transport, proc, conn) -> None:
    """Close this side's ``transport`` (if any), then ask the decode-side child ``proc`` to leave
    over ``conn``; kill it if it has not within 10 s."""
    if transport is not None:
        transport.close()
    if proc.is_alive():
        conn.send(("bye",))
        proc.join(10)
    if proc.is_alive():
        proc.kill()
    proc.join(5)


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _summary(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"ms_median": med * 1e3, "ms_min": min(times) * 1e3, "gbps_median": nbytes / med / 1e9}


def _layout(tokens: int, reps: int, seed: int):
    n = ceil_div(tokens, PAGE)
    rng = np.random.default_rng(seed)
    prefill_pages, decode_pages = n + n // 4, 2 * n
    src = rng.permutation(prefill_pages)[:n].astype(np.int32)
    dst_sets = [rng.permutation(decode_pages)[:n].astype(np.int32) for _ in range(reps + 2)]
    return n, prefill_pages, decode_pages, src, dst_sets


class _Pair:
    """A decode-side process and this process's initiator transport, for one backend variant."""

    def __init__(self, label: str, decode_pages: int, prefill_pages: int) -> None:
        from transfer.factory import create_transport

        backend, opts = VARIANTS[label]
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_side, args=(child, decode_pages, backend, opts), daemon=True)
        self.proc.start()
        self.t = None
        if not self.conn.poll(60):
            self.close()
            raise RuntimeError(f"{label}: decode-side process published no metadata")
        md = self.conn.recv_bytes()
        extra = {"capture_telemetry": True} if backend == "nixl" else {}
        self.t = create_transport(backend, "bench-prefill", **opts, **extra)
        self.pool = torch.empty(pool_shape(prefill_pages), dtype=torch.float32)
        fill_pages(self.pool)
        self.t.register_pool(self.pool, page_bytes())
        self.peer = self.t.add_peer(md)

    def write(self, s, d, timeout: float = 30) -> tuple[float, float, int]:
        """(seconds to done, seconds to post, NIXL descriptor count or -1)."""
        t0 = time.perf_counter()
        h = self.t.write_pages(self.peer, s, d, b"bench")
        t1 = time.perf_counter()
        state = h.wait(timeout)
        t2 = time.perf_counter()
        if state != "done":
            raise RuntimeError(f"{self.t.backend} write ended {state}: {h.error}")
        descs = -1
        xfer = getattr(h, "_xfer", None)
        if xfer is not None:
            try:
                descs = int(self.t.agent.get_xfer_telemetry(xfer).descCount)
            except Exception:
                pass
        h.release()
        return t2 - t0, t1 - t0, descs

    def verify(self, src, dst, notifs: int) -> None:
        self.conn.send(("verify", src.tolist(), dst.tolist(), notifs))
        if not self.conn.poll(30) or not self.conn.recv()["ok"]:
            raise RuntimeError(f"decode side found wrong bytes after the {self.t.backend} writes")

    def close(self) -> None:
        close_pair(self.t, self.proc, self.conn)


def measure(label: str, tokens: int, reps: int, seed: int = 0) -> dict:
    """Shuffled and contiguous writes of a ``tokens``-token request over one backend variant."""
    n, prefill_pages, decode_pages, src, dst_sets = _layout(tokens, reps, seed)
    nbytes = n * page_bytes()
    pair = _Pair(label, decode_pages, prefill_pages)
    try:
        cold = pair.write(src, dst_sets[0])
        pair.write(src, dst_sets[1])
        runs = [pair.write(src, d) for d in dst_sets[2:]]
        pair.verify(src, dst_sets[-1], reps + 2)
        contig = [pair.write(np.arange(n, dtype=np.int32), np.arange(n, 2 * n, dtype=np.int32)) for _ in range(reps)]
    finally:
        pair.close()
    return {
        "cold_ms": cold[0] * 1e3,
        "shuffled": {
            **_summary([r[0] for r in runs], nbytes),
            "post_ms_median": statistics.median(r[1] for r in runs) * 1e3,
            "descs": runs[0][2],
        },
        "contiguous": {**_summary([r[0] for r in contig], nbytes), "descs": contig[0][2]},
    }


def numpy_baselines(tokens: int, reps: int, seed: int = 0) -> dict:
    """In one process, same source pages into shuffled destination pages: fancy-index
    gather/scatter (two copies) and a per-page copy loop (one copy: the memcpy reference)."""
    n, prefill_pages, decode_pages, src, dst_sets = _layout(tokens, reps, seed)
    pb = page_bytes()
    pool = torch.empty(pool_shape(prefill_pages), dtype=torch.float32)
    fill_pages(pool)
    src_u8 = pool.view(-1).view(torch.uint8).numpy().reshape(prefill_pages, pb)
    dst_np = np.zeros((decode_pages, pb), dtype=np.uint8)
    dst_np[:] = 1  # touch every page once, like the warmed decode pool
    d = dst_sets[-1]

    def fancy():
        dst_np[d] = src_u8[src]

    def loop():
        for s_i, d_i in zip(src.tolist(), d.tolist()):
            dst_np[d_i] = src_u8[s_i]

    fancy()
    out = {"numpy_gather_scatter": _summary(_timed(fancy, reps), n * pb)}
    loop()
    out["numpy_page_loop"] = _summary(_timed(loop, reps), n * pb)
    if not np.array_equal(dst_np[d], src_u8[src]):
        raise RuntimeError("numpy baseline copied wrong bytes")
    return out


def dead_peer_seconds(label: str, write_timeout_s: float = 8.0) -> dict:
    """kill -9 the decode process after a warm write; time until the next write reports error."""
    pair = _Pair(label, 16, 16)
    try:
        if hasattr(pair.t, "write_timeout_s"):
            pair.t.write_timeout_s = write_timeout_s
        pair.write(np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32))
        pair.proc.kill()
        pair.proc.join(5)
        t0 = time.perf_counter()
        h = pair.t.write_pages(pair.peer, np.arange(4, dtype=np.int32), np.arange(4, 8, dtype=np.int32), b"x")
        state = h.wait(write_timeout_s + 30)
        took = time.perf_counter() - t0
        h.release()
        return {"state": state, "seconds": took, "error": h.error}
    finally:
        pair.close()


def _child(conn, fn, args) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))


def isolated(fn, *args, timeout: float = 300):
    """Run ``fn(*args)`` in a fresh process. Each backend is measured in its own process: with
    NIXL's bundled UCX and ucxx's UCX loaded into one process, NIXL writes got 20-60x slower."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"{fn.__name__}{args} did not finish within {timeout:g}s")
        status, value = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise RuntimeError(f"{fn.__name__}{args}: {value}")
    return value


def run(tokens: int = 2048, reps: int = 10, variants: tuple[str, ...] = ("nixl", "ucxx"), seed: int = 0) -> dict:
    n = ceil_div(tokens, PAGE)
    result: dict = {
        "tokens": tokens,
        "pages": n,
        "page_bytes": page_bytes(),
        "bytes": n * page_bytes(),
        "reps": reps,
        "backends": {},
    }
    for label in variants:
        result["backends"][label] = isolated(measure, label, tokens, reps, seed)
    result.update(numpy_baselines(tokens, reps, seed))
    return result


def _print(r: dict) -> None:
    memcpy = r["numpy_page_loop"]
    print(
        f"request: {r['tokens']} tokens = {r['pages']} pages x {r['page_bytes']:,} B "
        f"= {r['bytes'] / 1e6:.1f} MB, {r['reps']} reps (median / min); ratio = throughput / memcpy"
    )
    rows = []
    for label, b in r["backends"].items():
        rows += [(f"{label} shuffled->shuffled", b["shuffled"]), (f"{label} contiguous", b["contiguous"])]
    rows += [("numpy gather/scatter (1 proc)", r["numpy_gather_scatter"]), ("memcpy: numpy per-page (1 proc)", memcpy)]
    for label, s in rows:
        extra = f"  descs={s['descs']}" if s.get("descs", -1) >= 0 else ""
        print(
            f"  {label:34s} {s['ms_median']:7.2f} ms / {s['ms_min']:7.2f} ms  {s['gbps_median']:6.2f} GB/s  "
            f"x{s['gbps_median'] / memcpy['gbps_median']:.2f}{extra}"
        )
    cold = ", ".join(f"{k} {b['cold_ms']:.1f} ms" for k, b in r["backends"].items())
    print(f"  first (cold) write: {cold}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backend", default="nixl,ucxx", help="comma-separated: nixl, ucxx")
    ap.add_argument(
        "--ucxx-error-handling",
        choices=["off", "on", "both"],
        default="off",
        help="ucxx endpoint error handling to measure (off is the serving default)",
    )
    ap.add_argument("--dead-peer", action="store_true", help="also time a write to a killed decode process")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    variants = _variants(args.backend, args.ucxx_error_handling)
    results = [run(t, args.reps, variants) for t in args.tokens]
    dead = {v: isolated(dead_peer_seconds, v) for v in variants} if args.dead_peer else {}
    if args.json:
        print(json.dumps({"results": results, "dead_peer": dead}, indent=2))
        return
    for r in results:
        _print(r)
    for v, d in dead.items():
        print(f"dead peer ({v}): write ended {d['state']} after {d['seconds']:.3f} s: {d['error']}")


def _variants(backends: str, eh: str) -> tuple[str, ...]:
    out: list[str] = []
    for b in (x.strip() for x in backends.split(",") if x.strip()):
        if b == "nixl":
            out.append("nixl")
        elif b == "ucxx":
            out += {"off": ["ucxx"], "on": ["ucxx-eh"], "both": ["ucxx", "ucxx-eh"]}[eh]
        else:
            raise SystemExit(f"--backend: unknown backend {b!r} (expected nixl, ucxx)")
    return tuple(out)


if __name__ == "__main__":
    main()
