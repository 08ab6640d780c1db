"""The C expert kernel (engine.kernels.cpu_moe): equal to the torch expert loop in float32, within the
bfloat16 rounding bound of its activations in bfloat16, its vdpbf16ps and widened bfloat16 paths
agreeing, and engine.moe taking it for decode-sized CPU steps in one call and for larger ones in
chunks of ``LARGE_STEP_ROWS`` rows."""

from __future__ import annotations

import pytest
import torch

from engine import moe
from engine.config import MoeSpec
from engine.kernels import cpu_moe
from engine.kernels.cpu_library import load

pytestmark = [pytest.mark.unit, pytest.mark.skipif(load() is None, reason="no C compiler: the torch path runs")]

HIDDEN, INTER, EXPERTS = 64, 96, 8


def _layer(seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {
        "router": torch.randn(EXPERTS, HIDDEN, generator=g),
        "experts_gate_up": torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5,
        "experts_down": torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5,
    }
    return {n: t.to(dtype) for n, t in w.items()}


def _x(rows: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 5, 37, 64])
@pytest.mark.parametrize("top_k, norm", [(2, True), (3, False)])
def test_float32_equals_the_torch_expert_loop(rows, top_k, norm):
    spec, w, x = MoeSpec(EXPERTS, top_k, INTER, norm, (0,)), _layer(), _x(rows)
    torch.testing.assert_close(moe.moe_mlp(x, w, spec), moe.moe_mlp(x, w, spec, kernel=False), rtol=1e-5, atol=1e-6)


def _grouping(x, w, spec):
    weights, experts = moe.route(x, w["router"], spec.top_k, spec.norm_topk_prob)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=spec.num_experts)
    chosen = counts.nonzero().flatten()
    offsets = torch.nn.functional.pad(counts[chosen].cumsum(0), (1, 0))
    return chosen, offsets, order // spec.top_k, weights.flatten()[order].float()


def _reference_and_bound(x, w, chosen, offsets, tokens, pair_w) -> tuple[torch.Tensor, torch.Tensor]:
    """The same grouping in float32 from the bfloat16 values, and per output element 2^-8 * the sum
    over the token's experts of weight * (|down| @ |act|): the kernel rounds each act to bfloat16
    (relative 2^-9) and sums exact products in float32 (2x margin for those sums and SiLU)."""
    xf, gu, dn = x.float(), w["experts_gate_up"].float(), w["experts_down"].float()
    ref, bound = torch.zeros_like(xf), torch.zeros_like(xf)
    for a, e in enumerate(chosen.tolist()):
        rows = tokens[offsets[a] : offsets[a + 1]]
        g, u = (xf[rows] @ gu[e].T).chunk(2, dim=-1)
        act = torch.nn.functional.silu(g) * u
        ref[rows] += pair_w[offsets[a] : offsets[a + 1], None] * (act @ dn[e].T)
        bound[rows] += pair_w[offsets[a] : offsets[a + 1], None] * (act.abs() @ dn[e].abs().T)
    return ref, bound * 2**-8 + 1e-6


@pytest.mark.parametrize("kind", [cpu_moe.KIND_BF16, cpu_moe.KIND_BF16_WIDEN])
@pytest.mark.parametrize("rows", [1, 6, 37])
def test_bfloat16_is_within_the_rounding_bound_of_its_activations(kind, rows):
    spec, w, x = MoeSpec(EXPERTS, 2, INTER, True, (0,)), _layer(dtype=torch.bfloat16), _x(rows, torch.bfloat16)
    group = _grouping(x, w, spec)
    got = cpu_moe.expert_ffn(x, w["experts_gate_up"], w["experts_down"], *group, kind=kind)
    ref, bound = _reference_and_bound(x, w, *group)
    err = (got - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"
    assert err.max() > 0  # the activations are rounded: a float32-exact result would mean no bfloat16 path ran


def test_the_dot_and_widened_bfloat16_paths_agree():
    if not cpu_moe.dot_available():
        pytest.skip("no AVX512-BF16: both kinds run the widened path")
    spec, w, x = MoeSpec(EXPERTS, 2, INTER, True, (0,)), _layer(dtype=torch.bfloat16), _x(9, torch.bfloat16)
    group = _grouping(x, w, spec)
    args = (x, w["experts_gate_up"], w["experts_down"], *group)
    dot, widen = (
        cpu_moe.expert_ffn(*args, kind=cpu_moe.KIND_BF16),
        cpu_moe.expert_ffn(*args, kind=cpu_moe.KIND_BF16_WIDEN),
    )
    # exact products summed in float32 in another order; the bfloat16 activations may round apart
    torch.testing.assert_close(dot, widen, rtol=2e-2, atol=2e-3)


def _kernel_calls(monkeypatch) -> list[int]:
    """The row counts of every ``cpu_moe.expert_ffn`` call from now on."""
    calls: list[int] = []
    real = cpu_moe.expert_ffn
    monkeypatch.setattr(cpu_moe, "expert_ffn", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    return calls


def test_moe_mlp_takes_one_kernel_call_per_decode_step_and_chunks_larger_steps(monkeypatch):
    spec, w = MoeSpec(EXPERTS, 2, INTER, True, (0,)), _layer()
    calls = _kernel_calls(monkeypatch)
    moe.moe_mlp(_x(moe.KERNEL_MAX_ROWS), w, spec)
    assert calls == [moe.KERNEL_MAX_ROWS]
    monkeypatch.setattr(moe, "LARGE_STEP_ROWS", 48)
    moe.moe_mlp(_x(moe.KERNEL_MAX_ROWS + 1), w, spec)
    assert calls[1:] == [48, moe.KERNEL_MAX_ROWS + 1 - 48]
    calls.clear()
    monkeypatch.setattr(moe, "LARGE_STEP_ROWS", 0)  # large steps keep the torch matmuls
    moe.moe_mlp(_x(moe.KERNEL_MAX_ROWS + 1), w, spec)
    monkeypatch.setattr(moe, "KERNEL_MAX_ROWS", 0)  # the kernel off for every step
    moe.moe_mlp(_x(2), w, spec)
    assert calls == []


@pytest.mark.parametrize("rows, chunk", [(150, 64), (150, 512), (97, 32)])
@pytest.mark.parametrize("top_k, norm", [(2, True), (3, False)])
def test_large_steps_in_kernel_chunks_equal_the_torch_expert_loop(monkeypatch, rows, chunk, top_k, norm):
    """Every row in exactly one chunk: a dropped chunk leaves its rows zero, a row run twice doubles."""
    spec, w, x = MoeSpec(EXPERTS, top_k, INTER, norm, (0,)), _layer(), _x(rows)
    monkeypatch.setattr(moe, "LARGE_STEP_ROWS", chunk)
    calls = _kernel_calls(monkeypatch)
    got = moe.moe_mlp(x, w, spec)
    assert sum(calls) == rows and len(calls) == -(-rows // chunk)
    torch.testing.assert_close(got, moe.moe_mlp(x, w, spec, kernel=False), rtol=1e-5, atol=1e-6)


def test_large_bfloat16_steps_in_kernel_chunks_stay_within_the_rounding_of_the_torch_loop(monkeypatch):
    spec, w, x = MoeSpec(EXPERTS, 2, INTER, True, (0,)), _layer(dtype=torch.bfloat16), _x(130, torch.bfloat16)
    monkeypatch.setattr(moe, "LARGE_STEP_ROWS", 64)
    got, ref = moe.moe_mlp(x, w, spec).float(), moe.moe_mlp(x, w, spec, kernel=False).float()
    # the torch loop rounds each expert's output to bfloat16 and sums in bfloat16; the kernel rounds once
    torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-2)
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()


def test_shapes_outside_the_kernel_keep_the_torch_path():
    w = _layer()
    assert cpu_moe.takes(_x(2), w["experts_gate_up"], w["experts_down"])
    assert not cpu_moe.takes(_x(2)[:, :48], w["experts_gate_up"][:, :, :48], w["experts_down"][:, :48])
    assert not cpu_moe.takes(_x(2, torch.bfloat16), w["experts_gate_up"], w["experts_down"])
    assert not cpu_moe.takes(_x(2).to(torch.float16), *(t.half() for t in (w["experts_gate_up"], w["experts_down"])))


def test_int8_experts_are_within_the_rounding_bound_against_their_dequantized_weights():
    if not cpu_moe.dot_available():
        pytest.skip("int8 experts run the kernel only with AVX512-BF16")
    spec, w, x = MoeSpec(EXPERTS, 2, INTER, True, (0,)), _layer(dtype=torch.bfloat16), _x(7, torch.bfloat16)
    q = {}
    for name in ("experts_gate_up", "experts_down"):
        q[name], q[name + "_scale"] = moe.quantize_rows(w[name])
    group = _grouping(x, w, spec)
    scales = (q["experts_gate_up_scale"], q["experts_down_scale"])
    got = cpu_moe.expert_ffn(x, q["experts_gate_up"], q["experts_down"], *group, scales=scales)
    deq = {n: q[n].float() * q[n + "_scale"][..., None] for n in ("experts_gate_up", "experts_down")}
    ref, bound = _reference_and_bound(x, deq, *group)
    assert ((got - ref).abs() <= bound).all()
    # the int8 values, not the bfloat16 ones, were read: against those the result is further off
    assert (got - _reference_and_bound(x, w, *group)[0]).abs().max() > (got - ref).abs().max()
    # moe_mlp takes the int8 experts through the kernel, and its torch path dequantizes them
    layer = {"router": w["router"], **q}
    torch.testing.assert_close(moe.moe_mlp(x, layer, spec), got.bfloat16())
    torch.testing.assert_close(moe.moe_mlp(x, layer, spec, kernel=False).float(), ref, rtol=0.05, atol=0.02)
