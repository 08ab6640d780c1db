"""One MoE prefill step split by part, and its experts by path, in one run.

``python -m benchmarks.moe_prefill [--dtype bfloat16|float32|int8] [--tokens 256,2048] [--chunks 64,256,512]
[--rounds 2] [--threads 0] [--no-torch-loop]`` builds the peer sitting's Qwen3-MoE
(``benchmarks.peer_moe_folder``'s sizes: hidden 1024, 4 layers, top 8 of 64 experts of 768, renormalized;
random weights, a 4096-token vocabulary), loads it through pdserve's loader and, for each prompt length,
prefills one prompt of that many tokens as one step (``chunked_prefill_size`` at least that long), with
the experts by the torch loop, by the dot-product C kernel and by the expert GEMM
(``engine.moe.LARGE_STEP_ROWS``'s chunks; the dot kernel and the torch loop on row-major copies of
the experts rebuilt from the pair panels, which are all a laid-out layer holds), timing its parts:
attention (the backend's ``forward``), router (``engine.moe.route``), experts (the rest of
``engine.moe.moe_mlp``) and dense (all else: embedding, norms, QKV/O projections, rotary, the LM head).
The step's sparse-layer inputs are captured and their expert blocks run again by each path, the paths
alternating, best of ``--rounds`` (routing included, the same in each): the torch loop
(``_torch_experts``; its first call apart, where oneDNN builds a primitive for each new per-expert row
count, as a served step with new counts does), the dot-product kernel and the expert GEMM, each in one
call over the whole step and in chunks of each ``--chunks`` tokens (``engine.moe.LARGE_STEP_ROWS``).
Prints ms per step and each path's ratio to the torch loop (with
``--no-torch-loop``: to the dot kernel in the served chunks).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.peer_moe_folder import QWEN3_MOE_SIZES
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine import model as model_module
from engine import moe
from engine.llm import LLM, run_batch
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from engine.tokenizer import Tokenizer
from transfer.wire.sampling_params import SamplingParams


class PartTimer:
    """Wraps the step's parts (runner forward, attention, ``moe_mlp``, ``route``) with wall-clock sums
    and captures each sparse layer's ``(x, w, spec)``; ``restore()`` puts the originals back."""

    def __init__(self, runner) -> None:
        self.runner, self.backend = runner, runner.backend
        self.real = (runner.forward, runner.backend.forward, model_module.moe_mlp, moe.route)
        self.t = {"step": 0.0, "attention": 0.0, "moe": 0.0, "router": 0.0}
        self.captured: list[tuple] = []
        runner.forward = self._timed("step", self.real[0])
        runner.backend.forward = self._timed("attention", self.real[1])
        model_module.moe_mlp = self._moe
        moe.route = self._timed("router", self.real[3])

    def _timed(self, part: str, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[part] += time.perf_counter() - t

        return call

    def _moe(self, x, w, spec, *args):
        self.captured.append((x.clone(), w, spec))
        return self._timed("moe", self.real[2])(x, w, spec, *args)

    def restore(self) -> None:
        self.runner.forward, self.backend.forward, model_module.moe_mlp, moe.route = self.real


def prefill_parts(llm: LLM, tokens: int, vocab: int) -> tuple[dict[str, float], list[tuple]]:
    """Seconds by part of one prefill step of ``tokens`` random tokens (the prompt's only step), and the
    sparse layers' captured inputs."""
    prompt = torch.randint(3, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    kv = llm.scheduler.kv
    if kv.tree is not None:  # no prefix reuse between runs: the whole prompt prefills
        kv.allocator.free(kv.tree.evict(kv.tree.total_size()))
    timer = PartTimer(llm.runner)
    try:
        run_batch(llm.scheduler, [prompt], [SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)])
    finally:
        timer.restore()
    t = timer.t
    parts = {
        "attention": t["attention"],
        "router": t["router"],
        "experts": t["moe"] - t["router"],
        "dense": t["step"] - t["attention"] - t["moe"],
        "step": t["step"],
    }
    return parts, timer.captured


# path name -> (LARGE_STEP_ROWS, expert GEMM) while it runs; None: the torch loop (kernel off)
def _settings(rows: int, chunks: list[int], torch_loop: bool) -> dict[str, tuple[int, bool] | None]:
    loop = {"torch loop": None} if torch_loop else {}
    dot = {"dot kernel, one call": (rows, False)} | {f"dot kernel, chunks of {c}": (c, False) for c in chunks}
    gemm = {"expert GEMM, one call": (rows, True)} | {f"expert GEMM, chunks of {c}": (c, True) for c in chunks}
    return loop | dot | gemm


def expert_paths(captured: list[tuple], chunks: list[int], rounds: int, torch_loop: bool = True):
    """(first, best) seconds of the step's expert blocks (every captured layer once) by path; the dot
    kernel and the torch loop on the layers' tensors with row-major experts (``engine.moe.row_major``)."""
    settings = _settings(captured[0][0].shape[0], chunks, torch_loop)
    rows = {id(w): moe.row_major(w) for _, w, _ in captured}
    times: dict[str, list[float]] = {name: [] for name in settings}
    saved = moe.LARGE_STEP_ROWS
    try:
        for _ in range(rounds):
            for name, setting in settings.items():
                moe.LARGE_STEP_ROWS, gemm = setting or (0, False)
                t = time.perf_counter()
                with torch.inference_mode():
                    for x, w, spec in captured:
                        moe.moe_mlp(x, w if gemm else rows[id(w)], spec, kernel=setting is not None)
                times[name].append(time.perf_counter() - t)
    finally:
        moe.LARGE_STEP_ROWS = saved
    return {name: (ts[0], min(ts)) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "int8"))
    p.add_argument("--tokens", default="256,2048", help="prompt lengths, one prefill step each")
    p.add_argument("--chunks", default="64,256,512", help="kernel chunk sizes (tokens) to time")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-torch-loop", dest="torch_loop", action="store_false", help="skip the torch loop (slow)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.tokens.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    from benchmarks.moe_roofline import build_folder, laid_out_layers, set_gemm

    with tempfile.TemporaryDirectory(prefix="pdserve-moe-prefill-") as tmp:
        build_folder(Path(tmp), argparse.Namespace(**QWEN3_MOE_SIZES, vocab=4096))
        int8 = {"dtype": "bfloat16", "weight_dtype": "int8"} if args.dtype == "int8" else {"dtype": args.dtype}
        ecfg = EngineConfig(model=tmp, **int8)
        cfg, weights = load_for_engine(tmp, ecfg)
        tok = Tokenizer.from_path(resolve_model_path("default"))
        sched = SchedulerConfig(chunked_prefill_size=max(lengths), max_num_batched_tokens=max(lengths))
        llm = LLM(ecfg, sched, loaded=(cfg, weights, tok))
    print(
        f"Qwen3-MoE hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.moe.num_experts} experts of "
        f"{cfg.moe.expert_size}, top {cfg.moe.top_k}; {args.dtype}, {torch.get_num_threads()} threads"
    )
    prefill_parts(llm, 64, cfg.vocab_size)  # warm-up: the dense matmuls' and attention's first calls
    large, laid_out = moe.LARGE_STEP_ROWS, laid_out_layers(llm.runner.model)
    steps = {"dot kernel": (large, False), "expert GEMM": (large, True)}
    if args.torch_loop:
        steps = {"torch loop": (0, False)} | steps
    for n in lengths:
        for path, (moe.LARGE_STEP_ROWS, gemm) in steps.items():
            set_gemm(llm.runner.model, laid_out, gemm)
            try:
                parts, captured = prefill_parts(llm, n, cfg.vocab_size)
            finally:
                moe.LARGE_STEP_ROWS = large
                set_gemm(llm.runner.model, laid_out, True)
            split = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if k != "step")
            print(f"prefill {n} tokens, experts by the {path}: step {parts['step'] * 1e3:.1f} ms ({split} ms)")
        paths = expert_paths(captured, chunks, args.rounds, args.torch_loop)
        base_name = "torch loop" if args.torch_loop else f"dot kernel, chunks of {large}"
        base = paths.get(base_name, next(iter(paths.values())))[1]
        for name, (first, best) in paths.items():
            print(
                f"  experts {name:28s} best {best * 1e3:8.1f} ms (x{base / best:5.2f} of the {base_name}), "
                f"first {first * 1e3:8.1f} ms"
            )


if __name__ == "__main__":
    main()
