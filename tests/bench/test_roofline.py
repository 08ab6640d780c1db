"""The roofline arithmetic of ``pdserve bench engine --roofline`` (``bench/roofline.py``) against
hand-computed numbers, its op classifier, and the section end to end on a tiny model."""

from __future__ import annotations

import pytest

from bench import roofline as rl
from tests.support.models import tiny_config, tiny_weights

# tiny_config: vocab 97, hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, head_dim 16, untied
LAYER = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128  # qkv 8192 + o 4096 + gate/up/down 24576 = 36864
HEAD = 97 * 64  # 6208
NORMS = 2 * (2 * 64) + 64  # 320


def test_param_counts_of_tiny_config():
    cfg = tiny_config()
    assert rl.layer_matmul_params(cfg) == LAYER == 36864
    assert rl.lm_head_params(cfg) == HEAD
    assert rl.norm_params(cfg) == NORMS
    assert rl.norm_params(tiny_config(qk_norm=True)) == NORMS + 2 * 2 * 16


def test_decode_step_bytes_tiny():
    cfg = tiny_config()
    assert rl.weight_bytes_per_step(cfg, "float32", 3) == (2 * LAYER + HEAD + NORMS + 3 * 64) * 4 == 321792
    assert rl.weight_bytes_per_step(cfg, "bfloat16", 3) == 321792 // 2
    # int8 weights: one byte per matmul weight + a float32 scale per output row, norms/embedding bfloat16
    rows = 2 * ((64 + 2 * 32) + 64 + 2 * 128 + 64) + 97  # per layer qkv, o, gate/up, down; the head
    assert rl.matmul_output_rows(cfg) == rows == 1121
    assert rl.weight_bytes_per_step(cfg, "int8", 3) == (2 * LAYER + HEAD) + 4 * rows + (NORMS + 3 * 64) * 2
    assert rl.kv_bytes_per_token(cfg, "float32") == 2 * 2 * 2 * 16 * 4 == 512
    # two sequences at contexts 10 and 20: weights with 2 embedding rows + 30 tokens of KV
    assert rl.decode_step_bytes(cfg, "float32", [10, 20]) == (2 * LAYER + HEAD + NORMS + 2 * 64) * 4 + 512 * 30


def test_prefill_flops_tiny():
    cfg = tiny_config()
    matmul = 2 * (2 * LAYER * 8 + HEAD)  # layers on 8 tokens, LM head on the last one
    attention = 2 * 2 * 2 * 4 * 16 * 8 * 8 / 2
    assert rl.prefill_flops(cfg, 8) == matmul + attention == 1208448
    assert rl.prefill_flops(cfg, 8, logits_rows=8) == matmul + 2 * 7 * HEAD + attention


def test_decode_step_flops_and_bound_tiny():
    cfg = tiny_config()
    matmul = 2 * (2 * LAYER + HEAD) * 2  # two sequences, one new token each
    attention = 2 * 2 * 2 * 4 * 16 * (10 + 20)
    assert rl.decode_step_flops(cfg, [10, 20]) == matmul + attention
    # small batches are bound by the bytes, large ones by the FLOPs
    assert rl.decode_bound_s(1e9, 1e10, 1e9, 1e12) == pytest.approx(0.1)
    assert rl.decode_bound_s(1e9, 1e10, 1e12, 1e12) == pytest.approx(1.0)
    assert rl.decode_bound_s(1e9, 1e10, 1e12, 0.0) == pytest.approx(0.1)  # no peak measured: bytes only


def test_bound_and_fraction():
    assert rl.bound_s(538e6, 21.5e9) == pytest.approx(0.025023, rel=1e-4)
    roof = rl.Roof(bound_s=0.025, measured_s=0.05)
    assert roof.fraction == 0.5
    assert rl.fraction(1.0, 0.0) == 0.0


def test_embedded_model_batch1_fp32_weights_are_538_mb():
    from engine.loader import read_model_config
    from engine.model_paths import resolve_model_path

    cfg = read_model_config(resolve_model_path("default"))
    assert rl.weight_bytes_per_step(cfg, "float32", 1) == pytest.approx(538e6, rel=0.02)
    assert rl.lm_head_params(cfg) * 4 == pytest.approx(113e6, rel=0.01)  # the tied 49152 x 576 matrix
    # prefill is ~2 x params x tokens: 512 tokens of a 135M model, ~0.1 TFLOP
    assert rl.prefill_flops(cfg, 512) == pytest.approx(2 * 106.2e6 * 512 + 2 * 28.3e6 + 2 * 30 * 576 * 512**2, rel=0.01)


@pytest.mark.parametrize(
    "name, cls",
    [
        ("aten::mm", "matmuls"),
        ("aten::addmm", "matmuls"),
        ("mkldnn::_linear_pointwise", "matmuls"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        (rl.C_ATTENTION, "attention"),
        ("aten::index_put_", "attention"),
        ("aten::index", "attention"),
        ("aten::rsqrt", "norms/rotary/act"),
        ("aten::silu", "norms/rotary/act"),
        ("aten::mul", "norms/rotary/act"),
        ("aten::multinomial", "logits+sampling"),
        ("aten::argmax", "logits+sampling"),
        ("aten::copy_", rl.OTHER),
        ("aten::empty", rl.OTHER),
        ("aten::mm_extra", rl.OTHER),
    ],
)
def test_classify_op(name, cls):
    assert rl.classify_op(name) == cls


def test_every_rule_names_its_own_class():
    """First match wins: no exact pattern is shadowed by an earlier class's prefix."""
    for cls, patterns in rl.OP_CLASSES.items():
        for p in patterns:
            assert rl.classify_op(p.rstrip("*")) == cls, p


def test_breakdown_puts_the_rest_in_python():
    rows = [
        ("aten::mm", 0.010),
        ("mkldnn::_linear_pointwise", 0.020),
        ("aten::silu", 0.001),
        ("aten::argmax", 0.002),
        ("aten::copy_", 0.003),
    ]
    secs = rl.breakdown(rows, wall_s=0.050)
    assert secs["matmuls"] == pytest.approx(0.030)
    assert secs[rl.OTHER] == pytest.approx(0.003)
    assert secs[rl.PYTHON] == pytest.approx(0.014)
    assert sum(rl.shares(secs).values()) == pytest.approx(1.0)
    assert rl.breakdown(rows, wall_s=0.01)[rl.PYTHON] == 0.0  # profiler overhead can exceed the wall
    assert set(secs) == set(rl.CLASSES)


def test_roofline_section_end_to_end_on_tiny_model(tokenizer, capsys):
    from bench.roofline_bench import run_roofline
    from configs.engine import EngineConfig

    cfg = tiny_config()
    weights = tiny_weights(cfg)
    out = run_roofline(
        EngineConfig(),
        ["float32", "float8"],
        [1, 2],
        4,
        [8, 16],
        [2],
        bandwidth_bytes=1 << 20,
        loaded=(cfg, weights, tokenizer),
    )
    text = capsys.readouterr().out
    assert "read bandwidth" in text and "decode roofline" in text and "prefill roofline" in text
    assert "float8: not measured" in text and "decode step by op class" in text
    assert [r["batch"] for r in out["decode"]] == [1, 2] and [r["tokens"] for r in out["prefill"]] == [8, 16]
    assert all(0 < r["roof"].fraction for r in out["decode"] + out["prefill"])
    (b,) = out["breakdown"]
    assert b["seconds"]["matmuls"] > 0 and b["wall"] > 0


def test_moe_step_reads_the_dense_weights_and_the_chosen_experts():
    """Layer 0 sparse (8 experts of 32, top 2), layer 1 dense: a step reads layer 0's attention and
    router, layer 1 whole, the head, and 3 * 64 * 32 weights per chosen expert."""
    import dataclasses

    from engine.config import MoeSpec

    cfg = dataclasses.replace(tiny_config(), moe=MoeSpec(8, 2, 32, True, (0,)))
    attention, router, expert = 64 * (64 + 2 * 32) + 64 * 64, 8 * 64, 3 * 64 * 32
    assert rl.dense_matmul_params(cfg) == attention + router + LAYER
    assert rl.expert_params(cfg) == expert
    # batch 1 reads its top 2; batch 3 at most 6; batch 5 at most all 8
    assert [rl.active_experts_bound(cfg, b) for b in (1, 3, 5)] == [2, 6, 8]
    rest = NORMS + 64
    assert rl.weight_bytes_per_step(cfg, "bfloat16", 1) == (attention + router + LAYER + HEAD + 2 * expert + rest) * 2
    # the measured union of a step's choices replaces the bound
    assert (
        rl.weight_bytes_per_step(cfg, "float32", 4, active_experts=3)
        == (attention + router + LAYER + HEAD + 3 * expert + NORMS + 4 * 64) * 4
    )
    # int8: one byte per weight, a float32 scale per output row (each chosen expert's 2 * 32 + 64 rows)
    rows = rl.matmul_output_rows(cfg) + 2 * (2 * 32 + 64)
    assert rl.weight_bytes_per_step(cfg, "int8", 1) == (
        attention + router + LAYER + HEAD + 2 * expert + 4 * rows + (NORMS + 64) * 2
    )
    # each token multiplies by its top 2 experts, not all 8
    assert rl.decode_step_flops(cfg, [0]) == 2 * (attention + router + LAYER + 2 * expert + HEAD)
