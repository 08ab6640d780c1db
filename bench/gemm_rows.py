"""Matmul throughput by row count: does a step's size or its thread count cost GEMM efficiency?

``python -m bench.gemm_rows [--rows 32,64,128,256,512] [--threads 1,2] [--dtype bfloat16]``

Runs the model's four projections per layer (SmolLM2-135M: qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576) over 30 layers through ``engine.cpu_linear.linear`` (the serving path:
oneDNN's packed primitive, the small-batch kernel for the rows it takes) at each row count, best of
``--reps`` rounds (the row counts alternating) after a warm-up, and prints ms per step and GFLOP/s.
Each thread count runs in its own process (oneDNN builds its kernels per thread count). Session 23, a 2-core Zen 4: 375-406
GFLOP/s from 64 to 512 rows on two threads, 198-207 on one.
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="32,64,128,256,512")
    ap.add_argument("--threads", default="1,2", help="torch threads, each in its own process")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # child: this many threads
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    if args.one:
        import torch

        torch.set_num_threads(args.one)
        for m, ms, gf in measure(rows, args.dtype, args.reps):
            print(f"| {args.one} | {m} | {ms:.2f} | {gf:.1f} |")
        return
    print("| threads | rows | ms per step (30 layers) | GFLOP/s |\n|---|---|---|---|")
    for t in (int(x) for x in args.threads.split(",")):
        cmd = [sys.executable, "-m", "bench.gemm_rows", "--rows", args.rows, "--dtype", args.dtype,
               "--reps", str(args.reps), "--one", str(t)]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
