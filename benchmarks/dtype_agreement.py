"""bfloat16 and weight-only int8 against float32 (the exact mode), per architecture served from a
HuggingFace folder.

``python -m benchmarks.dtype_agreement [--arch NAME ...] [--tokens 16] [--stored bfloat16|float32]
[--json FILE]`` builds, per architecture, a small model with transformers the way the reference tests
do (``tests.support.hf_folders.save_small_model``: seeded random weights, biases and norms included,
nothing downloaded; the test configs of ``tests/engine/test_hf_architectures.py`` and
``tests.support.hf_folders``) at larger sizes (hidden 256, 4 layers, heads of 64, MLPs of 512,
experts of 128, a 4096-token vocabulary), saves it with its weights stored as ``--stored`` (default
bfloat16, as published checkpoints are: then every mode computes with the same weight values), loads
it through pdserve's loader with the embedded model's tokenizer and runs 4 random prompts (40, 47, 54
and 61 tokens) one at a time through the colocated engine with prompt logprobs and ``--tokens``
greedy tokens (ignore_eos) in float32, in bfloat16 (``--dtype bfloat16``) and in int8 (``--dtype
bfloat16 --weight-dtype int8``). Per architecture and dtype it prints the mean and max |delta logprob|
of the prompt tokens (every position after the first) against float32, the top-1 agreement over those
positions and, per prompt, how many leading greedy tokens equal float32's. float32's tokens equal
transformers' (the reference tests), so these are each mode's distances from the reference. The last
column, float32's median gap between the top-1 and top-2 logprob of those positions, shows how close
the random model's decisions are (small: near-ties). What int8 quantizes is the engine's: every layer
matmul and expert (routers stay bfloat16), and the LM head except Gemma 2's and Gemma 3's (their model
keeps it bfloat16); gpt-oss's experts stay bfloat16 (its attention and LM head are int8).

Gemma 2 runs with its published soft caps (attention 50, final 30: transformers' defaults), not the
tests' 1.5 / 2.0, which squeeze these random logits into [-2, 2]; Phi-3 with partial rotary (the
longrope factors of the tests fit their 16-wide heads only). Needs a CPU with AVX512-BF16 or AMX
(``engine.cpu_features.has_fast_bf16``): elsewhere ``--dtype bfloat16`` runs in float32 and int8
weights are refused, so the benchmark refuses to run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.bf16_agreement import agreeing_prefix
from engine.cpu_features import has_fast_bf16
from engine.llm import LLM, run_batch
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from engine.tokenizer import Tokenizer
from tests.engine.test_hf_architectures import CASES
from tests.support.hf_folders import GEMMA3, GEMMA_CORE, GPT_OSS, QWEN2_MOE, QWEN3_MOE, random_prompts, save_small_model
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams

SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
)
EXPERTS = {"moe_intermediate_size": 128}
# name: (model_type, the config fields on top of SIZES)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama3": CASES["llama3"],
    "qwen2": CASES["qwen2"],
    "qwen3": ("qwen3", {}),  # the tests' head_dim 32 is SIZES' 64 here
    "gemma2": ("gemma2", GEMMA_CORE),
    "gemma3-text": ("gemma3_text", GEMMA3),
    "phi3": CASES["phi3-partial"],
    "mixtral": CASES["mixtral"],
    "qwen3-moe": ("qwen3_moe", {**QWEN3_MOE, **EXPERTS}),
    "qwen2-moe": ("qwen2_moe", {**QWEN2_MOE, **EXPERTS, "shared_expert_intermediate_size": 128}),
    "gpt-oss": ("gpt_oss", GPT_OSS),
}
# mode: the engine config fields beyond float32's
MODES = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "weight_dtype": "int8"},
}


@dataclass
class Scores:
    """One mode's run of the prompts: the prompt tokens' logprobs, top-1 tokens and gaps between the
    top-1 and top-2 logprobs (every position after the first, all prompts in order) and each prompt's
    greedy tokens."""

    logprobs: torch.Tensor
    top1: list[int]
    gaps: torch.Tensor
    greedy: list[list[int]]


@dataclass
class Row:
    """One architecture x dtype against float32 (``refused``: why the mode did not run)."""

    arch: str
    dtype: str
    mean_delta: float | None = None
    max_delta: float | None = None
    top1_agreement: float | None = None
    greedy_prefixes: list[int] | None = None
    float32_median_gap: float | None = None
    refused: str | None = None


def build(arch: str, folder: Path, stored: str) -> None:
    """Save ``arch``'s small random model into ``folder`` with its weights stored as ``stored``."""
    kind, fields = ARCHS[arch]
    model = save_small_model(kind, folder, **{**fields, **SIZES})
    if stored != "float32":
        model.to(getattr(torch, stored)).save_pretrained(folder, safe_serialization=True)


def score(folder: Path, tokenizer, mode: str, prompts: list[list[int]], tokens: int) -> Scores:
    """Run ``prompts`` one at a time (each prefill alone, as in ``tests/engine/test_moe_bf16.py``) through
    the colocated engine in ``mode``, with prompt logprobs and ``tokens`` greedy tokens each."""
    ecfg = engine_cfg(**MODES[mode])
    cfg, weights = load_for_engine(folder, ecfg)
    llm = LLM(ecfg, sched_cfg(), loaded=(cfg, weights, tokenizer))
    want = torch.float32 if mode == "float32" else torch.bfloat16
    if llm.runner.dtype != want:
        raise ValueError(f"the engine runs {llm.runner.dtype}, not {want}")
    sp = SamplingParams(max_new_tokens=tokens, temperature=0, prompt_logprobs=2, ignore_eos=True)
    outs = [run_batch(llm.scheduler, [p], [sp])[0] for p in prompts]
    llm.scheduler.check_integrity()
    entries = [e for o in outs for e in o.prompt_logprobs[1:]]
    logprobs, top1 = torch.tensor([e[0] for e in entries]), [e[1][0][0] for e in entries]
    gaps = torch.tensor([e[1][0][1] - e[1][1][1] for e in entries])
    return Scores(logprobs, top1, gaps, [o.token_ids for o in outs])


def compare(arch: str, mode: str, got: Scores, want: Scores) -> Row:
    """``got``'s distance from float32's ``want``."""
    delta = (got.logprobs - want.logprobs).abs()
    agree = sum(a == b for a, b in zip(got.top1, want.top1)) / len(want.top1)
    prefixes = [agreeing_prefix(a, b) for a, b in zip(got.greedy, want.greedy)]
    return Row(arch, mode, float(delta.mean()), float(delta.max()), agree, prefixes, float(want.gaps.median()))


def measure(arch: str, tokenizer, prompts: list[list[int]], tokens: int, stored: str) -> list[Row]:
    """The bfloat16 and int8 rows of ``arch`` (a mode the engine refuses: its row says why)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-dtype-") as tmp:
        folder = Path(tmp)
        build(arch, folder, stored)
        reference = score(folder, tokenizer, "float32", prompts, tokens)
        rows = []
        for mode in ("bfloat16", "int8"):
            try:
                rows.append(compare(arch, mode, score(folder, tokenizer, mode, prompts, tokens), reference))
            except ValueError as e:
                rows.append(Row(arch, mode, refused=str(e)))
    return rows


def format_row(row: Row, tokens: int) -> str:
    """One table line: the figures, or the refusal."""
    if row.refused is not None:
        return f"| {row.arch} | {row.dtype} | refused: {row.refused} | | | | |"
    prefixes = ", ".join(map(str, row.greedy_prefixes))
    return (
        f"| {row.arch} | {row.dtype} | {row.mean_delta:.3f} | {row.max_delta:.2f} | {row.top1_agreement:.3f} "
        f"| {prefixes} of {tokens} | {row.float32_median_gap:.2f} |"
    )


def print_table(rows: list[Row], tokens: int) -> None:
    """The rows as a Markdown table, then the legend."""
    print(
        "| architecture | dtype | mean abs delta logprob | max | top-1 agreement | greedy prefixes "
        "| float32 median top-1 gap |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(format_row(row, tokens))
    print(
        "\nmean / max: |logprob in the dtype - logprob in float32| of each prompt token after the first (4 prompts,"
        "\n40-61 tokens); top-1 agreement: the share of those positions whose most likely token is float32's; greedy"
        f"\nprefixes: per prompt, how many of {tokens} greedy tokens agree with float32's before the first difference."
        "\nRandom weights over a small vocabulary have many near-ties, so greedy prefixes understate the agreement"
        "\nof a trained model. float32 median top-1 gap: the median over those positions of float32's top-1 minus"
        "\ntop-2 logprob (small: near-ties, where a small delta changes the top-1 token)."
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=list(ARCHS), help="default: every one")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--stored", choices=("bfloat16", "float32"), default="bfloat16", help="the folder's weights")
    p.add_argument("--json", type=Path, help="also write the rows to this file")
    args = p.parse_args(argv)
    if has_fast_bf16() is not True:
        raise SystemExit(
            "this CPU has no AVX512-BF16 or AMX: --dtype bfloat16 would run in float32 and --weight-dtype int8 "
            "is refused, so there is nothing to compare"
        )
    tokenizer = Tokenizer.from_path(resolve_model_path("default"))
    prompts = random_prompts(4, 40, vocab=SIZES["vocab_size"])
    start, rows = time.perf_counter(), []
    for arch in args.arch:
        rows += measure(arch, tokenizer, prompts, args.tokens, args.stored)
        print(f"{arch}: done at {time.perf_counter() - start:.0f} s", flush=True)
    print_table(rows, args.tokens)
    elapsed = time.perf_counter() - start
    print(f"\n{len(args.arch)} architectures in {elapsed:.0f} s ({torch.get_num_threads()} threads)")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
