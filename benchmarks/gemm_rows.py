"""Matmul throughput by row count: does a step's size or its thread count cost GEMM efficiency?

``python -m benchmarks.gemm_rows [--rows 32,64,128,256,512] [--threads 1,2] [--dtype bfloat16]``

Runs the model's four projections per layer (SmolLM2-135M: qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576) over 30 layers through ``engine.cpu_linear.linear`` (the serving path:
oneDNN's packed primitive, the small-batch kernel for the rows it takes) at each row count, best of
``--reps`` rounds (the row counts alternating) after a warm-up, and prints ms per step and GFLOP/s.
Each thread count runs in its own process (oneDNN builds its kernels per thread count). On a 2-core Zen 4:
375-406 GFLOP/s from 64 to 512 rows on two threads, 198-207 on one.

``--kernels onednn,pairs,gemv,pairs-int8,gemv-int8`` instead times each kernel alone on 30 layers of
distinct weights (212 MB in bfloat16: they stream from memory, as a decode step's do), the kernels
alternating: oneDNN's packed primitive, the pair-panel kernel (``cpu_gemm_pairs.c``) and
``cpu_gemv.c`` (up to 8 rows), the int8 ones on weight-only int8 weights. Same host,
``--rows 1,2,4,8,16,32,64 --threads 2``: 1 row 4.6-6.7 ms (pairs) against 6.7-7.7 (gemv) and 7.4-8.6
(oneDNN); 32 rows 21.2 against oneDNN 24.5; 64 rows 38 against 44; int8 1 row 3.5-3.9 against 4.5-4.7.
``onednn-f32,panels-f32``: the same in float32 (424 MB), oneDNN's packed primitive against the float32
panel kernel (same host: 1 row 9.4 against 17.6 ms, 32 rows 34.6 against 39.7).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) per layer
LAYERS = 30


def measure(rows: list[int], dtype: str, reps: int) -> list[tuple[int, float, float]]:
    """``(rows, ms per 30-layer step, GFLOP/s)`` for each row count, in this process's threads."""
    import torch

    from engine import cpu_linear
    from engine.kernels.decode_prefetch import best_of

    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    ws = [cpu_linear.pack(torch.randn(o, i, dtype=dt) * 0.02) for o, i in SHAPES]
    flop_row = sum(2 * o * i for o, i in SHAPES) * LAYERS

    def step(xs: list) -> None:
        for _ in range(LAYERS):
            for x, w in zip(xs, ws):
                cpu_linear.linear(x, w)

    inputs = {m: [torch.randn(m, i, dtype=dt) for _, i in SHAPES] for m in rows}
    for xs in inputs.values():  # warm-up: oneDNN builds a primitive per shape
        step(xs)
    best = best_of({m: (lambda xs=xs: step(xs)) for m, xs in inputs.items()}, reps)  # row counts alternate
    return [(m, best[m] * 1e3, flop_row * m / best[m] / 1e9) for m in rows]


def measure_kernels(rows: list[int], kernels: list[str], reps: int) -> list[tuple[int, str, float]]:
    """``(rows, kernel, ms per 30-layer step)`` for each row count and kernel (bfloat16 activations)."""
    import torch

    from engine import cpu_linear
    from engine.kernels import cpu_native
    from engine.kernels.decode_prefetch import best_of, modes

    torch.manual_seed(0)
    ws = [[(torch.randn(o, i) * 0.02).bfloat16() for o, i in SHAPES] for _ in range(LAYERS)]
    q8 = [[cpu_linear.quantize_int8(w) for w in layer] for layer in ws]
    prep = {
        "onednn": lambda w, q: cpu_linear.onednn_layout(w),
        "pairs": lambda w, q: cpu_linear.to_pairs(w),
        "gemv": lambda w, q: w,
        "pairs-int8": lambda w, q: q,
        "gemv-int8": lambda w, q: q,
        "onednn-f32": lambda w, q: cpu_linear.onednn_layout(w.float()),
        "panels-f32": lambda w, q: cpu_linear.to_panels_f32(w.float()),
    }
    mm = {
        "onednn": lambda x, p, w: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
        "pairs": lambda x, p, w: cpu_native.gemm_pairs(x, p, w.shape[0], None),
        "gemv": lambda x, p, w: cpu_native.gemv_bf16(x, p, None, modes().gemv),
        "pairs-int8": lambda x, p, w: cpu_native.gemm_pairs(x, p.pairs, w.shape[0], None, p.scale),
        "gemv-int8": lambda x, p, w: cpu_native.gemv_i8w(x, p.q, p.scale, None, modes().gemv),
        "onednn-f32": lambda x, p, w: torch.ops.mkldnn._linear_pointwise(x.float(), p, None, "none", [], ""),
        "panels-f32": lambda x, p, w: cpu_native.gemm_panels_f32(x.float(), p, w.shape[0], None),
    }
    weights = {k: [[(prep[k](w, q), w) for w, q in zip(lw, lq)] for lw, lq in zip(ws, q8)] for k in kernels}
    out = []
    for m in rows:
        xs = {i: torch.randn(m, i).bfloat16() for _, i in SHAPES}
        xs32 = {i: x.float() for i, x in xs.items()}  # the float32 kernels' inputs, converted once
        ks = [k for k in kernels if not (k.startswith("gemv") and m > cpu_native.GEMV_MAX_ROWS)]
        runs = {
            k: (
                lambda k=k, xs=xs, xs32=xs32: [
                    mm[k]((xs32 if k.endswith("f32") else xs)[w.shape[1]], p, w)
                    for layer in weights[k]
                    for p, w in layer
                ]
            )
            for k in ks
        }
        for run in runs.values():
            run()
        best = best_of(runs, reps)
        out += [(m, k, best[k] * 1e3) for k in ks]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="32,64,128,256,512")
    ap.add_argument("--threads", default="1,2", help="torch threads, each in its own process")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--kernels",
        default="",
        help="time these kernels alone (onednn,pairs,gemv,pairs-int8,gemv-int8,"
        "onednn-f32,panels-f32) "
        "on distinct weights per layer instead of the serving path",
    )
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # child: this many threads
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.one:
        import torch

        torch.set_num_threads(args.one)
        if args.kernels:
            for m, k, ms in measure_kernels(rows, args.kernels.split(","), args.reps):
                print(f"| {args.one} | {m} | {k} | {ms:.2f} |")
            return
        for m, ms, gf in measure(rows, args.dtype, args.reps):
            print(f"| {args.one} | {m} | {ms:.2f} | {gf:.1f} |")
        return
    if args.kernels:
        print("| threads | rows | kernel | ms per step (30 layers) |\n|---|---|---|---|")
    else:
        print("| threads | rows | ms per step (30 layers) | GFLOP/s |\n|---|---|---|---|")
    for t in (int(x) for x in args.threads.split(",")):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.gemm_rows",
            "--rows",
            args.rows,
            "--dtype",
            args.dtype,
            "--reps",
            str(args.reps),
            "--one",
            str(t),
        ] + (["--kernels", args.kernels] if args.kernels else [])
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
