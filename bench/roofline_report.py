"""The tables ``pdserve bench engine --roofline`` prints (rows from ``bench.roofline_bench``)."""

from __future__ import annotations

import os

import torch

from bench import roofline as rl
from bench.results import Table
from engine.cpu_features import cpu_flags

_SHORT = {
    "C layer stack": "C layers",
    "matmuls": "matmul",
    "attention": "attn",
    "norms/rotary/act": "norm/rope/act",
    "logits+sampling": "logits+samp",
    rl.OTHER: "other ops",
    rl.PYTHON: "python+batch",
}


def print_header(bw: float, nbytes: int, skipped: list[str], llm) -> None:
    """The machine line, the bandwidth and why any dtype is skipped."""
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags()] or ["no avx512_bf16/amx_bf16"]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"threads={torch.get_num_threads()} device={llm.runner.device} cpu flags: {', '.join(bf16)} "
        f"load average at start: {load} (other busy processes skew every figure)"
    )
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s (torch sum over {nbytes / 2**30:.2f} GiB float32, best of 3)")
    for line in skipped:
        print(line)


def print_decode(rows: list[dict], bw: float) -> None:
    """Decode: bytes read per step and their time at the bandwidth, FLOPs and their time at the
    matmul peak, the bound (the slower of the two), the measured step and the fraction."""
    print(
        f"\ndecode roofline (bound = max(bytes read per step / {bw / 1e9:.1f} GB/s, FLOPs / matmul peak); "
        "weights once + KV of each context)"
    )
    print(
        f"{'dtype':<9} {'batch':>5} {'ctx':>4} {'MB/step':>8} {'mem ms':>7} {'GFLOP':>6} {'comp ms':>7} "
        f"{'bound ms':>9} {'step ms':>8} {'tok/s':>8} {'fraction':>8}"
    )
    for r in rows:
        roof = r["roof"]
        print(
            f"{r['dtype']:<9} {r['batch']:>5} {r['context']:>4} {r['bytes'] / 1e6:>8.1f} {r['bytes'] / bw * 1e3:>7.1f} "
            f"{r.get('flops', 0.0) / 1e9:>6.2f} {r.get('compute_s', 0.0) * 1e3:>7.1f} {roof.bound_s * 1e3:>9.1f} "
            f"{roof.measured_s * 1e3:>8.1f} {r['batch'] / roof.measured_s:>8.1f} {roof.fraction:>8.2f}"
        )


def print_prefill(rows: list[dict], peaks: dict[str, tuple[float, str]]) -> None:
    """Prefill: FLOPs, the matmul peak, the bound, the measured time and the fraction."""
    print(
        "\nmatmul peak (fastest single call): "
        + "; ".join(f"{d} {p / 1e9:.1f} GFLOP/s ({w})" for d, (p, w) in peaks.items())
    )
    print(
        "prefill roofline (bound = FLOPs / matmul peak; FLOPs = 2 x layer weights x N + LM head x 1 + causal attention)"
    )
    print(
        f"{'dtype':<9} {'tokens':>6} {'GFLOP':>7} {'peak GF/s':>9} {'bound ms':>9} {'meas. ms':>9} "
        f"{'GF/s':>7} {'fraction':>8}"
    )
    for r in rows:
        roof = r["roof"]
        print(
            f"{r['dtype']:<9} {r['tokens']:>6} {r['flops'] / 1e9:>7.1f} {r['peak'] / 1e9:>9.1f} "
            f"{roof.bound_s * 1e3:>9.1f} {roof.measured_s * 1e3:>9.1f} {r['flops'] / roof.measured_s / 1e9:>7.1f} "
            f"{roof.fraction:>8.2f}"
        )


def print_breakdown(rows: list[dict]) -> None:
    """Share of a decode step per op class (torch.profiler self CPU time; python+batch = the rest)."""
    if not rows:
        return
    print(
        "\ndecode step by op class (share of the profiled step: torch.profiler self CPU time; each C "
        "kernel in a labelled range, C layers = a small decode step's whole layer stack in one call; "
        "python+batch = wall - all ops)"
    )
    print(f"{'dtype':<9} {'batch':>5} {'step ms':>8} " + " ".join(f"{_SHORT[c]:>13}" for c in rl.CLASSES))
    for r in rows:
        share = rl.shares(r["seconds"])
        print(
            f"{r['dtype']:<9} {r['batch']:>5} {r['wall'] * 1e3:>8.1f} "
            + " ".join(f"{share[c] * 100:>12.1f}%" for c in rl.CLASSES)
        )


def roofline_tables(out: dict) -> list[Table]:
    """``run_roofline``'s rows as results tables: decode steps, prefills, and the decode breakdown."""
    return [_decode_table(out["decode"]), _prefill_table(out["prefill"]), _breakdown_table(out["breakdown"])]


def _decode_table(rows: list[dict]) -> Table:
    cells = [
        [
            r["dtype"],
            r["batch"],
            r["context"],
            round(r["bytes"] / 1e6, 1),
            round(r["roof"].bound_s * 1e3, 2),
            round(r["roof"].measured_s * 1e3, 2),
            round(r["batch"] / r["roof"].measured_s, 1),
            round(r["roof"].fraction, 2),
        ]
        for r in rows
    ]
    columns = ["dtype", "batch", "context", "MB/step", "bound ms", "step ms", "tok/s", "fraction"]
    return Table(title="decode step against its bound", columns=columns, rows=cells)


def _prefill_table(rows: list[dict]) -> Table:
    cells = [
        [
            r["dtype"],
            r["tokens"],
            round(r["flops"] / 1e9, 2),
            round(r["peak"] / 1e9, 1),
            round(r["roof"].bound_s * 1e3, 2),
            round(r["roof"].measured_s * 1e3, 2),
            round(r["roof"].fraction, 2),
        ]
        for r in rows
    ]
    columns = ["dtype", "tokens", "GFLOP", "peak GFLOP/s", "bound ms", "measured ms", "fraction"]
    return Table(title="prefill against the matmul peak", columns=columns, rows=cells)


def _breakdown_table(rows: list[dict]) -> Table:
    cells = [
        [
            r["dtype"],
            r["batch"],
            round(r["wall"] * 1e3, 2),
            *(round(rl.shares(r["seconds"])[c] * 100, 1) for c in rl.CLASSES),
        ]
        for r in rows
    ]
    columns = ["dtype", "batch", "step ms", *rl.CLASSES]
    return Table(title="decode step by op class (% of the profiled step)", columns=columns, rows=cells)
