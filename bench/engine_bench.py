"""``pdserve bench engine``: this engine vs HF transformers on the same weights, in one run.

Decode tokens/s at several batch sizes: ``B * (N - 1) / (t(N new tokens) - t(1 new token))`` for
both engines, so prefill time cancels out; prefill tokens/s on one long prompt. Prints ratios.
"""

from __future__ import annotations

import random
import time

import torch

from bench.results import Table
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.llm import LLM, run_batch
from transfer.wire.sampling_params import SamplingParams

PROMPT_LEN = 64


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def _timed(fn, repeats: int = 2) -> float:
    """Best of ``repeats`` wall times (the machine may be shared; the minimum is the least noisy)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _ours(llm: LLM, prompts, new_tokens: int) -> float:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    kv = llm.scheduler.kv

    def once():
        if kv.tree is not None:  # no prefix reuse between repeats: measure the full computation
            kv.allocator.free(kv.tree.evict(kv.tree.total_size()))
        run_batch(llm.scheduler, prompts, [sp] * len(prompts))

    return _timed(once)


def _hf(model, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        return _timed(
            lambda: model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        )


def _decode_rate(run, prompts, n: int) -> float:
    t1, tn = run(prompts, 1), run(prompts, n)
    return len(prompts) * (n - 1) / max(tn - t1, 1e-9)


def run_engine_bench(
    engine: EngineConfig, batch_sizes: list[int], decode_tokens: int, prefill_tokens: int, with_hf: bool = True
) -> dict:
    need = max(batch_sizes) * (PROMPT_LEN + decode_tokens) + prefill_tokens + 64
    engine = engine.model_copy(update={"kv_pool_tokens": engine.kv_pool_tokens or need})
    llm = LLM(engine, SchedulerConfig(max_running_requests=max(batch_sizes), chunked_prefill_size=8192))
    vocab = llm.model_config.vocab_size
    hf = _load_hf(engine, llm.runner.dtype) if with_hf else None  # same dtype: a like-for-like ratio
    print(
        f"threads={torch.get_num_threads()} dtype={llm.runner.dtype} device={llm.runner.device} "
        f"page_size={engine.page_size} prompt_len={PROMPT_LEN} decode_tokens={decode_tokens}"
    )
    results: dict = {}
    _ours(llm, _prompts(2, 16, vocab), 4)  # warm-up
    for b in batch_sizes:
        ps = _prompts(b, PROMPT_LEN, vocab, seed=b)
        ours = _decode_rate(lambda p, n: _ours(llm, p, n), ps, decode_tokens)
        line = f"decode batch {b:>3}: pdserve {ours:8.1f} tok/s"
        if hf is not None:
            ref = _decode_rate(lambda p, n: _hf(hf, p, n), ps, decode_tokens)
            line += f" | HF {ref:8.1f} tok/s | ratio {ours / ref:5.2f}x"
            results[f"decode_b{b}_ratio"] = ours / ref
            results[f"decode_b{b}_hf"] = ref
        results[f"decode_b{b}"] = ours
        print(line, flush=True)
    long = _prompts(1, prefill_tokens, vocab, seed=7)
    t_ours = _ours(llm, long, 1)
    line = f"prefill {prefill_tokens} tokens: pdserve {prefill_tokens / t_ours:8.1f} tok/s"
    results["prefill"] = prefill_tokens / t_ours
    if hf is not None:
        t_hf = _hf(hf, long, 1)
        line += f" | HF {prefill_tokens / t_hf:8.1f} tok/s | ratio {t_hf / t_ours:5.2f}x"
        results["prefill_ratio"] = t_hf / t_ours
        results["prefill_hf"] = prefill_tokens / t_hf
    print(line, flush=True)
    return results


def engine_tables(results: dict, batch_sizes: list[int], prefill_tokens: int) -> list[Table]:
    """The figures of ``run_engine_bench`` as results tables (HF columns None when it was skipped)."""
    decode = [
        [b, _r(results[f"decode_b{b}"]), _r(results.get(f"decode_b{b}_hf")), _r(results.get(f"decode_b{b}_ratio"), 2)]
        for b in batch_sizes
    ]
    prefill = [
        [prefill_tokens, _r(results["prefill"]), _r(results.get("prefill_hf")), _r(results.get("prefill_ratio"), 2)]
    ]
    return [
        Table(title="decode", columns=["batch", "pdserve tok/s", "HF tok/s", "ratio"], rows=decode),
        Table(title="prefill", columns=["prompt tokens", "pdserve tok/s", "HF tok/s", "ratio"], rows=prefill),
    ]


def _r(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _load_hf(engine: EngineConfig, dtype: torch.dtype):
    """transformers' load of ``engine.model`` in ``dtype`` (the one pdserve's runner picked)."""
    from transformers import AutoModelForCausalLM

    from engine.model_paths import resolve_model_path

    path = resolve_model_path(engine.model)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if path.suffix == ".gguf" else path
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kw).eval()


if __name__ == "__main__":
    run_engine_bench(EngineConfig(), [1, 8, 32], 32, 512)
