"""Greedy agreement of a model run in bfloat16 against the same model in float32 (the exact mode).

``python -m benchmarks.bf16_agreement [--model default] [--max-tokens 64]`` loads the model once,
runs the same prompts greedily (ignore_eos) through the colocated engine with ``--dtype float32``
and ``--dtype bfloat16``, and prints for each prompt how many output tokens agree before the first
difference (``N/N``: identical), then the list, its mean and how many prompts were identical.
float32's tokens equal transformers' (the reference tests), so this is bfloat16's distance from
the reference. Needs a CPU with AVX512-BF16/AMX (elsewhere ``--dtype bfloat16`` runs in float32).
"""

from __future__ import annotations

import argparse

from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.llm import LLM
from engine.loader import load_model_weights
from engine.model_paths import resolve_model_path
from engine.tokenizer import Tokenizer
from transfer.wire.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    'def add(a, b):\n    """Add two numbers."""\n',
    "Why is the sky blue? Explain in one paragraph.",
    "List three uses of copper:",
    "Once upon a time, in a small village by the mountains,",
    "The printing press was invented by",
    "Translate to French: I would like a cup of coffee.",
]


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    path = resolve_model_path(args.model)
    cfg, weights = load_model_weights(path)
    tok = Tokenizer.from_path(path)
    ids = [tok.encode(t) for t in PROMPTS]
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(EngineConfig(model=args.model, dtype=dtype), SchedulerConfig(), loaded=(cfg, weights, tok))
        print(f"{dtype}: runs in {llm.runner.dtype}", flush=True)
        outs[dtype] = [o.token_ids for o in llm.generate_ids(ids, params)]
    agree = [agreeing_prefix(a, b) for a, b in zip(outs["float32"], outs["bfloat16"])]
    for n, text in zip(agree, PROMPTS):
        print(f"{n:4d}/{args.max_tokens}  {text!r}")
    identical = sum(n == args.max_tokens for n in agree)
    print(f"agreeing prefixes {agree}: mean {sum(agree) / len(agree):.1f}, identical {identical}/{len(agree)}")


if __name__ == "__main__":
    main()
