"""``pdserve bench engine --roofline``: the engine's decode and prefill against the machine's roofs.

Measures the read bandwidth (torch ``sum`` over a float32 tensor, 1 GiB by default) and the matmul
peak (GEMMs of prefill shapes), then per dtype: decode step time per batch size (``B / tok/s`` of the
engine bench's decode rate), prefill time per prompt length, and a profiler breakdown of a few decode
steps by op class. The arithmetic is in ``bench.roofline``.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch
import torch.nn.functional as F

from bench import roofline as rl
from bench.engine_bench import PROMPT_LEN, _decode_rate, _ours, _prompts, _timed
from bench.roofline_report import (
    print_breakdown,
    print_decode,
    print_header,
    print_prefill,
)
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.cpu_features import has_fast_bf16
from engine.cpu_linear import linear, pack
from engine.kernels import cpu_native
from engine.llm import LLM
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

GEMM_ROWS = 512
# "int8": --dtype bfloat16 --weight-dtype int8 (prompts run the bfloat16 GEMM: its peak is bfloat16's)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.bfloat16}


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of ``torch.sum`` over a float32 tensor of ``nbytes``, best of 3 (at the current threads)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # first touch
    return nbytes / _timed(x.sum, 3)


def gemm_shapes(cfg, rows: int = GEMM_ROWS) -> list[tuple[int, int, int]]:
    """``(rows, in, out)`` of the model's layer matmuls at a prefill of ``rows`` tokens."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(rows, h, q + 2 * kv), (rows, h, 2 * i), (rows, i, h)]


def matmul_peak(dtype: str, shapes: list[tuple[int, int, int]], repeats: int = 10) -> tuple[float, str]:
    """(best FLOP/s, where) over ``shapes``, plain ``F.linear`` and, for float32, the engine's
    oneDNN-packed ``linear``; each the fastest of ``repeats`` single calls (least disturbed by noise)."""
    dt = _TORCH_DTYPES[dtype]
    best, where = 0.0, ""
    with torch.inference_mode():
        for rows, k, n in shapes:
            x, w = torch.randn(rows, k, dtype=dt), torch.randn(n, k, dtype=dt)
            kinds = {"F.linear": (lambda x=x, w=w: F.linear(x, w))}
            if dtype == "float32":
                pw = pack(w)
                kinds["packed"] = lambda x=x, pw=pw: linear(x, pw)
            for kind, fn in kinds.items():
                fn()
                rate = 2 * rows * k * n / _timed(fn, repeats)
                if rate > best:
                    best, where = rate, f"{rows}x{k} @ {k}x{n}, {kind}"
    return best, where


def _llm(engine: EngineConfig, dtype: str, tokens: int, max_batch: int, loaded=None) -> LLM:
    weights = {"dtype": "bfloat16", "weight_dtype": "int8"} if dtype == "int8" else {"dtype": dtype}
    engine = engine.model_copy(update={**weights, "kv_pool_tokens": engine.kv_pool_tokens or tokens})
    return LLM(
        engine, SchedulerConfig(max_running_requests=max(max_batch, 8), chunked_prefill_size=8192), loaded=loaded
    )


def decode_rows(
    llm: LLM, dtype: str, batch_sizes: list[int], decode_tokens: int, bw: float, peak: float = 0.0
) -> list[dict]:
    """Per batch size: bytes and FLOPs per step, the bound (the slower of bytes at ``bw`` and FLOPs
    at the matmul ``peak``), measured step time (``B / decode tok/s``), fraction."""
    cfg, rows = llm.model_config, []
    context = PROMPT_LEN + decode_tokens // 2  # mean context over the timed steps
    for b in batch_sizes:
        rate = _decode_rate(
            lambda p, n: _ours(llm, p, n), _prompts(b, PROMPT_LEN, cfg.vocab_size, seed=b), decode_tokens
        )
        nbytes, flops = rl.decode_step_bytes(cfg, dtype, [context] * b), rl.decode_step_flops(cfg, [context] * b)
        roof = rl.Roof(rl.decode_bound_s(nbytes, bw, flops, peak), b / rate)
        rows.append(
            {
                "dtype": dtype,
                "batch": b,
                "context": context,
                "bytes": nbytes,
                "flops": flops,
                "compute_s": flops / peak if peak > 0 else 0.0,
                "roof": roof,
            }
        )
    return rows


def prefill_rows(llm: LLM, dtype: str, lengths: list[int], peak: float) -> list[dict]:
    """Per prompt length: FLOPs, bound at ``peak``, measured time (one prompt, 1 new token), fraction."""
    cfg, rows = llm.model_config, []
    for n in lengths:
        t = _ours(llm, _prompts(1, n, cfg.vocab_size, seed=n), 1)
        flops = rl.prefill_flops(cfg, n)
        rows.append(
            {"dtype": dtype, "tokens": n, "flops": flops, "peak": peak, "roof": rl.Roof(rl.bound_s(flops, peak), t)}
        )
    return rows


# (module, function or Class.method, profiler range): the C kernels' ctypes entry points, called
# through their module's (or class's) attribute on every call, so patching it reaches every caller
_C_KERNELS = (
    ("engine.kernels.cpu_native", "paged_decode", rl.C_ATTENTION),
    ("engine.kernels.cpu_native", "paged_extend", rl.C_EXTEND),
    ("engine.kernels.cpu_native", "gemv_bf16", rl.C_GEMV),
    ("engine.kernels.cpu_native", "gemv_i8w", rl.C_GEMV_I8),
    ("engine.kernels.cpu_native", "gemm_pairs", rl.C_PAIRS),
    ("engine.kernels.fused", "rms_norm", rl.C_FUSED),
    ("engine.kernels.fused", "add_rms_norm", rl.C_FUSED),
    ("engine.kernels.fused", "rope", rl.C_FUSED),
    ("engine.kernels.fused", "silu_mul", rl.C_FUSED),
    ("engine.kernels.fused", "store_kv", rl.C_STORE),
    ("engine.decode_stack", "DecodeStack.run", rl.C_STACK),
)


@contextlib.contextmanager
def _labelled_c_kernels():
    """While open, each C kernel's call (a ctypes call, no aten op) runs inside a profiler range
    named for it (``_C_KERNELS``), so the breakdown counts it in its class."""
    import importlib

    def labelled(fn, name):
        def call(*args, **kw):
            with torch.profiler.record_function(name):
                return fn(*args, **kw)

        return call

    saved = []
    for module, path, name in _C_KERNELS:
        owner = importlib.import_module(module)
        *outer, attr = path.split(".")  # "Class.method": the method is patched on its class
        for part in outer:
            owner = getattr(owner, part)
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, labelled(getattr(owner, attr), name))
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def profile_decode(llm: LLM, batch: int, steps: int = 6, warm: int = 2) -> tuple[float, dict[str, float]]:
    """(mean wall seconds per decode step, seconds per class per step) of ``steps`` decode steps of
    ``batch`` sequences under ``torch.profiler`` (which slows every op a little)."""
    from torch.profiler import ProfilerActivity, profile

    sched, vocab = llm.scheduler, llm.model_config.vocab_size
    sp = SamplingParams(max_new_tokens=warm + steps + 4, temperature=0, ignore_eos=True)
    if sched.kv.tree is not None:  # room for the batch: drop what earlier runs left cached
        sched.kv.allocator.free(sched.kv.tree.evict(sched.kv.tree.total_size()))
    for i, p in enumerate(_prompts(batch, PROMPT_LEN, vocab, seed=100 + batch)):
        sched.add(b"", GenerateRequest(rid=f"roofline-{batch}-{i}", params=sp), p)
    while sched.waiting or sched.admission.chunked:  # prefill steps
        sched.step()
    for _ in range(warm):
        sched.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof, _labelled_c_kernels():
        t = time.perf_counter()
        for _ in range(steps):
            sched.step()
        wall = time.perf_counter() - t
    while sched.has_work:
        sched.step()
    rows = [(e.key, e.self_cpu_time_total / 1e6 / steps) for e in prof.key_averages()]
    return wall / steps, rl.breakdown(rows, wall / steps)


def usable_dtypes(dtypes: list[str]) -> tuple[list[str], list[str]]:
    """(dtypes to measure, lines saying why the others are skipped)."""
    keep, why = [], []
    for d in dtypes:
        if d not in _TORCH_DTYPES:
            why.append(f"{d}: not measured (roofline dtypes: {', '.join(_TORCH_DTYPES)})")
        elif d == "bfloat16" and has_fast_bf16() is False:
            why.append("bfloat16: skipped, this CPU has no AVX512_BF16/AMX (the engine would run float32)")
        elif d == "int8" and not (has_fast_bf16() is True and cpu_native.gemv_available()):
            why.append("int8: skipped, int8 weights need AVX512-BF16 and the C kernels")
        else:
            keep.append(d)
    return keep, why


def run_roofline(
    engine: EngineConfig,
    dtypes: list[str],
    batch_sizes: list[int],
    decode_tokens: int,
    prefill_lengths: list[int],
    profile_batches: list[int],
    bandwidth_bytes: int = 1 << 30,
    loaded=None,
) -> dict:
    """Measure and print every section; returns the rows (``loaded``: a model already in memory, as ``LLM``)."""
    dtypes, skipped = usable_dtypes(dtypes)
    bw = read_bandwidth(bandwidth_bytes)
    tokens = max(batch_sizes + profile_batches) * (PROMPT_LEN + decode_tokens + 16) + max(prefill_lengths) + 64
    out: dict = {"bandwidth": bw, "peaks": {}, "decode": [], "prefill": [], "breakdown": []}
    for dtype in dtypes:
        llm = _llm(engine, dtype, tokens, max(batch_sizes + profile_batches), loaded)
        if not out["peaks"]:
            print_header(bw, bandwidth_bytes, skipped, llm)
        peak, where = matmul_peak(dtype, gemm_shapes(llm.model_config))
        out["peaks"][dtype] = (peak, where)
        _ours(llm, _prompts(2, 16, llm.model_config.vocab_size), 4)  # warm-up
        out["decode"] += decode_rows(llm, dtype, batch_sizes, decode_tokens, bw, peak)
        out["prefill"] += prefill_rows(llm, dtype, prefill_lengths, peak)
        for b in profile_batches:
            wall, secs = profile_decode(llm, b)
            out["breakdown"].append({"dtype": dtype, "batch": b, "wall": wall, "seconds": secs})
        del llm
        gc.collect()
    print_decode(out["decode"], bw)
    print_prefill(out["prefill"], out["peaks"])
    print_breakdown(out["breakdown"])
    return out
