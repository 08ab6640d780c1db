"""A small Gemma 2 or Gemma 3 text model's decode step through the C decode stack and through the
per-layer Python path, alternated in one run.

``python -m benchmarks.gemma_stack [--kind gemma3_text|gemma2] [--dtype float32|bfloat16] [--batch 1 8]
[--hidden 640] [--layers 18] [--heads 4] [--kv-heads 1] [--head-dim 256] [--inter 2048] [--window 512]
[--vocab 4096] [--tokens 16] [--repeats 2] [--rounds 2] [--portable-panels]`` builds the model with
transformers (seeded random weights, nothing downloaded; the defaults are Gemma 3 270M's layers with a
small vocabulary) into a temporary folder, loads it through pdserve's loader and, per batch size, times
the decode step at that batch through the colocated engine (``benchmarks.moe_roofline.decode_times``:
``(t(1 + tokens) - t(1)) / tokens`` of greedy runs, best of ``--repeats``) and each decode forward (the
model alone: fastest and median), the stack and the layer path (``model.stack`` None) alternating
``--rounds`` times. Prompts of 16 tokens: the sliding layers' window only binds with ``--window`` below
16 + tokens. ``--portable-panels``: float32 on a CPU without AVX-512F, where the stack exists only on
the library's portable float32 matmul loop (scalar, one thread; what the tests use): both paths then
run that slow loop, so the ratio shows the per-step overhead the stack removes, diluted by it, not the
speed-up on a CPU with AVX-512.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.moe_roofline import decode_times, save_seeded
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.kernels import cpu_native
from engine.llm import LLM
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from engine.tokenizer import Tokenizer


def build_folder(folder: Path, args) -> None:
    """A Gemma 2 / Gemma 3 text model of the given sizes with seeded random weights, saved as bfloat16."""
    import transformers

    sizes = dict(
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab,
        sliding_window=args.window,
        max_position_embeddings=4096,
        query_pre_attn_scalar=args.head_dim,
    )
    if args.kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**sizes, attn_logit_softcapping=50.0))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**sizes, sliding_window_pattern=6))
    save_seeded(model, folder)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="gemma3_text", choices=("gemma3_text", "gemma2"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="rounds over the two paths, alternated")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--portable-panels", action="store_true", help="float32 panels without AVX-512F (see above)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.portable_panels:
        cpu_native.panels_f32_available = lambda: True
    with tempfile.TemporaryDirectory(prefix="pdserve-gemma-") as tmp:
        build_folder(Path(tmp), args)
        ecfg = EngineConfig(model=tmp, dtype=args.dtype, page_size=16, attention_backend="cpu")
        cfg, weights = load_for_engine(tmp, ecfg)
        tok = Tokenizer.from_path(resolve_model_path("default"))
        llm = LLM(
            ecfg,
            SchedulerConfig(max_running_requests=max(args.batch), enable_radix_cache=False),
            loaded=(cfg, weights, tok),
        )
    model = llm.runner.model
    stack = model.stack
    if stack is None:
        raise SystemExit("the decode stack does not take this model here (see engine.decode_stack's contract)")
    print(
        f"{args.kind}: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads "
        f"of {cfg.head_dim}, window {cfg.sliding_window}; {llm.runner.dtype}, {torch.get_num_threads()} threads"
        + (", portable float32 panels" if args.portable_panels else "")
    )
    for batch in args.batch:
        runs: dict[str, list[tuple[float, float, float]]] = {"C stack": [], "layer path": []}
        for _ in range(args.rounds):  # alternated: a shared host's load falls on both alike
            for name, model.stack in (("C stack", stack), ("layer path", None)):
                runs[name].append(decode_times(llm, batch, args.tokens, args.repeats, cfg.vocab_size))
        model.stack = stack
        best = {
            name: (min(r[0] for r in rs), min(r[1] for r in rs), statistics.median(r[2] for r in rs))
            for name, rs in runs.items()
        }
        for name, (step, fastest, median) in best.items():
            print(
                f"batch {batch} {name:10s}: engine step {step * 1e3:7.2f} ms, decode forward fastest "
                f"{fastest * 1e3:7.2f} ms, median {median * 1e3:7.2f} ms"
            )
        s, layer = best["C stack"], best["layer path"]
        print(
            f"batch {batch} layer path / stack: step x{layer[0] / s[0]:.2f}, forward (fastest) x{layer[1] / s[1]:.2f}"
        )


if __name__ == "__main__":
    main()
