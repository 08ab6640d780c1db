"""Mixed forward steps (decode rows first, then extend rows) through every attention backend: the
outputs and the KV written equal the torch backend running the decode rows and the extend rows
as two separate steps (its own, already tested, DECODE and EXTEND paths). Triton runs in its
interpreter on CPU, hence ``TRITON_INTERPRET`` before anything imports triton."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.attention import CpuBackend, TorchBackend, TritonBackend  # noqa: E402
from engine.forward_batch import ForwardMode  # noqa: E402
from engine.kernels import cpu_native, triton_available  # noqa: E402
from engine.model_runner import ModelRunner, SeqChunk  # noqa: E402
from tests.support.models import engine_cfg, tiny_config, tiny_weights  # noqa: E402

P = 4
DECODE_PREFIXES = [5, 17, 30, 8]  # decode rows: one new token on top of these
EXTEND_ROWS = [(0, 9), (12, 7), (3, 1)]  # (cached prefix, new tokens): fresh, radix hit, a 1-token chunk


def _triton_skip() -> str | None:
    if not triton_available():
        return "triton is not importable"
    from engine.kernels._triton_kernels import interpreter_usable

    return None if interpreter_usable() else "triton was imported before TRITON_INTERPRET=1 was set"


def _backend(kind: str, runner: ModelRunner, windows):
    args = (runner.pools, runner.model_config.num_heads, 0.25, windows)
    if kind == "torch":
        return TorchBackend(*args)
    if kind == "cpu":
        if cpu_native.load() is None:
            pytest.skip("no C compiler for the CPU kernel")
        return CpuBackend(*args, threads=2)
    if (reason := _triton_skip()) is not None:
        pytest.skip(reason)
    return TritonBackend(*args, kernels="triton")


def _case(seed: int):
    """A tiny runner with random KV in its pool, decode and extend seqs on shuffled pages, and
    random q/k/v per layer for the step's tokens."""
    cfg = tiny_config()
    runner = ModelRunner(engine_cfg(kv_pool_tokens=512, page_size=P, attention_backend="torch"), cfg, tiny_weights(cfg))
    g = torch.Generator().manual_seed(seed)
    runner.pools.units.copy_(torch.randn(runner.pools.units.shape, generator=g))
    free = torch.randperm(runner.pools.full.num_pages, generator=g).tolist()

    def seq(prefix: int, new: int) -> SeqChunk:
        pages = [free.pop() for _ in range(-(-(prefix + new) // P))]
        return SeqChunk(torch.randint(0, cfg.vocab_size, (new,), generator=g).tolist(), prefix, pages)

    dec = [seq(p, 1) for p in DECODE_PREFIXES]
    ext = [seq(p, n) for p, n in EXTEND_ROWS]
    T = len(dec) + sum(n for _, n in EXTEND_ROWS)
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = [
        (torch.randn(T, H, D, generator=g), torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, D, generator=g))
        for _ in range(cfg.num_layers)
    ]
    return runner, dec, ext, qkv


def _run(backend, batch, qkv, rows: slice) -> list[torch.Tensor]:
    backend.prepare(batch)
    return [backend.forward(q[rows], k[rows], v[rows], layer, batch) for layer, (q, k, v) in enumerate(qkv)]


@pytest.mark.parametrize("kind", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("window", [None, 6])
def test_mixed_step_equals_decode_and_extend_apart(kind, window):
    runner, dec, ext, qkv = _case(seed=3 if window is None else 4)
    windows = [None, window]  # layer 1 slides over the full pool when window is set
    start = runner.pools.units.clone()
    d = len(dec)
    ref = TorchBackend(runner.pools, runner.model_config.num_heads, 0.25, windows)
    want_dec = _run(ref, runner.build_batch(ForwardMode.DECODE, dec), qkv, slice(0, d))
    want_ext = _run(ref, runner.build_batch(ForwardMode.EXTEND, ext), qkv, slice(d, None))
    want_pool = runner.pools.units.clone()

    runner.pools.units.copy_(start)
    mixed = runner.build_batch(ForwardMode.MIXED, dec + ext, num_decode=d)
    backend, decoded = _backend(kind, runner, windows), []
    decode = backend._decode  # the decode rows must take the backend's decode kernel, not the extend path
    backend._decode = lambda q, layer, batch: decoded.append((layer, q.shape[0])) or decode(q, layer, batch)
    got = _run(backend, mixed, qkv, slice(None))
    assert decoded == [(layer, d) for layer in range(len(qkv))]
    for layer, out in enumerate(got):
        assert out.shape == (mixed.input_ids.shape[0], runner.model_config.num_heads * runner.model_config.head_dim)
        torch.testing.assert_close(out[:d], want_dec[layer], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[d:], want_ext[layer], rtol=1e-5, atol=1e-5)
    assert torch.equal(runner.pools.units, want_pool), "the mixed step stored K/V somewhere else"


def test_split_cuts_rows_and_tokens():
    runner, dec, ext, _ = _case(seed=5)
    mixed = runner.build_batch(ForwardMode.MIXED, dec + ext, num_decode=len(dec))
    a, b = mixed.split()
    assert (a.mode, b.mode) == (ForwardMode.DECODE, ForwardMode.EXTEND)
    assert a.extend_lens_cpu == [1] * len(dec) and b.extend_lens_cpu == [n for _, n in EXTEND_ROWS]
    assert a.seq_lens_cpu == [p + 1 for p in DECODE_PREFIXES] and b.seq_lens_cpu == [p + n for p, n in EXTEND_ROWS]
    assert torch.equal(torch.cat((a.out_slots, b.out_slots)), mixed.out_slots)
    assert torch.equal(torch.cat((a.positions, b.positions)), mixed.positions)
    assert mixed.last_token_indices().tolist() == [0, 1, 2, 3, 4 + 8, 4 + 8 + 7, 4 + 8 + 7 + 1]


@pytest.mark.parametrize("num_decode", [0, 7])
def test_a_mixed_step_needs_decode_rows_first(num_decode):
    runner, dec, ext, _ = _case(seed=6)
    with pytest.raises(ValueError, match="one-token decode rows first"):
        runner.build_batch(ForwardMode.MIXED, dec + ext, num_decode=num_decode)
    with pytest.raises(ValueError, match="one-token decode rows first"):  # an extend row of 9 tokens leads
        runner.build_batch(ForwardMode.MIXED, ext + dec, num_decode=1)


@pytest.mark.parametrize("window", [None, 6])
def test_cpu_extend_through_the_paged_kernel_equals_the_torch_backend(window):
    """A pure EXTEND step (fresh prompt, radix hit, one-token chunk) on the CPU backend, one kernel
    row per new token reading its keys from the pool, against torch's per-request SDPA."""
    runner, dec, ext, qkv = _case(seed=7 if window is None else 8)
    windows, rows = [None, window], slice(len(dec), None)
    start = runner.pools.units.clone()
    batch = runner.build_batch(ForwardMode.EXTEND, ext)
    want = _run(TorchBackend(runner.pools, runner.model_config.num_heads, 0.25, windows), batch, qkv, rows)
    runner.pools.units.copy_(start)
    backend = _backend("cpu", runner, windows)
    kernel = backend._extend_range_of
    used = []
    backend._extend_range_of = lambda *a: used.append(1) or kernel(*a)
    got = _run(backend, batch, qkv, rows)
    assert len(used) == len(qkv)  # every layer took the kernel (all prompts here are short)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
