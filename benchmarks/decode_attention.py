"""Decode attention kernel alone: float32 math against bfloat16 products (``paged_decode``'s ``dot``).

``python -m benchmarks.decode_attention [--shapes 1x300,8x300,25x260,32x300] [--reps 5]``

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, 16-token pages) over 30
layers of a bfloat16 pool larger than the last-level cache, each request's pages its own, with this
process's prefetch mode (``engine.kernels.decode_prefetch``) and torch's threads. Per shape
(``BATCHxCONTEXT``): ms per 30-layer step with float32 math and with ``dot`` (where the build has
AVX512-BF16), the ratio, the KV bytes read and the relative difference of the two outputs (one
bfloat16 rounding of the softmax weights). On a 2-core Zen 4: 25x260 9.8 -> 8.4 ms, 32x300
13.5 -> 11.7 (1.15-1.18x), 1x300 0.67 -> 0.60; 1.3-1.4e-3 relative.
"""

from __future__ import annotations

import argparse

LAYERS, HEADS, KV_HEADS, DIM, PAGE = 30, 9, 3, 64, 16


def measure(batch: int, ctx: int, reps: int) -> dict:
    """``{"ms": {dot: ms}, "mb": KV MB per step, "rel": relative difference}`` for one shape."""
    import torch

    from engine.kernels import cpu_native
    from engine.kernels.decode_prefetch import best_of, modes

    pages = batch * -(-ctx // PAGE)
    pool = torch.randn(pages, LAYERS, 2, PAGE, KV_HEADS, DIM).bfloat16()
    table = torch.arange(pages, dtype=torch.int64).view(batch, -1)
    lo, hi = torch.zeros(batch, dtype=torch.int64), torch.full((batch,), ctx, dtype=torch.int64)
    q = torch.randn(batch, HEADS, DIM).bfloat16()
    threads, prefetch = torch.get_num_threads(), modes().attention
    dots = (False, True) if cpu_native.decode_dot_available() else (False,)
    runs = {
        d: (
            lambda d=d: [
                cpu_native.paged_decode(q, pool, layer, table, lo, hi, DIM**-0.5, threads, prefetch, dot=d)
                for layer in range(LAYERS)
            ]
        )
        for d in dots
    }
    best = best_of(runs, reps)
    a, b = (
        cpu_native.paged_decode(q, pool, 0, table, lo, hi, DIM**-0.5, threads, prefetch, dot=d)
        for d in (False, dots[-1])
    )
    return {
        "ms": {d: best[d] * 1e3 for d in dots},
        "mb": batch * ctx * KV_HEADS * DIM * 2 * 2 * LAYERS / 1e6,
        "rel": float((a - b).norm() / a.norm()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x300,8x300,25x260,32x300", help="BATCHxCONTEXT, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    print("| batch x context | KV MB / step | float32 math ms | bfloat16 products ms | ratio | rel. difference |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        batch, ctx = (int(v) for v in shape.split("x"))
        r = measure(batch, ctx, args.reps)
        f, d = r["ms"][False], r["ms"].get(True)
        dot = "-" if d is None else f"{d:.2f}"
        ratio = "-" if d is None else f"{f / d:.2f}x"
        print(f"| {shape} | {r['mb']:.0f} | {f:.2f} | {dot} | {ratio} | {r['rel']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
