"""``pdserve bench retract``: what retract costs, measured in one run on the same weights.

Both storms admit with ``init_new_token_ratio = STORM_RATIO`` so the small pool overcommits.

1. Colocated: the same workload with an unconstrained KV pool vs a pool at 30% of its demand
   (throughput, completed requests, retractions).
2. PD decode: time to resume a retracted long request from the host pool vs time to re-prefill
   it (the colocated / recompute path), as a ratio.
3. PD retract storm (in-process prefill + decode, loopback transport): decode pool at 30% of
   demand vs unconstrained, goodput in completed tokens/s.
"""

from __future__ import annotations

import random
import time

import torch

from cache.host_pool import HostKVPool
from cache.page_allocator import ceil_div
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from configs.schema import PdserveConfig
from engine.forward_batch import ForwardMode
from engine.llm import LLM, run_batch
from engine.model_runner import ModelRunner, SeqChunk
from transfer.wire.sampling_params import SamplingParams

# Admission that overcommits (reserves 10% of max_new_tokens), so a 30% pool really storms.
STORM_RATIO = 0.1


def _workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def colocated_storm(llm_loaded, engine: EngineConfig, n: int, new_tokens: int) -> None:
    cfg, weights, tok = llm_loaded
    ps = _workload(n, 32, 96, cfg.vocab_size)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=False)
    demand = sum(len(p) + new_tokens for p in ps)
    print(f"[colocated] {n} requests, {demand} tokens of KV demand, {new_tokens} new tokens each")
    outs = {}
    for label, pool in (("unconstrained", demand + 1024), ("30% pool", int(demand * 0.3))):
        llm = LLM(
            engine.model_copy(update={"kv_pool_tokens": pool}),
            SchedulerConfig(max_running_requests=n, init_new_token_ratio=STORM_RATIO),
            loaded=(cfg, weights, tok),
        )
        t = time.perf_counter()
        res = run_batch(llm.scheduler, ps, [sp] * n)
        dt = time.perf_counter() - t
        toks = sum(len(r.token_ids) for r in res)
        done = sum(r.finish_reason in ("stop", "length") for r in res)
        outs[label] = (toks / dt, [r.token_ids for r in res])
        print(
            f"  {label:>13}: pool {pool:6d} tokens, {done}/{n} completed, {toks / dt:7.1f} tok/s, "
            f"{llm.scheduler.stats.retractions} retractions, {dt:6.1f}s"
        )
    same = outs["unconstrained"][1] == outs["30% pool"][1]
    print(
        f"  throughput ratio (30% / unconstrained): {outs['30% pool'][0] / outs['unconstrained'][0]:.2f}; "
        f"outputs identical: {same}"
    )


def resume_vs_reprefill(llm_loaded, engine: EngineConfig, tokens: int) -> None:
    cfg, weights, _ = llm_loaded
    runner = ModelRunner(engine.model_copy(update={"kv_pool_tokens": 2 * tokens + 64}), cfg, weights)
    host = HostKVPool.for_device_pool(runner.pool.buffer, (tokens // runner.page_size + 2) * runner.pool.page_bytes)
    ids = _workload(1, tokens, tokens, cfg.vocab_size, seed=5)[0]
    pages = runner.allocator.alloc(ceil_div(tokens, runner.page_size))
    t = time.perf_counter()
    runner.forward(ForwardMode.EXTEND, [SeqChunk(ids, 0, pages)])
    t_prefill = time.perf_counter() - t
    best_off = best_res = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        kv = host.offload(runner.pool.buffer, pages, tokens)
        best_off = min(best_off, time.perf_counter() - t)
        t = time.perf_counter()
        host.load(runner.pool.buffer, kv, pages)
        best_res = min(best_res, time.perf_counter() - t)
    mb = len(pages) * runner.pool.page_bytes / 2**20
    print(
        f"[PD decode] {tokens}-token request, {mb:.1f} MiB of KV: offload {best_off * 1e3:.1f} ms, "
        f"resume {best_res * 1e3:.1f} ms, re-prefill {t_prefill * 1e3:.0f} ms -> resume is "
        f"{t_prefill / best_res:.0f}x faster than re-prefill"
    )


def pd_storm(llm_loaded, engine: EngineConfig, n: int, new_tokens: int) -> None:
    from bench.harness.pd_harness import PDHarness

    cfg, weights, _ = llm_loaded
    ps = _workload(n, 32, 96, cfg.vocab_size, seed=9)
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    demand = sum(len(p) + new_tokens for p in ps)
    print(f"[PD storm] {n} requests, {demand} tokens of decode KV demand")
    rates = {}
    for label, pool in (("unconstrained", demand + 1024), ("30% pool", int(demand * 0.3))):
        base = {
            "engine": engine.model_dump(),
            "scheduler": {"max_running_requests": n, "init_new_token_ratio": STORM_RATIO},
            "cluster": {"mode": "pd", "transfer_backend": "loopback", "host_kv_pool_gb": 1.0},
        }
        cp = PdserveConfig.model_validate(base)
        cd = PdserveConfig.model_validate({**base, "engine": {**base["engine"], "kv_pool_tokens": pool}})
        cp.engine.kv_pool_tokens = demand + 1024
        h = PDHarness(cp, cd, cfg, weights, eos=())
        t = time.perf_counter()
        for i, p in enumerate(ps):
            h.submit(f"r{i}", p, sp)
        out = h.run(max_steps=10**6)
        dt = time.perf_counter() - t
        toks = sum(len(o["tokens"]) for o in out.values())
        rs = h.decode.retract.stats
        rates[label] = toks / dt
        print(
            f"  {label:>13}: decode pool {pool:6d} tokens, {sum(o['finish'] == 'length' for o in out.values())}/{n}"
            f" completed, goodput {toks / dt:7.1f} tok/s, {h.decode.stats.retractions} retractions "
            f"({rs.offloaded} offloaded, {rs.resumed} resumed, {rs.recomputed} recomputed)"
        )
        h.close()
    print(f"  goodput ratio (30% / unconstrained): {rates['30% pool'] / rates['unconstrained']:.2f}")


def run_retract_bench(engine: EngineConfig, n: int = 16, new_tokens: int = 48, resume_tokens: int = 2048) -> None:
    from engine.loader import load_model_weights
    from engine.model_paths import resolve_model_path
    from engine.tokenizer import Tokenizer

    path = resolve_model_path(engine.model)
    loaded = (*load_model_weights(path), Tokenizer.from_path(path))
    print(f"threads={torch.get_num_threads()} model={path.name}")
    resume_vs_reprefill(loaded, engine, resume_tokens)
    colocated_storm(loaded, engine, n, new_tokens)
    pd_storm(loaded, engine, n, new_tokens)


if __name__ == "__main__":
    run_retract_bench(EngineConfig())
