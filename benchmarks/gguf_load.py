"""``python -m benchmarks.gguf_load [--model SPEC] [--rounds N]``: a GGUF model's weight load with the
dequantized-weights cache (``engine.gguf_cache``) off, on but empty (decode + store), and warm, in one run.

Prints each load's wall and CPU seconds (the best of ``--rounds``) and the warm load's ratio to the
uncached one. Each load runs in this process against a fresh temporary cache folder, so the machine's own
cache is neither read nor written.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def _timed(path: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one ``load_model_weights(path)`` with every tensor read once (a tied LM
    head is the embedding's read)."""
    from engine.loader import load_model_weights

    wall, cpu = time.perf_counter(), time.process_time()
    cfg, tensors = load_model_weights(path)
    tied = getattr(cfg, "tie_word_embeddings", False)
    for name in tensors:
        if not (tied and name == "lm_head.weight"):
            tensors[name]
    return time.perf_counter() - wall, time.process_time() - cpu


def run(model: str, rounds: int) -> dict[str, tuple[float, float]]:
    """Best (wall, CPU) of ``rounds`` loads per case: ``off``, ``cold`` (decode + store), ``warm``."""
    from engine import gguf_cache
    from engine.model_paths import resolve_model_path

    path = resolve_model_path(model)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as folder:
            for case, value in (("off", "off"), ("cold", folder), ("warm", folder)):
                os.environ[gguf_cache.ENV] = value
                got = _timed(path)
                best[case] = min(best.get(case, got), got)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gguf_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="a pdserve model spec resolving to a GGUF file")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    best = run(args.model, args.rounds)
    for case, (wall, cpu) in best.items():
        print(f"{case:>5}: {wall:6.2f} s wall, {cpu:6.2f} s CPU")
    print(f"warm / off: {best['warm'][0] / best['off'][0]:.2f}x wall, {best['warm'][1] / best['off'][1]:.2f}x CPU")


if __name__ == "__main__":
    main()
