"""Mixed batches on vs off in one process: the colocated scheduler under a closed-loop load, no HTTP.

``python -m benchmarks.mixed_ab [--dtype bfloat16] [--concurrency 8] [--prompts-per-client 3] [--input-len-range
112,289] [--output-len-range 16,64] [--rounds 2] [--max-num-batched-tokens N]`` loads the model once and runs the
same workload (c clients, each sending its next prompt when the previous one finished) with ``mixed_batches`` on and
off, alternating (on, off, on, off, ...) so a shared machine's drift hits both alike. Output lengths vary
(``ignore_eos``, drawn from the range): with one length for all, requests admitted together finish together and the
next ones start together, so no prefill ever meets a running decode. Per run: output tok/s over wall time, CPU ms
per output token (``time.process_time``: every thread of this process, the figure least moved by other processes on
a shared machine), mean TTFT and P99 inter-token latency (ms between a request's successive tokens). The serving
benchmark (``pdserve bench serve --server-args=--mixed-batches``) measures the same switch end to end.
``--forwards`` times single forwards instead: one mixed forward against the two it replaces.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.forward_batch import ForwardMode
from engine.llm import LLM
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from engine.model_runner import SeqChunk
from engine.tokenizer import Tokenizer
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0


def run_once(llm: LLM, prompts: list[list[int]], concurrency: int, output_lens: list[int]) -> dict:
    """Closed loop: ``concurrency`` clients share ``prompts`` (with ``output_lens``) in order;
    returns the run's figures."""
    sched = llm.scheduler
    todo, lens, sent, last, ttft, itl, tokens = list(prompts), list(output_lens), {}, {}, [], [], 0
    steps0, mixed0 = sched.stats.decode_steps + sched.stats.extend_steps, sched.stats.mixed_steps

    def send() -> None:
        rid = f"r{len(sent)}"
        sp = SamplingParams(max_new_tokens=lens.pop(0), temperature=0, ignore_eos=True)
        sched.add(b"", GenerateRequest(rid=rid, params=sp), todo.pop(0))
        sent[rid] = time.perf_counter()

    for _ in range(min(concurrency, len(todo))):
        send()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    while sched.has_work:
        for d in sched.step().outbox.deltas:
            now = time.perf_counter()
            if d.token_ids:
                tokens += len(d.token_ids)
                (itl.append((now - last[d.rid]) * 1e3) if d.rid in last else ttft.append((now - sent[d.rid]) * 1e3))
                last[d.rid] = now
            if d.finish_reason and todo:
                send()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if sched.kv.tree is not None:  # no prefix reuse between runs
        sched.kv.allocator.free(sched.kv.tree.evict(sched.kv.tree.total_size()))
    return {
        "tok_s": tokens / wall,
        "cpu_ms_per_tok": cpu * 1e3 / tokens,
        "ttft_mean_ms": statistics.mean(ttft),
        "itl_p99_ms": _p99(itl),
        "tokens": tokens,
        "steps": sched.stats.decode_steps + sched.stats.extend_steps - steps0,
        "mixed_steps": sched.stats.mixed_steps - mixed0,
    }


def forward_ab(llm: LLM, shapes: list[tuple[int, int]], repeats: int = 4) -> list[dict]:
    """One MIXED forward of ``d`` decode rows (contexts 200..) plus a fresh ``e``-token prompt
    against the EXTEND and DECODE forwards apart, interleaved ``repeats`` times: best and median
    CPU ms (``time.process_time``) of each, per ``(d, e)`` in ``shapes``."""
    runner, rng = llm.runner, random.Random(1)
    pages = iter(range(runner.allocator.num_pages))  # scratch KV: these forwards own the pool

    def seq(prefix: int, new: int) -> SeqChunk:
        return SeqChunk(
            [rng.randrange(3, llm.model_config.vocab_size) for _ in range(new)],
            prefix,
            [next(pages) for _ in range(-(-(prefix + new) // runner.page_size))],
        )

    rows = []
    for d, e in shapes:
        dec, ext, cpu = [seq(200 + 10 * i, 1) for i in range(d)], [seq(0, e)], {"apart": [], "mixed": []}
        for _ in range(repeats):
            for kind in cpu:
                c = time.process_time()
                if kind == "apart":
                    runner.forward(ForwardMode.EXTEND, ext)
                    runner.forward(ForwardMode.DECODE, dec)
                else:
                    runner.forward(ForwardMode.MIXED, dec + ext, num_decode=d)
                cpu[kind].append((time.process_time() - c) * 1e3)
        rows.append(
            {
                "decode_rows": d,
                "prompt": e,
                **{f"{k}_cpu_ms_{f.__name__}": f(v) for k, v in cpu.items() for f in (min, statistics.median)},
            }
        )
        print(
            f"| {d} | {e} | {min(cpu['mixed']):.0f} | {min(cpu['apart']):.0f} | "
            f"{statistics.median(cpu['mixed']):.0f} | {statistics.median(cpu['apart']):.0f} |",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mixed_ab", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default=None, help="engine dtype (float32, bfloat16; default: the engine's)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompts-per-client", type=int, default=3)
    p.add_argument("--input-len-range", default="112,289")
    p.add_argument("--output-len-range", default="16,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--forwards",
        action="store_true",
        help="instead: one mixed forward against the extend and "
        "decode forwards apart (7+250, 4+120, 7+40 decode rows + prompt tokens), CPU ms",
    )
    p.add_argument("--out", help="write the runs as JSON here")
    a = p.parse_args(argv)
    lo, hi = map(int, a.input_len_range.split(","))
    engine = EngineConfig(model=a.model, kv_pool_tokens=16384, **({"dtype": a.dtype} if a.dtype else {}))
    path = resolve_model_path(engine.model)
    loaded = (*load_for_engine(path, engine), Tokenizer.from_path(path))
    rng = random.Random(a.seed)
    vocab = loaded[0].vocab_size
    n = a.concurrency * a.prompts_per_client
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    out_lo, out_hi = map(int, a.output_len_range.split(","))
    output_lens = [rng.randint(out_lo, out_hi) for _ in range(n)]
    if a.forwards:
        print("| decode rows | prompt | mixed CPU ms (best) | apart (best) | mixed (median) | apart (median) |")
        print("|---|---|---|---|---|---|")
        rows = forward_ab(LLM(engine, SchedulerConfig(), loaded=loaded), [(7, 250), (4, 120), (7, 40)])
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"args": vars(a), "forwards": rows}, f, indent=1)
        return 0
    llms = {
        mixed: LLM(
            engine, SchedulerConfig(mixed_batches=mixed, max_num_batched_tokens=a.max_num_batched_tokens), loaded=loaded
        )
        for mixed in (True, False)
    }
    run_once(llms[True], prompts[:2], 2, [4, 4])  # warm-up: kernels and allocator
    run_once(llms[False], prompts[:2], 2, [4, 4])
    runs = []
    print("| round | mixed | tok/s | CPU ms/out tok | TTFT mean ms | ITL p99 ms | steps | mixed steps |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(1, a.rounds + 1):
        for mixed in (True, False):
            res = {"round": r, "mixed": mixed, **run_once(llms[mixed], prompts, a.concurrency, output_lens)}
            runs.append(res)
            print(
                f"| {r} | {'on' if mixed else 'off'} | {res['tok_s']:.1f} | {res['cpu_ms_per_tok']:.1f} | "
                f"{res['ttft_mean_ms']:.0f} | {res['itl_p99_ms']:.0f} | {res['steps']} | {res['mixed_steps']} |",
                flush=True,
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
