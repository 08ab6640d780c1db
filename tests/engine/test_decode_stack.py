"""The C decode stack (``engine/decode_stack.py``, ``cpu_decode_stack.c``): a small decode step's
layers in one call must compute bitwise what the per-layer Python path computes (logits and every
KV byte it stores), for bfloat16 and int8 weights and every row count it takes; and it must leave to
the Python path every step it cannot run."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_linear
from engine.decode_stack import ENV, DecodeStack
from engine.forward_batch import ForwardMode
from engine.llm import LLM
from engine.model import LlamaModel
from tests.support.cpu_kernels import needs_small_batch_kernels
from tests.support.decode_stack_paths import BothPaths
from tests.support.models import engine_cfg, sched_cfg, tiny_config, tiny_weights
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit
needs_kernel = needs_small_batch_kernels


@needs_kernel
# the bfloat16 case stays in the unit tier; the int8 and float32 weights build panels for seconds each
@pytest.mark.parametrize(
    "weights",
    ["bfloat16", pytest.param("int8", marks=pytest.mark.slow), pytest.param("float32", marks=pytest.mark.slow)],
)
def test_a_decode_step_through_the_stack_is_bitwise_the_layer_path(embedded, weights):
    """float32: the model's weights in float32 panels, its pool float32, nothing rounded between kernels."""
    extra = {"weight_dtype": "int8"} if weights == "int8" else {}
    every = weights == "float32" or (weights == "bfloat16" and cpu_linear.pairs_take_all())  # panels only
    limit = cpu_linear.PANELS_ROWS if every else cpu_linear.pairs_rows()
    top = 40 if every else limit  # panels-only weights take any rows: 40 is seven register blocks
    llm = LLM(
        engine_cfg(dtype="float32" if weights == "float32" else "bfloat16", **extra),
        sched_cfg(max_running_requests=top, chunked_prefill_size=8192),
        loaded=embedded[:3],
    )
    stack = llm.runner.model.stack
    assert stack is not None and stack.max_rows == limit  # every SmolLM2 matmul is (pair-)panel
    both = BothPaths(llm.runner.model)
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    want = {1, 3, 13, top}  # 13 rows: three register blocks of the (pair-)panel kernel
    for rows in sorted(want):
        # unequal prompt lengths: the rows attend over different ranges and pages
        prompts = [torch.randint(0, vocab, (9 + 5 * i % 41,), generator=g).tolist() for i in range(rows)]
        llm.generate_ids(prompts, SamplingParams(max_new_tokens=3 + rows // 8, temperature=0, ignore_eos=True))
    compared = [(rows, torch.equal(a, b), torch.equal(stored, pool)) for rows, a, b, stored, pool in both.steps]
    sizes = {c[0] for c in compared}
    assert want <= sizes, sizes
    assert all(same_logits and same_kv for _, same_logits, same_kv in compared), compared


@needs_kernel
def test_the_stack_leaves_other_steps_to_the_layer_path(embedded, monkeypatch):
    """Prompt steps, decode steps above ``max_rows`` and other attention backends run the layers."""
    from engine.attention import TorchBackend

    monkeypatch.setattr(cpu_linear, "pairs_take_all", lambda: False)  # a row limit of pairs_rows()

    llm = LLM(
        engine_cfg(dtype="bfloat16"), sched_cfg(max_running_requests=cpu_linear.pairs_rows() + 2), loaded=embedded[:3]
    )
    model, attn = llm.runner.model, llm.runner.backend
    stack, forward, seen = model.stack, model.forward, []

    def spy(batch, a):
        seen.append((batch, stack.takes(batch, a)))
        return forward(batch, a)

    model.forward = spy
    n = stack.max_rows + 2
    llm.generate_ids(
        [[1 + i, 2, 3] for i in range(n)], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    )
    small = [b for b, _ in seen if b.mode is ForwardMode.DECODE and b.batch_size <= stack.max_rows]
    assert all(took == (b in small) for b, took in seen)
    assert any(b.mode is ForwardMode.DECODE and b.batch_size == n for b, _ in seen)
    assert any(b.mode is not ForwardMode.DECODE for b, _ in seen)
    llm.generate_ids([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
    one = next(b for b, took in seen[-2:] if took)
    assert not stack.takes(one, TorchBackend(attn.pools, attn.num_heads, attn.scale, attn.windows))


def _tiny_bf16(**overrides) -> LlamaModel:
    cfg = tiny_config(**overrides)
    model = LlamaModel(cfg, torch.device("cpu"), torch.bfloat16)
    weights = tiny_weights(cfg)
    for i in range(cfg.num_layers if cfg.qk_norm else 0):
        for n in ("q_norm", "k_norm"):
            weights[f"model.layers.{i}.self_attn.{n}.weight"] = torch.ones(cfg.head_dim)
    model.load_weights(weights)
    return model


@needs_kernel
def test_the_stack_is_built_only_where_it_can_run(monkeypatch):
    assert _tiny_bf16().stack is not None
    assert _tiny_bf16(qk_norm=True).stack is not None  # per-head Q/K norms run in the C layer too
    cfg = tiny_config()
    f32 = LlamaModel(cfg, torch.device("cpu"), torch.float32)
    f32.load_weights(tiny_weights(cfg))
    assert f32.stack is not None and f32.stack.max_rows == cpu_linear.PANELS_ROWS  # float32 panels
    f16 = LlamaModel(cfg, torch.device("cpu"), torch.float16)
    f16.load_weights(tiny_weights(cfg))
    assert f16.stack is None  # no float16 kernels
    monkeypatch.setenv(ENV, "0")
    assert _tiny_bf16().stack is None and DecodeStack.build(_tiny_bf16()) is None
