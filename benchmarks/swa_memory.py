"""KV memory of a sliding-window hybrid with and without the SWA pool, at one fixed KV budget.

``python -m benchmarks.swa_memory --model gemma3-270m --budget-mib 512 --prompt-len 4096``

For each layout (``swa``: sliding layers in the SWA pool; ``full``: every layer in the full pool)
the KV budget in bytes is turned into pools, and the decode worker's own admission code
(``KVManager.reserve_prompt`` with the SWA tail from ``SWAWindow.prealloc_start`` and the decode
reservation of ``PageBudget.prompt_growth``) admits ``prompt-len`` prompts until the pools are full. That
gives the maximum number of concurrent requests and the KV bytes each one holds; no forward pass
is needed for it (the accounting is the one the worker runs). ``--run N`` also serves N requests
through the colocated engine with the real model in each layout and reports the peak number of
running requests it reached (slow on CPU: prompts are computed for real).

The SWA layout splits the budget between its pools in proportion to one request's need (full KV
for every token, SWA KV for the window's span), as one would size ``--swa-pool-tokens`` for the
workload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from cache.kv_budget import PageBudget
from cache.kv_manager import KVManager
from cache.page_allocator import PageAllocator, ceil_div
from cache.swa_window import SWAWindow
from engine.config import ModelConfig


@dataclasses.dataclass
class Layout:
    name: str
    full_pages: int
    swa_pages: int
    full_page_bytes: int
    swa_page_bytes: int

    @property
    def bytes(self) -> int:
        return self.full_pages * self.full_page_bytes + self.swa_pages * self.swa_page_bytes


def _page_bytes(mc: ModelConfig, layers: int, page: int, dtype_bytes: int) -> int:
    return layers * 2 * page * mc.num_kv_heads * mc.head_dim * dtype_bytes


def layouts(mc: ModelConfig, budget: int, prompt_len: int, output_len: int, page: int, dtype_bytes: int):
    """The two layouts of ``budget`` bytes: every layer in the full pool, and the split pools."""
    n_swa = sum(t == "sliding_attention" for t in mc.layer_types)
    all_full = _page_bytes(mc, mc.num_layers, page, dtype_bytes)
    full_b, swa_b = _page_bytes(mc, mc.num_layers - n_swa, page, dtype_bytes), _page_bytes(mc, n_swa, page, dtype_bytes)
    need_full = ceil_div(prompt_len + output_len, page)
    need_swa = SWAWindow(mc.sliding_window, page).max_pages()
    per_request = need_full * full_b + need_swa * swa_b
    n = budget / per_request
    return [
        Layout("full", budget // all_full, 0, all_full, 0),
        Layout("swa", int(n * need_full), int(n * need_swa), full_b, swa_b),
    ]


def admit_all(mc: ModelConfig, lay: Layout, prompt_len: int, output_len: int, page: int) -> tuple[int, int]:
    """Decode-side admission of identical-length, unrelated prompts until one does not fit:
    ``(requests admitted, KV bytes they hold)``."""
    swa = lay.swa_pages > 0
    kv = KVManager(
        PageAllocator(lay.full_pages),
        page,
        False,
        PageAllocator(lay.swa_pages) if swa else None,
        SWAWindow(mc.sliding_window, page) if swa else None,
    )
    handles, growth = [], PageBudget(kv).prompt_growth(prompt_len, output_len)
    while True:
        ids = list(range(len(handles) * prompt_len, (len(handles) + 1) * prompt_len))
        start = kv.window.prealloc_start(prompt_len, radix=False) if swa else 0
        got = kv.reserve_prompt(ids, prompt_len, growth, kv.available(), start)
        if got is None:
            break
        handles.append(got[0])
    full = kv.usage(handles)
    held = (full.used + ceil_div(output_len, page) * len(handles)) * lay.full_page_bytes
    if swa:
        held += kv.usage(handles, "swa").used * lay.swa_page_bytes
    return len(handles), held


def run_real(model: str, lay: Layout, prompt_len: int, output_len: int, page: int, requests: int) -> dict:
    """Serve ``requests`` prompts through the colocated engine in ``lay``; peak running requests."""
    import torch

    from configs.engine import EngineConfig
    from configs.scheduler import SchedulerConfig
    from engine.llm import LLM
    from transfer.wire.protocol import GenerateRequest
    from transfer.wire.sampling_params import SamplingParams

    eng = EngineConfig(
        model=model, page_size=page, kv_pool_tokens=lay.full_pages * page, swa_pool_tokens=lay.swa_pages * page
    )
    llm = LLM(eng, SchedulerConfig(max_running_requests=256))
    g = torch.Generator().manual_seed(0)
    vocab = llm.model_config.vocab_size
    sched, peak, t0 = llm.scheduler, 0, time.perf_counter()
    sp = SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True)
    for i in range(requests):
        ids = torch.randint(300, min(vocab, 20000), (prompt_len,), generator=g).tolist()
        sched.add(b"", GenerateRequest(rid=f"m{i}", params=sp), ids)
    while sched.has_work:
        sched.step()
        peak = max(peak, len(sched.running))
    sched.check_integrity()
    return {"peak_running": peak, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--budget-mib", type=float, default=512)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype-bytes", type=int, default=4, help="4 = float32 (CPU), 2 = bf16")
    ap.add_argument("--run", type=int, default=0, help="also serve this many requests with the real model")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--decode-batch",
        type=int,
        default=0,
        help="instead: decode tok/s of this many requests, SWA pool vs all-full (real model)",
    )
    ap.add_argument("--window", type=int, default=64, help="with --decode-batch on a model that does not slide")
    a = ap.parse_args(argv)
    if a.decode_batch:
        for L in a.prompt_len:
            print(
                f"decode tok/s, {a.decode_batch} x {L} tokens:",
                decode_speed(a.model, a.window, a.decode_batch, L, a.output_len, a.page_size),
            )
        return
    from engine.loader import read_model_config
    from engine.model_paths import resolve_model_path

    mc = read_model_config(resolve_model_path(a.model))
    rows = []
    for L in a.prompt_len:
        for lay in layouts(mc, int(a.budget_mib * 2**20), L, a.output_len, a.page_size, a.dtype_bytes):
            n, held = admit_all(mc, lay, L, a.output_len, a.page_size)
            row = {
                "prompt_len": L,
                "layout": lay.name,
                "pool_mib": round(lay.bytes / 2**20, 1),
                "max_concurrent": n,
                "kv_mib_per_request": round(held / max(n, 1) / 2**20, 2),
            }
            if a.run:
                row.update(run_real(a.model, lay, L, a.output_len, a.page_size, a.run))
            rows.append(row)
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    _print_table(mc, a, rows)


def _print_table(mc: ModelConfig, a, rows: list[dict]) -> None:
    print(
        f"{mc.name}: {mc.num_layers} layers ({sum(t == 'sliding_attention' for t in mc.layer_types)} sliding, "
        f"window {mc.sliding_window}), KV budget {a.budget_mib:g} MiB, {a.output_len} output tokens"
    )
    print(
        "| prompt | layout | pools MiB | max concurrent | KV MiB / request |"
        + (" peak running (real) |" if a.run else "")
    )
    print("|---|---|---|---|---|" + ("---|" if a.run else ""))
    for r in rows:
        extra = f" {r['peak_running']} ({r['seconds']} s) |" if a.run else ""
        print(
            f"| {r['prompt_len']} | {r['layout']} | {r['pool_mib']} | {r['max_concurrent']} | "
            f"{r['kv_mib_per_request']} |{extra}"
        )
    for L in a.prompt_len:
        full, swa = [r for r in rows if r["prompt_len"] == L]
        if not full["max_concurrent"]:
            print(
                f"prompt {L}: the all-full layout cannot hold one request; the SWA pool holds {swa['max_concurrent']}"
            )
            continue
        print(
            f"prompt {L}: SWA pool / all-full: {swa['max_concurrent'] / full['max_concurrent']:.2f}x "
            f"concurrent requests, {swa['kv_mib_per_request'] / full['kv_mib_per_request']:.2f}x KV bytes "
            f"per request"
        )


if __name__ == "__main__":
    main()


def decode_speed(model: str, window: int, batch: int, prompt_len: int, new_tokens: int, page: int = 16) -> dict:
    """Decode tok/s of ``batch`` requests with the sliding layers in the SWA pool vs in the full
    pool, same model and same prompts, alternating the two engines (``t(N) - t(1)`` so prefill
    cancels out; best of 2). ``model``'s layers alternate sliding/full with ``window``
    (``--layer-types alternate``) unless the model slides already."""
    import random

    from configs.engine import EngineConfig
    from configs.scheduler import SchedulerConfig
    from engine.llm import LLM, run_batch
    from transfer.wire.sampling_params import SamplingParams

    swa_kw = {} if model.startswith("gemma3") else {"sliding_window": window, "layer_types": "alternate"}
    llms = {
        name: LLM(
            EngineConfig(
                model=model,
                page_size=page,
                kv_pool_tokens=batch * (prompt_len + new_tokens + page),
                swa_pool_tokens=tokens,
                **swa_kw,
            ),
            SchedulerConfig(enable_radix_cache=False, max_running_requests=256),
        )
        for name, tokens in (("swa", batch * (window + 4 * page)), ("full", 0))
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 20000) for _ in range(prompt_len)] for _ in range(batch)]
    best: dict = {}
    for _ in range(2):
        for name, llm in llms.items():
            for n in (1, new_tokens + 1):
                sp = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
                t = time.perf_counter()
                run_batch(llm.scheduler, prompts, [sp] * batch)
                best[name, n] = min(best.get((name, n), 1e9), time.perf_counter() - t)
    return {name: round(batch * new_tokens / (best[name, new_tokens + 1] - best[name, 1]), 1) for name in llms}
