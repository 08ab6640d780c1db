"""The register-blocked expert GEMM (``cpu_moe.expert_gemm``, ``cpu_moe_gemm.c``) against a float32 torch
reference of the same grouping: every (token, expert) pair counted once, at row counts around the
register block and the kernel's step limits, with uneven expert groups (one expert with every token,
one with a single token, one with none), bfloat16 and int8 experts; and ``moe_mlp`` takes it for a
bfloat16 layer whose experts were laid out at load. Skipped where the CPU has no AVX512-BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import moe
from engine.config import MoeSpec
from engine.kernels import cpu_moe

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not cpu_moe.gemm_available(), reason="the expert GEMM needs AVX512-BF16"),
]

E, HIDDEN, INTER, TOP_K = 8, 128, 64, 2


def _experts(int8: bool):
    """(stacked gate_up, down, scales or None) with random bfloat16 or int8 weights."""
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(E, 2 * INTER, HIDDEN, generator=g) * 0.1).bfloat16()
    down = (torch.randn(E, HIDDEN, INTER, generator=g) * 0.1).bfloat16()
    if not int8:
        return gate_up, down, None
    (gq, gs), (dq, ds) = moe.quantize_rows(gate_up), moe.quantize_rows(down)
    return gq, dq, (gs, ds)


def _uneven_routing(rows: int):
    """``(weights, experts)`` ``[rows, 2]``: expert 0 takes every token, expert 6 only token 0, the others
    (1-4) a random share, expert 5 and 7 none; weights random in (0, 1)."""
    g = torch.Generator().manual_seed(rows)
    second = torch.randint(1, 5, (rows,), generator=g)
    second[0] = 6
    experts = torch.stack([torch.zeros(rows, dtype=torch.int64), second], dim=1)
    return torch.rand(rows, TOP_K, generator=g).bfloat16(), experts


def _reference(x, gate_up, down, scales, weights, experts) -> torch.Tensor:
    """float32 sum over each row's (expert, weight) of weight * down(SiLU(gate x) * up x), the
    activation rounded to bfloat16 as the kernels round it."""
    gs, ds = scales or (None, None)
    out = torch.zeros(x.shape[0], HIDDEN)
    for r in range(x.shape[0]):
        for k in range(TOP_K):
            e = int(experts[r, k])
            wg = moe._expert(gate_up, gs, e, torch.float32).float()
            wd = moe._expert(down, ds, e, torch.float32).float()
            gate, up = (wg @ x[r].float()).chunk(2)
            act = (F.silu(gate) * up).bfloat16().float()
            out[r] += weights[r, k].float() * (wd @ act)
    return out


def _grouping(weights, experts):
    counts, tokens, pair_weights = moe._group(weights, experts, E)
    chosen = counts.nonzero().flatten()
    return chosen, F.pad(counts[chosen].cumsum(0), (1, 0)), tokens, pair_weights.float()


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 7, 13, 65])
def test_expert_gemm_counts_every_pair_once(int8, rows):
    gate_up, down, scales = _experts(int8)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(7)).bfloat16()
    weights, experts = _uneven_routing(rows)
    pairs = (cpu_moe.to_pairs(gate_up), cpu_moe.to_pairs(down))
    got = cpu_moe.expert_gemm(x, pairs, *_grouping(weights, experts), scales=scales)
    want = _reference(x, gate_up, down, scales, weights, experts)
    # the sums differ from the reference's by float32 order and a rare bfloat16 rounding step of the
    # activation; one pair dropped or added moves a row by ~its whole size
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())
    dot = cpu_moe.expert_ffn(x, gate_up, down, *_grouping(weights, experts), scales=scales)
    torch.testing.assert_close(got, dot, rtol=0, atol=2e-2 * want.abs().max().item())


def test_pair_panel_layout_places_each_weight():
    t = torch.arange(2 * 128 * 4, dtype=torch.float32).reshape(2, 128, 4)
    p = cpu_moe.to_pairs(t)
    assert p.shape == (2, 2, 2, 4, 16, 2)
    e, o, k = 1, 64 + 16 * 2 + 5, 3  # panel 1, vector 2, lane 5, input pair 1, second of the pair
    assert p[e, o // 64, k // 2, o % 64 // 16, o % 16, k % 2] == t[e, o, k]
    assert torch.equal(cpu_moe.from_pairs(p), t)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_a_laid_out_layer_holds_one_copy_of_its_experts(int8):
    """``load_experts`` keeps only the pair panels where it lays the experts out: the resident bytes of
    the layer's expert tensors (their storages, scales apart) are those of one copy."""
    gate_up, down, _ = _experts(False)
    ckpt = {"mlp.gate.weight": torch.zeros(E, HIDDEN, dtype=torch.bfloat16)}
    for e in range(E):
        gate, up = gate_up[e].chunk(2)
        ckpt |= {f"mlp.experts.{e}.gate_proj.weight": gate, f"mlp.experts.{e}.up_proj.weight": up}
        ckpt[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    w = moe.load_experts(ckpt.__getitem__, "mlp.", MoeSpec(E, TOP_K, INTER, True, (0,)), int8=int8)
    assert moe.laid_out(w) is not None and moe.experts_dtype(w) == (torch.int8 if int8 else torch.bfloat16)
    held = sum(t.untyped_storage().nbytes() for n, t in w.items() if n.startswith("experts_") and "scale" not in n)
    assert held == E * 3 * INTER * HIDDEN * (1 if int8 else 2)
    rebuilt = moe.row_major(w)
    assert torch.equal(rebuilt["experts_down"], moe.quantize_rows(down)[0] if int8 else down)
    assert moe.laid_out(rebuilt) is None and rebuilt["router"] is w["router"]


def test_the_torch_path_rebuilds_laid_out_experts_from_their_panels():
    gate_up, down, _ = _experts(False)
    router = (torch.randn(E, HIDDEN, generator=torch.Generator().manual_seed(2)) * 0.3).bfloat16()
    w = {"router": router} | moe.gemm_layout(gate_up, down)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = moe.moe_mlp(x, w, MoeSpec(E, TOP_K, INTER, True, (0,)), kernel=False)
    want = moe.moe_mlp(
        x,
        {"router": router, "experts_gate_up": gate_up, "experts_down": down},
        MoeSpec(E, TOP_K, INTER, True, (0,)),
        kernel=False,
    )
    assert torch.equal(got, want)  # the same matmuls on the same weights


@pytest.mark.parametrize("rows", [3, 70])
def test_moe_mlp_takes_the_gemm_for_laid_out_experts(monkeypatch, rows):
    gate_up, down, _ = _experts(False)
    router = (torch.randn(E, HIDDEN, generator=torch.Generator().manual_seed(2)) * 0.3).bfloat16()
    w = {"router": router} | moe.gemm_layout(gate_up, down)
    assert set(w) == {"router", "experts_gate_up_pairs", "experts_down_pairs"}
    calls = []
    real = cpu_moe.expert_gemm
    monkeypatch.setattr(cpu_moe, "expert_gemm", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    monkeypatch.setattr(moe, "LARGE_STEP_ROWS", 32)
    spec = MoeSpec(E, TOP_K, INTER, True, (0,))
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = moe.moe_mlp(x, w, spec)
    # one call per chunk, every row in one (70 rows: 32 + 32 + 6; 3 rows: one call)
    assert calls == ([rows] if rows <= moe.KERNEL_MAX_ROWS else [32, 32, 6])
    weights, experts = moe.route(x, router, TOP_K, True)
    want = _reference(x, gate_up, down, None, weights, experts)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * want.abs().max().item())


# int8 builds its matmul panels for seconds: slow tier
@pytest.mark.parametrize("weights", ["bfloat16", pytest.param("int8", marks=pytest.mark.slow)])
def test_decode_stack_runs_laid_out_experts_by_the_gemm(tokenizer, monkeypatch, weights):
    """A bfloat16 (or weight-only int8) model whose experts were laid out at load: the decode stack binds
    the pair panels with the GEMM's kind, and its steps' logits stay within a bfloat16 rounding of the
    layer path's (which runs the same kernel per layer)."""
    from engine.config import ModelConfig
    from engine.decode_stack import ENV
    from engine.llm import LLM
    from engine.tensor_shapes import expected_tensor_shapes
    from tests.support.decode_stack_paths import BothPaths
    from tests.support.models import engine_cfg, sched_cfg
    from transfer.wire.sampling_params import SamplingParams

    monkeypatch.setenv(ENV, "1")
    cfg = ModelConfig("qwen3_moe", 128, HIDDEN, 96, 2, 4, 2, 16, moe=MoeSpec(E, TOP_K, INTER, True, (0, 1)))
    g = torch.Generator().manual_seed(0)
    tensors = {
        n: (1 + 0.2 * torch.randn(s, generator=g)) if n.endswith("norm.weight") else 0.2 * torch.randn(s, generator=g)
        for n, s in expected_tensor_shapes(cfg).items()
    }
    extra = {"weight_dtype": "int8"} if weights == "int8" else {}
    llm = LLM(engine_cfg(dtype="bfloat16", **extra), sched_cfg(), loaded=(cfg, tensors, tokenizer))
    stack = llm.runner.model.stack
    if stack is None:
        pytest.skip("no decode stack on this CPU")
    kind = cpu_moe.KIND_GEMM_I8 if weights == "int8" else cpu_moe.KIND_GEMM_BF16
    assert stack._moe_args()["moe_kind"] == kind
    sparse = [layer.w for layer in llm.runner.model.layers if layer.sparse]
    assert sparse and all(moe.laid_out(w) and "experts_down" not in w for w in sparse)  # one copy, the panels
    both = BothPaths(llm.runner.model)
    prompts = [torch.randint(3, 128, (7 + 5 * i,), generator=g).tolist() for i in range(2)]
    llm.generate_ids(prompts, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    llm.scheduler.check_integrity()
    assert both.steps
    for _, a, b, _, _ in both.steps:
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.1)
