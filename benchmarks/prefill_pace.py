"""Prefill chunks paced by ``prefill_step_s`` against chunks of ``chunked_prefill_size``, in one process.

``python -m benchmarks.prefill_pace [--dtype auto] [--prompts 6] [--prompt-tokens 1500] [--rounds 2]
[--step-s 0.5]`` loads the model once and runs the same burst (``--prompts`` prompts of
``--prompt-tokens`` random tokens, sent at once, one output token each, greedy) through the real
prefill and decode schedulers (``bench.harness.pd_harness``: loopback transport, no HTTP), with
``prefill_step_s`` 0 (off: every step a chunk of ``chunked_prefill_size``) and ``--step-s``,
alternating (off, on, off, on, ...) so a shared machine's drift hits both alike. The decode worker
prefills nothing itself. Per run: the prefill worker's prompt tokens per second of its prefill
forwards, its number of steps, its chunks (smallest, largest), its longest step (the longest a
withdrawal or a drain waits there), and the mean and largest time to first token of the burst.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from bench.harness.pd_harness import PDHarness
from configs.schema import PdserveConfig
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from transfer.wire.sampling_params import SamplingParams


def _cfg(dtype: str, step_s: float, prefill: bool) -> PdserveConfig:
    """A worker of the pair: the prefill side paced by ``step_s``; the decode side prefills nothing itself."""
    cluster = {"mode": "pd", "host_kv_pool_gb": 0.01, "transfer_backend": "loopback"}
    if not prefill:
        cluster |= {"local_prefill_max_tokens": 0, "local_prefill_backlog_ratio": 0.0}
    return PdserveConfig.model_validate(
        {
            "engine": {"dtype": dtype, "kv_pool_tokens": 32768},
            "scheduler": {"prefill_step_s": step_s},
            "cluster": cluster,
        }
    )


def run_once(loaded, dtype: str, step_s: float, prompts: list[list[int]]) -> dict:
    """The burst through a fresh pair whose prefill worker is paced by ``step_s``; the run's figures."""
    h = PDHarness(_cfg(dtype, step_s, True), _cfg(dtype, 0.0, False), *loaded)
    chunks, steps_s = [], []
    extend = h.prefill.executor.extend

    def timed(items):
        t0 = time.perf_counter()
        try:
            return extend(items)
        finally:
            steps_s.append(time.perf_counter() - t0)
            chunks.append(sum(i.length for i in items))

    h.prefill.executor.extend = timed
    params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, params)
    ttft: dict[str, float] = {}
    while h.busy:
        for d in h.step():
            if d.token_ids and d.rid not in ttft:
                ttft[d.rid] = time.perf_counter() - t0
    stats = h.prefill.stats
    h.close()
    return {
        "prefill_step_s": step_s,
        "prefill_tok_s": round(stats.prefill_computed_tokens / stats.prefill_compute_seconds, 1),
        "steps": len(chunks),
        "chunk_min": min(chunks),
        "chunk_max": max(chunks),
        "longest_step_s": round(max(steps_s), 3),
        "ttft_mean_s": round(statistics.mean(ttft.values()), 2),
        "ttft_max_s": round(max(ttft.values()), 2),
        "load_1min": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-s", type=float, default=0.5)
    a = ap.parse_args()
    engine = _cfg(a.dtype, 0.0, True).engine
    config, weights = load_for_engine(resolve_model_path(engine.model), engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, config.vocab_size) for _ in range(a.prompt_tokens)] for _ in range(a.prompts)]
    run_once((config, weights), a.dtype, a.step_s, prompts[:1])  # warm-up: kernels built, caches hot
    for _ in range(a.rounds):
        for step_s in (0.0, a.step_s):
            print(json.dumps(run_once((config, weights), a.dtype, step_s, prompts)), flush=True)


if __name__ == "__main__":
    main()
