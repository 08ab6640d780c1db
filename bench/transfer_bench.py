"""KV page transfer benchmark: NIXL WRITE between two processes vs an in-process numpy memcpy.

``python -m bench.transfer_bench [--tokens 128 512 2048] [--reps 10] [--json]``

Pools are page-major fp32 like SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, page 16 tokens
-> 737,280 bytes per page. A ``--tokens`` request is ``tokens / 16`` pages taken from shuffled
prefill pages and written into shuffled (free-list order) decode pages of a separate decode
process, which polls notifications in a tight loop. Reported per write: milliseconds from
``write_pages`` to handle ``done`` (median and min over ``--reps`` after a warm-up; the first,
cold write into never-touched pages is reported separately) and GB/s. Also a contiguous->contiguous
write (NIXL merges it into one descriptor) and the numpy baselines in one process: fancy-index
gather/scatter ``dst[d] = src[s]`` (two copies) and a per-page copy loop (one copy).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np
import torch

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 30, 3, 64, 16


def pool_shape(num_pages: int) -> tuple[int, ...]:
    return (num_pages, LAYERS, 2, PAGE, KV_HEADS, HEAD_DIM)


def page_bytes() -> int:
    return LAYERS * 2 * PAGE * KV_HEADS * HEAD_DIM * 4


def fill_pages(buf: torch.Tensor) -> None:
    words = buf.view(buf.shape[0], -1).view(torch.int32)
    words.copy_(torch.arange(buf.shape[0], dtype=torch.int32)[:, None] * 7919
                + torch.arange(words.shape[1], dtype=torch.int32)[None, :])


def _decode_side(conn, num_pages: int) -> None:
    """Target: zeroed pool, publish metadata, poll notifications; verify pages on request."""
    from transfer.nixl_transport import NixlTransport

    t = NixlTransport("bench-decode")
    buf = torch.zeros(pool_shape(num_pages), dtype=torch.float32)
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


def _timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(tokens: int = 2048, reps: int = 10, seed: int = 0) -> dict:
    from transfer.nixl_transport import NixlTransport

    n = -(-tokens // PAGE)
    pb = page_bytes()
    nbytes = n * pb
    prefill_pages, decode_pages = n + n // 4, 2 * n
    rng = np.random.default_rng(seed)
    src = rng.permutation(prefill_pages)[:n].astype(np.int32)
    dst_sets = [rng.permutation(decode_pages)[:n].astype(np.int32) for _ in range(reps + 2)]

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child, decode_pages), daemon=True)
    proc.start()
    result: dict = {"tokens": tokens, "pages": n, "page_bytes": pb, "bytes": nbytes, "reps": reps}
    t = None
    try:
        if not conn.poll(60):
            raise RuntimeError("decode-side process published no metadata")
        md = conn.recv_bytes()
        t = NixlTransport("bench-prefill", capture_telemetry=True)
        pool = torch.empty(pool_shape(prefill_pages), dtype=torch.float32)
        fill_pages(pool)
        t.register_pool(pool, pb)
        peer = t.add_peer(md)

        def write(s, d) -> tuple[float, float, int]:
            t0 = time.perf_counter()
            h = t.write_pages(peer, s, d, b"bench")
            t1 = time.perf_counter()
            state = h.wait(30)
            t2 = time.perf_counter()
            if state != "done":
                raise RuntimeError(f"NIXL write ended {state}: {h.error}")
            descs = -1
            xfer = getattr(h, "_xfer", None)
            if xfer is not None:
                try:
                    descs = int(t.agent.get_xfer_telemetry(xfer).descCount)
                except Exception:
                    pass
            h.release()
            return t2 - t0, t1 - t0, descs

        cold = write(src, dst_sets[0])
        write(src, dst_sets[1])
        runs = [write(src, d) for d in dst_sets[2:]]
        conn.send(("verify", src.tolist(), dst_sets[-1].tolist(), reps + 2))
        if not conn.poll(30) or not conn.recv()["ok"]:
            raise RuntimeError("decode side found wrong bytes after the NIXL writes")
        contig = [write(np.arange(n, dtype=np.int32), np.arange(n, 2 * n, dtype=np.int32))
                  for _ in range(reps)]
        conn.send(("bye",))
        proc.join(10)

        def summary(times: list[float]) -> dict:
            med = statistics.median(times)
            return {"ms_median": med * 1e3, "ms_min": min(times) * 1e3, "gbps_median": nbytes / med / 1e9}

        result["nixl_cold_ms"] = cold[0] * 1e3
        result["nixl_shuffled"] = {**summary([r[0] for r in runs]),
                                   "post_ms_median": statistics.median(r[1] for r in runs) * 1e3,
                                   "descs": runs[0][2]}
        result["nixl_contiguous"] = {**summary([r[0] for r in contig]), "descs": contig[0][2]}

        # numpy baselines, one process: same source pages, shuffled destination pages.
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
        result["numpy_gather_scatter"] = summary(_timed(fancy, reps))
        loop()
        result["numpy_page_loop"] = summary(_timed(loop, reps))
        if not np.array_equal(dst_np[d], src_u8[src]):
            raise RuntimeError("numpy baseline copied wrong bytes")
    finally:
        if t is not None:
            t.close()
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    return result


def _print(r: dict) -> None:
    print(f"request: {r['tokens']} tokens = {r['pages']} pages x {r['page_bytes']:,} B "
          f"= {r['bytes'] / 1e6:.1f} MB, {r['reps']} reps (median / min)")
    rows = [("NIXL WRITE shuffled->shuffled", r["nixl_shuffled"]),
            ("NIXL WRITE contiguous", r["nixl_contiguous"]),
            ("numpy gather/scatter (1 proc)", r["numpy_gather_scatter"]),
            ("numpy per-page copy (1 proc)", r["numpy_page_loop"])]
    for label, s in rows:
        extra = f"  descs={s['descs']}" if "descs" in s else ""
        print(f"  {label:32s} {s['ms_median']:7.2f} ms / {s['ms_min']:7.2f} ms  "
              f"{s['gbps_median']:6.2f} GB/s{extra}")
    nixl, memcpy = r["nixl_shuffled"], r["numpy_page_loop"]
    print(f"  per-request transfer latency {nixl['ms_median']:.2f} ms; NIXL / in-process memcpy throughput "
          f"{nixl['gbps_median'] / memcpy['gbps_median']:.2f}x; first (cold) write {r['nixl_cold_ms']:.2f} ms")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    results = [run(t, args.reps) for t in args.tokens]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        _print(r)


if __name__ == "__main__":
    main()
