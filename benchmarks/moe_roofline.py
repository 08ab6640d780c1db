"""A small Qwen3-MoE's decode step against its roofline, torch experts and the C expert kernel side
by side in one run.

``python -m benchmarks.moe_roofline [--dtype bfloat16|float32|int8] [--hidden 1024] [--experts 64] [--top-k 8]
[--expert-size 768] [--layers 4] [--batch 1] [--tokens 24] [--rounds 1] [--no-torch]`` builds the model with
transformers (random weights, nothing downloaded) into a temporary folder, loads it through pdserve's loader,
measures the read bandwidth (``bench.roofline_bench.read_bandwidth``) and, for each expert path, the
decode step time at ``--batch`` through the colocated engine (``(t(1 + tokens) - t(1)) / tokens`` of
greedy runs, each best of ``--repeats``) and each decode forward's time (the model alone: fastest and
median). The bound (``bench.roofline``) is the bytes the step reads, the dense
weights (attention, routers, LM head, norms), the KV and each chosen expert's weights once (per
sparse layer the union of the batch's top-k, counted as the step runs) over that bandwidth;
``fraction = bound / measured``. The torch path is the per-expert matmuls ``engine.moe`` falls
back to (``KERNEL_MAX_ROWS`` set to 0: the kernel off); the kernel path is ``engine.kernels.cpu_moe`` called per
layer from Python; the decode stack is the whole step's layers in one C call (``engine.decode_stack``,
the same expert kernel), where this host builds it. The torch and kernel rows run with the stack off;
the stack row counts the experts read from the kernel row's run (same prompts, same greedy routes).
The C rows run the dot-product kernel (``cpu_moe.c``) and, where the layers have the expert GEMM's
layout, the expert GEMM (``cpu_moe_gemm.c``), side by side; the dot and torch rows run on row-major
copies of the experts rebuilt from the panels (a laid-out layer holds only those).
``--no-torch`` skips the torch row. ``--rounds N`` alternates the paths N times and reports each one's best
engine step, fastest forward and median of its rounds' medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import roofline as rl
from bench.roofline_bench import read_bandwidth
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine import moe
from engine.forward_batch import ForwardMode
from engine.llm import LLM, run_batch
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from engine.tokenizer import Tokenizer
from transfer.wire.sampling_params import SamplingParams

PROMPT_LEN = 16


def build_folder(folder: Path, args) -> None:
    """A Qwen3-MoE of the given sizes with random weights (std 0.02, norms 1), saved as bfloat16."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_size,
        intermediate_size=4 * args.expert_size,
        norm_topk_prob=True,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    save_seeded(transformers.Qwen3MoeForCausalLM(cfg), folder)


def save_seeded(model, folder: Path) -> None:
    """Save ``model`` into ``folder`` in bfloat16 with seeded weights (norm weights 1, the rest
    N(0, 0.02)): the same folder on every run."""
    model = model.to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(folder, safe_serialization=True)


class UnionCounter:
    """Counts, per ``engine.moe.route`` call of exactly ``rows`` rows (the decode steps), the distinct
    experts chosen: the experts that step reads in that layer."""

    def __init__(self, rows: int) -> None:
        self.rows, self.calls, self.experts = rows, 0, 0
        self.real = moe.route

    def __call__(self, x, router, top_k, norm):
        weights, experts = self.real(x, router, top_k, norm)
        if x.shape[0] == self.rows:
            self.calls += 1
            self.experts += int(experts.unique().numel())
        return weights, experts


class ForwardTimer:
    """Wall time of each decode forward (``ModelRunner.forward`` in ``ForwardMode.DECODE``) of a runner."""

    def __init__(self, runner) -> None:
        self.runner, self.real, self.times = runner, runner.forward, []

    def __call__(self, mode, seqs, num_decode: int = 0):
        t = time.perf_counter()
        out = self.real(mode, seqs, num_decode)
        if mode == ForwardMode.DECODE:
            self.times.append(time.perf_counter() - t)
        return out


def decode_times(llm: LLM, batch: int, tokens: int, repeats: int, vocab: int) -> tuple[float, float, float]:
    """(engine step, fastest decode forward, median decode forward) in seconds at ``batch``: the step is
    ``(t(1 + tokens) - t(1)) / tokens`` of greedy runs (each the best of ``repeats``; sampling and
    scheduling included), the forwards those of every timed run."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(batch)]
    kv, timer = llm.scheduler.kv, ForwardTimer(llm.runner)

    def timed(n: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            if kv.tree is not None:  # no prefix reuse between runs: every run prefills its prompts
                kv.allocator.free(kv.tree.evict(kv.tree.total_size()))
            sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
            t = time.perf_counter()
            run_batch(llm.scheduler, prompts, [sp] * batch)
            best = min(best, time.perf_counter() - t)
        return best

    llm.runner.forward = timer
    try:
        step = (timed(1 + tokens) - timed(1)) / tokens
    finally:
        llm.runner.forward = timer.real
    return step, min(timer.times), statistics.median(timer.times)


def expert_paths(stack, laid_out: dict, torch_path: bool) -> list[tuple]:
    """(name, KERNEL_MAX_ROWS, stack or None, expert GEMM on) per path: the torch experts (where asked),
    the C kernels per layer and in the decode stack (where built), each by the dot-product kernel and,
    where the layers have the expert GEMM's layout, by the GEMM."""
    rows = moe.KERNEL_MAX_ROWS
    paths = [("torch experts", 0, None, False)] if torch_path else []
    for name, on in (("dot", False), ("GEMM", True)):
        if on and not laid_out:
            continue
        paths.append((f"C kernel ({name})", rows, None, on))
        if stack is not None:
            paths.append((f"C stack ({name})", rows, stack, on))
    return paths


def laid_out_layers(model) -> dict[int, tuple[dict, dict]]:
    """Each laid-out sparse layer's ``(tensors, the same with row-major experts rebuilt from the panels)``
    (``engine.moe.row_major``), by layer index: a laid-out layer holds only the panels, so the
    dot-product kernel's and the torch experts' rows run on copies this benchmark builds."""
    return {
        i: (layer.w, moe.row_major(layer.w))
        for i, layer in enumerate(model.layers)
        if layer.sparse and moe.laid_out(layer.w) is not None
    }


def set_gemm(model, laid_out: dict[int, tuple[dict, dict]], on: bool) -> None:
    """Give the sparse layers their laid-out experts (``on``: the expert GEMM runs them) or the row-major
    copies (the dot-product kernel then runs, per layer and in the stack, whose binding is rebuilt)."""
    for i, (panels, rows) in laid_out.items():
        model.layers[i].w = panels if on else rows
    if model.stack is not None:
        model.stack._bound = None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "int8"))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-size", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="rounds over the paths, alternated (best step and forward)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-torch", dest="torch", action="store_false", help="skip the torch experts (slow)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pdserve-moe-") as tmp:
        build_folder(Path(tmp), args)
        # "int8": bfloat16 activations, weight-only int8 matmul weights and experts
        int8 = {"dtype": "bfloat16", "weight_dtype": "int8"} if args.dtype == "int8" else {"dtype": args.dtype}
        ecfg = EngineConfig(model=tmp, **int8)
        cfg, weights = load_for_engine(tmp, ecfg)
        tok = Tokenizer.from_path(resolve_model_path("default"))
        llm = LLM(ecfg, SchedulerConfig(), loaded=(cfg, weights, tok))
    bw = read_bandwidth()
    experts_gb = (
        len(cfg.moe.sparse_layers)
        * cfg.moe.num_experts
        * rl.expert_params(cfg)
        * rl.MATMUL_WEIGHT_BYTES.get(args.dtype, rl.DTYPE_BYTES[args.dtype])
    )
    print(
        f"Qwen3-MoE hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.moe.num_experts} experts of "
        f"{cfg.moe.expert_size}, top {cfg.moe.top_k}; {llm.runner.dtype}, {torch.get_num_threads()} threads; "
        f"experts {experts_gb / 1e9:.2f} GB; read bandwidth {bw / 1e9:.1f} GB/s"
    )
    context = args.batch * (PROMPT_LEN + args.tokens // 2)  # the mean context over the timed steps
    model = llm.runner.model
    stack, active = model.stack, 0.0
    laid_out = laid_out_layers(model)
    paths = expert_paths(stack, laid_out, args.torch)
    times: dict[str, list[tuple[float, float, float]]] = {path[0]: [] for path in paths}
    for _ in range(args.rounds):  # the paths alternate: a shared host's load falls on each alike
        for name, max_rows, model.stack, gemm in paths:
            moe.KERNEL_MAX_ROWS = max_rows
            set_gemm(model, laid_out, gemm)
            counter = UnionCounter(args.batch)
            moe.route = counter
            try:
                times[name].append(decode_times(llm, args.batch, args.tokens, args.repeats, cfg.vocab_size))
            finally:
                moe.route = counter.real
            if counter.calls:  # the stack's steps do not call engine.moe.route: the kernel row's count stands
                active = counter.experts / counter.calls * len(cfg.moe.sparse_layers)
    model.stack = stack
    set_gemm(model, laid_out, True)
    nbytes = rl.weight_bytes_per_step(cfg, args.dtype, args.batch, round(active))
    nbytes += rl.kv_bytes_per_token(cfg, args.dtype) * context
    bound = rl.bound_s(nbytes, bw)
    for name, runs in times.items():
        step, fastest = min(r[0] for r in runs), min(r[1] for r in runs)
        median = statistics.median(r[2] for r in runs)
        print(
            f"{name:18s} batch {args.batch}: bound {bound * 1e3:6.2f} ms ({nbytes / 1e6:.1f} MB, {active:.0f} "
            f"experts read); engine step {step * 1e3:7.2f} ms (fraction {rl.fraction(bound, step):.2f}), decode "
            f"forward fastest {fastest * 1e3:7.2f} ms ({rl.fraction(bound, fastest):.2f}), median "
            f"{median * 1e3:7.2f} ms ({rl.fraction(bound, median):.2f})"
        )


if __name__ == "__main__":
    main()
