"""One sparse layer's experts: the fused-MoE Triton kernels against the per-expert torch loop.

``python -m benchmarks.moe_triton [--device cuda] [--dtype bfloat16|float16|float32|int8]
[--hidden 2048] [--experts 128] [--top-k 8] [--expert-size 768] [--tokens 1,16,256,2048] [--reps 20]``

Random weights of the given shape (the defaults: a Qwen3-30B-A3B layer), routed by a random router
through ``engine.moe.route``; per token count, the best-of-``reps`` time of
``engine.kernels.triton_moe.fused_moe`` and of the torch loop (``engine.moe._torch_experts``, what
``moe_mlp(kernel=False)`` runs), their ratio and the relative difference of the two outputs
(``|triton - torch| / |torch|``, Frobenius). ``int8``: bfloat16 activations and weight-only int8
experts (``engine.moe.quantize_rows``). On CUDA the times follow ``torch.cuda.synchronize``;
``--device cpu`` runs the kernels in the Triton interpreter (``TRITON_INTERPRET=1`` is set here
before triton loads), a check that the script works, not a timing.
"""

from __future__ import annotations

import argparse
import os
import time


def _layer(args, device: str) -> tuple[dict, object]:
    """``(tensors, activation dtype)``: the router and the stacked experts, int8 with scales for ``int8``."""
    import torch

    from engine import moe

    act = torch.bfloat16 if args.dtype == "int8" else getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    h, e, i = args.hidden, args.experts, args.expert_size
    w = {
        "router": torch.randn(e, h, generator=g),
        "experts_gate_up": torch.randn(e, 2 * i, h, generator=g) * h**-0.5,
        "experts_down": torch.randn(e, h, i, generator=g) * i**-0.5,
    }
    w = {n: t.to(act) for n, t in w.items()}
    if args.dtype == "int8":
        for name in ("experts_gate_up", "experts_down"):
            w[name], w[name + "_scale"] = moe.quantize_rows(w[name])
    return {n: t.to(device) for n, t in w.items()}, act


def _best(fn, reps: int, device: str) -> tuple[float, object]:
    """Best wall time of ``fn`` over ``reps`` runs after one warm-up, in ms, and its last result."""
    import torch

    out = fn()
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


def measure(args, tokens: int) -> dict:
    """``{"triton_ms", "torch_ms", "rel"}`` of one token count."""
    import torch

    from engine import moe
    from engine.kernels import triton_moe

    w, act = _layer(args, args.device)
    x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(tokens)).to(act).to(args.device)
    weights, experts = moe.route(x, w["router"], args.top_k, True)
    gate_up, down = w["experts_gate_up"], w["experts_down"]
    scales = (w["experts_gate_up_scale"], w["experts_down_scale"]) if args.dtype == "int8" else None
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=args.experts).tolist()
    pair_w = weights.flatten()[order].unsqueeze(-1)
    triton_ms, got = _best(
        lambda: triton_moe.fused_moe(x, gate_up, down, weights, experts, scales), args.reps, args.device
    )
    torch_ms, want = _best(
        lambda: moe._torch_experts(x, gate_up, down, scales, counts, order // args.top_k, pair_w),
        args.reps,
        args.device,
    )
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    return {"triton_ms": triton_ms, "torch_ms": torch_ms, "rel": rel}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "int8"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-size", type=int, default=768)
    ap.add_argument("--tokens", default="1,16,256,2048", help="token counts, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported: the interpreter
    print("| tokens | torch loop ms | triton ms | torch / triton | relative difference |")
    print("|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        r = measure(args, tokens)
        ratio = r["torch_ms"] / r["triton_ms"]
        print(f"| {tokens} | {r['torch_ms']:.3f} | {r['triton_ms']:.3f} | {ratio:.2f} | {r['rel']:.1e} |")


if __name__ == "__main__":
    main()
