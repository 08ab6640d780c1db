"""The fused-MoE Triton kernels (engine.kernels.triton_moe), run by the Triton interpreter on CPU,
against the torch expert loop of engine.moe; the host-side alignment of the (token, slot) pairs;
and engine.moe's dispatch (the Triton path where ``triton_moe.takes``, the CPU path untouched).

``TRITON_INTERPRET`` must be set before triton is first imported in the process, hence the very
first statement. If another module imported triton earlier without it, the kernel tests skip.
"""

import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine import moe  # noqa: E402
from engine.config import MoeSpec  # noqa: E402
from engine.kernels import triton_available, triton_moe  # noqa: E402
from tests.support.triton_interpreter import needs_triton  # noqa: E402

pytestmark = pytest.mark.unit


F32 = {"rtol": 1e-4, "atol": 1e-5}


def _layer(experts: int, hidden: int, inter: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(experts, hidden, generator=g),
        "experts_gate_up": torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5,
        "experts_down": torch.randn(experts, hidden, inter, generator=g) * inter**-0.5,
    }


def _x(tokens: int, hidden: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))


def _torch_reference(x, gate_up, down, weights, experts, scales=None) -> torch.Tensor:
    """``moe._torch_experts`` on the grouping ``moe.moe_mlp`` makes of these routing choices."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    pair_w = weights.flatten()[order].unsqueeze(-1)
    return moe._torch_experts(x, gate_up, down, scales, counts, order // experts.shape[1], pair_w)


# ---------------------------------------------------------------------------------------------
# the alignment


def test_align_pads_each_expert_group_to_the_block():
    experts = torch.tensor([[0, 2], [2, 3], [0, 2]])  # pairs 0..5 -> experts 0, 2, 2, 3, 0, 2
    al = triton_moe.align(experts, num_experts=5, block_m=4)
    s = 6  # the padding sentinel: num_pairs
    assert al.num_pairs == 6 and al.num_blocks == 6  # bound: 6 + min(5, 6) * 3 = 21 slots
    assert al.sorted_pairs.tolist() == [0, 4, s, s, 1, 2, 5, s, 3, s, s, s] + [s] * 12
    assert al.block_expert.tolist() == [0, 2, 3, -1, -1, -1]  # experts 1 and 4 get no block
    assert al.sorted_pairs.dtype == al.block_expert.dtype == torch.int32


@pytest.mark.parametrize("tokens, num_experts, top_k, block_m", [(1, 64, 8, 16), (7, 8, 2, 4), (65, 4, 1, 16)])
def test_align_places_every_pair_once_in_a_block_of_its_expert(tokens, num_experts, top_k, block_m):
    g = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    al = triton_moe.align(experts, num_experts, block_m)
    pairs = al.sorted_pairs.long()
    real = pairs < al.num_pairs
    assert sorted(pairs[real].tolist()) == list(range(tokens * top_k))
    block_of = torch.arange(pairs.numel()) // block_m
    assert (al.block_expert.long()[block_of[real]] == experts.flatten()[pairs[real]]).all()
    counts = torch.bincount(experts.flatten(), minlength=num_experts)
    blocks = torch.bincount(al.block_expert[al.block_expert >= 0].long(), minlength=num_experts)
    assert blocks.tolist() == ((counts + block_m - 1) // block_m).tolist()
    assert (al.block_expert[blocks.sum() :] == -1).all() and not real[blocks.sum() * block_m :].any()


# ---------------------------------------------------------------------------------------------
# the kernels against the torch expert loop

# (experts, top_k, tokens, hidden, inter, blocks): hidden/inter multiples of the blocks and not.
SHAPES = [
    (4, 1, 1, 32, 16, (16, 16, 16)),
    (4, 1, 65, 40, 24, (16, 32, 32)),
    (8, 2, 7, 40, 24, (16, 32, 16)),
    (8, 2, 65, 32, 32, (32, 32, 32)),
    (64, 8, 1, 48, 20, (16, 32, 16)),
    (64, 8, 3, 32, 16, (16, 32, 32)),  # most of the 64 experts get no pair
    (8, 2, 7, 40, 24, None),  # the default blocks: one partial 16 x 64 tile, 32 deep
]


@needs_triton
@pytest.mark.parametrize("num_experts, top_k, tokens, hidden, inter, blocks", SHAPES)
def test_float32_equals_the_torch_expert_loop(num_experts, top_k, tokens, hidden, inter, blocks):
    w, x = _layer(num_experts, hidden, inter), _x(tokens, hidden)
    weights, experts = moe.route(x, w["router"], top_k, True)
    got = triton_moe.fused_moe(x, w["experts_gate_up"], w["experts_down"], weights, experts, blocks=blocks)
    want = _torch_reference(x, w["experts_gate_up"], w["experts_down"], weights, experts)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **F32)


@needs_triton
def test_experts_without_tokens_and_strided_weights():
    """Only experts 1, 5 and 6 of 8 get tokens; the experts are strided views (every other one of a
    larger stack), which the kernels read through their strides."""
    w, x = _layer(16, 40, 24), _x(9, 40)
    gate_up, down = w["experts_gate_up"][::2], w["experts_down"][::2]
    experts = torch.tensor([[1, 5], [6, 1], [5, 6], [1, 6], [5, 1], [6, 5], [1, 5], [5, 6], [6, 1]])
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(2))
    got = triton_moe.fused_moe(x, gate_up, down, weights, experts, blocks=(16, 16, 16))
    torch.testing.assert_close(got, _torch_reference(x, gate_up, down, weights, experts), **F32)
    assert got.abs().min() > 0  # every token got its two experts' outputs


@needs_triton
def test_int8_experts_equal_the_dequantized_torch_loop():
    w, x = _layer(8, 40, 24), _x(7, 40)
    gate_up, gs = moe.quantize_rows(w["experts_gate_up"])
    down, ds = moe.quantize_rows(w["experts_down"])
    weights, experts = moe.route(x, w["router"], 2, True)
    got = triton_moe.fused_moe(x, gate_up, down, weights, experts, (gs, ds), blocks=(16, 16, 16))
    want = _torch_reference(x, gate_up, down, weights, experts, (gs, ds))
    torch.testing.assert_close(got, want, **F32)
    # the scales matter: the unscaled int8 values are far from the reference
    assert (got - _torch_reference(x, gate_up.float(), down.float(), weights, experts)).abs().max() > 1


HALF_TOL = {torch.float16: {"rtol": 1e-2, "atol": 2e-3}, torch.bfloat16: {"rtol": 2e-2, "atol": 1.6e-2}}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True])
def test_half_dtypes_within_their_rounding_of_float32(dtype, int8):
    """float16/bfloat16 activations (float or int8 experts) against the float32 loop on the same
    values: the kernels round gate, up, the activation and each expert's output to ``dtype``."""
    w, x = _layer(8, 40, 24), _x(7, 40).to(dtype)
    gate_up, down = w["experts_gate_up"].to(dtype), w["experts_down"].to(dtype)
    scales = None
    if int8:
        (gate_up, gs), (down, ds) = moe.quantize_rows(gate_up), moe.quantize_rows(down)
        scales = (gs, ds)
    weights, experts = moe.route(x, w["router"].to(dtype), 2, True)
    got = triton_moe.fused_moe(x, gate_up, down, weights, experts, scales, blocks=(16, 32, 16))
    want = _torch_reference(x.float(), gate_up.float(), down.float(), weights.float(), experts, scales)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **HALF_TOL[dtype])


def test_block_sizes_must_be_powers_of_two_from_16():
    w, x = _layer(4, 32, 16), _x(2, 32)
    weights, experts = moe.route(x, w["router"], 1, True)
    with pytest.raises(ValueError, match="powers of two"):
        triton_moe.fused_moe(x, w["experts_gate_up"], w["experts_down"], weights, experts, blocks=(16, 24, 16))


# ---------------------------------------------------------------------------------------------
# engine.moe's dispatch


def test_cpu_tensors_keep_the_cpu_path(monkeypatch):
    """``takes`` refuses CPU tensors, and ``moe_mlp`` on CPU never reaches the Triton kernels."""
    w, x = _layer(8, 64, 32), _x(5, 64)
    assert not triton_moe.takes(x, w["experts_gate_up"], w["experts_down"], None)
    before = moe.moe_mlp(x, w, MoeSpec(8, 2, 32, True, (0,)))

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton MoE path ran on CPU tensors")

    monkeypatch.setattr(triton_moe, "fused_moe", refuse)
    assert torch.equal(moe.moe_mlp(x, w, MoeSpec(8, 2, 32, True, (0,))), before)


def test_takes_only_the_dtypes_the_kernels_run(monkeypatch):
    """Where the backend is Triton (as on CUDA): activations float32/float16/bfloat16 with experts
    of their dtype, or int8 experts with scales; nothing else."""
    monkeypatch.setattr(triton_moe, "resolve_backend", lambda *a: "triton")
    w = torch.zeros(2, 4, 4)
    q, s = moe.quantize_rows(w)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.zeros(1, 4, dtype=dtype)
        assert triton_moe.takes(x, w.to(dtype), w.to(dtype), None)
        assert triton_moe.takes(x, q, q, (s, s))
        assert not triton_moe.takes(x, q, q, None) and not triton_moe.takes(x, w.to(dtype), w.to(dtype), (s, s))
    assert not triton_moe.takes(torch.zeros(1, 4), w.half(), w.half(), None)
    assert not triton_moe.takes(torch.zeros(1, 4, dtype=torch.float64), w.double(), w.double(), None)


@needs_triton
@pytest.mark.parametrize("int8", [False, True])
def test_moe_mlp_takes_the_triton_path_where_it_is_taken(monkeypatch, int8):
    """With ``takes`` true (as on CUDA), ``moe_mlp`` returns the fused kernels' result for the layer's
    routing and scales; ``kernel=False`` still runs the torch loop."""
    spec, w, x = MoeSpec(8, 2, 24, True, (0,)), _layer(8, 40, 24), _x(7, 40)
    if int8:
        for name in ("experts_gate_up", "experts_down"):
            w[name], w[name + "_scale"] = moe.quantize_rows(w[name])
    calls = []
    fused = triton_moe.fused_moe
    monkeypatch.setattr(triton_moe, "takes", lambda *a: True)
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *a, **k: calls.append(a) or fused(*a, **k))
    got = moe.moe_mlp(x, w, spec)
    assert len(calls) == 1 and (calls[0][5] is not None) == int8
    want = moe.moe_mlp(x, w, spec, kernel=False)
    assert len(calls) == 1
    torch.testing.assert_close(got, want, **F32)


@pytest.mark.slow
@needs_triton
def test_engine_greedy_through_the_fused_kernels_equals_transformers(monkeypatch, tmp_path, tokenizer):
    """A Qwen3-MoE folder (3 sparse layers of 8 experts, top 2) served by the engine with every
    sparse layer on the fused kernels (interpreted; ``takes`` forced as on CUDA; the decode stack
    off, as it runs the experts in C): transformers' greedy tokens."""
    from engine.decode_stack import ENV
    from tests.support.hf_folders import QWEN3_MOE, engine_greedy, random_prompts, reference_greedy, save_small_model

    monkeypatch.setenv(ENV, "0")
    model = save_small_model("qwen3_moe", tmp_path, **QWEN3_MOE)
    calls = []
    fused = triton_moe.fused_moe
    monkeypatch.setattr(triton_moe, "takes", lambda *a: True)
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *a, **k: calls.append(a[0].shape[0]) or fused(*a, **k))
    prompts = random_prompts(2, 12)
    assert engine_greedy(tmp_path, tokenizer, prompts, 4) == reference_greedy(model, prompts, 4)
    assert len(calls) >= 3 * 4 and max(calls) >= 12  # every step's sparse layers, the prompts' included


# ---------------------------------------------------------------------------------------------
# the CUDA build, without a GPU


# In a fresh process without TRITON_INTERPRET: once the interpreter has run a kernel in this process,
# triton's language functions stay patched for it and a real compile fails.
_COMPILE_SCRIPT = r"""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from engine.kernels import _triton_moe_kernels as kernels

def build(fn, pointers, constexprs):
    jitted = JITFunction(fn)
    names = jitted.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    source = ASTSource(fn=jitted, signature=signature, constexprs=consts)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))

blocks = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, HAS_SCALE=True, DOT_PRECISION=None, DOT_DTYPE=tl.bfloat16)
common = {"W": "*i8", "W_SCALE": "*fp32", "SORTED": "*i32", "BLOCK_EXPERT": "*i32"}
try:
    gate_up = build(kernels._gate_up_kernel, {**common, "X": "*bf16", "ACT": "*bf16"}, {**blocks, "TOP_K": 8})
except (ImportError, RuntimeError, FileNotFoundError) as e:  # no CUDA backend or ptxas in this install
    print("no CUDA build:", e)
    raise SystemExit(0)
down = build(kernels._down_kernel, {**common, "ACT": "*bf16", "PAIR_W": "*fp32", "OUT": "*fp32"}, blocks)
for k in (gate_up, down):
    assert k.asm["cubin"] and "mma.sync" in k.asm["ptx"], "a dot without tensor cores"
print("compiled")
"""


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not importable")
def test_kernels_compile_for_hopper_with_tensor_core_dots(tmp_path):
    """bfloat16 activations with int8 experts at the default decode blocks: both kernels build for
    sm_90 (triton's CUDA backend and bundled ptxas; no GPU or driver) and their dots are tensor-core
    MMAs (what the interpreter cannot tell)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], cwd=repo, env=env, timeout=300, capture_output=True, text=True
    )
    if res.returncode == 0 and "no CUDA build:" in res.stdout:
        pytest.skip(f"triton cannot build for CUDA here: {res.stdout.strip()}")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
