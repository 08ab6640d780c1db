"""Qwen3-MoE: the expert mixture (engine.moe) equals transformers' sparse block, the routing settings
of config.json are read (norm_topk_prob, decoder_sparse_step, mlp_only_layers) and change the tokens,
what is not implemented is refused, and an MoE model takes the C decode stack's expert block."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfig, MoeSpec
from engine.loader import load_model_weights, read_model_config
from engine.model import LlamaModel
from engine.moe import hf_moe_spec, moe_mlp, route
from engine.tensor_shapes import expected_tensor_shapes
from tests.support.hf_folders import QWEN3_MOE, engine_greedy, random_prompts, reference_greedy, save_small_model

pytestmark = pytest.mark.unit


def _sparse_block(norm_topk_prob: bool, seed: int = 0):
    """transformers' Qwen3-MoE sparse block (8 experts of 32, top 2) with random weights."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=norm_topk_prob
    )
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return block


def _weights(block) -> dict[str, torch.Tensor]:
    return {
        "router": block.gate.weight.detach(),
        "experts_gate_up": block.experts.gate_up_proj.detach(),
        "experts_down": block.experts.down_proj.detach(),
    }


@pytest.mark.parametrize("norm", [True, False])
def test_expert_mixture_equals_transformers_block(norm):
    block = _sparse_block(norm)
    spec = MoeSpec(8, 2, 32, norm, (0,))
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = block(x.unsqueeze(0)).squeeze(0)
    got = moe_mlp(x, _weights(block), spec)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    # the renormalization matters on these weights: the other setting is far from the reference
    other = moe_mlp(x, _weights(block), MoeSpec(8, 2, 32, not norm, (0,)))
    assert (other - ref).abs().max() > 1e-2


def test_routing_picks_the_top_experts_and_renormalizes():
    x = torch.tensor([[1.0, 0.0]])
    router = torch.tensor([[3.0, 0.0], [1.0, 0.0], [2.0, 0.0], [0.0, 0.0]])
    weights, experts = route(x, router, 2, True)
    assert experts.tolist() == [[0, 2]]
    e = torch.exp(torch.tensor([3.0, 2.0]))
    torch.testing.assert_close(weights, (e / e.sum()).unsqueeze(0))
    raw, _ = route(x, router, 2, False)
    probs = torch.softmax(torch.tensor([3.0, 1.0, 2.0, 0.0]), -1)
    torch.testing.assert_close(raw, probs[[0, 2]].unsqueeze(0))


def test_sparse_layers_follow_the_step_and_the_dense_list():
    base = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert hf_moe_spec(base, 4).sparse_layers == (0, 1, 2, 3)
    assert hf_moe_spec({**base, "decoder_sparse_step": 2}, 4).sparse_layers == (1, 3)
    assert hf_moe_spec({**base, "mlp_only_layers": [1]}, 4).sparse_layers == (0, 2, 3)
    assert hf_moe_spec({**base, "num_experts": 0}, 4) is None
    assert hf_moe_spec({"num_local_experts": 4, "num_experts_per_tok": 1}, 1).num_experts == 4
    with pytest.raises(ValueError, match="decoder_sparse_step=0"):
        hf_moe_spec({**base, "decoder_sparse_step": 0}, 4)
    with pytest.raises(ValueError, match="num_experts_per_tok 9"):
        hf_moe_spec({**base, "num_experts_per_tok": 9}, 4)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    return folder, save_small_model("qwen3_moe", folder, **QWEN3_MOE)


def _edited(folder, tmp_path, **fields):
    import shutil

    dst = tmp_path / "edited"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(fields)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_loader_reads_the_expert_layout(moe_folder):
    folder, _ = moe_folder
    cfg = read_model_config(folder)
    assert cfg.qk_norm and cfg.moe == MoeSpec(8, 2, 32, True, (0, 2, 3))
    _, tensors = load_model_weights(folder)
    assert "model.layers.1.mlp.gate_proj.weight" in tensors and "model.layers.0.mlp.gate_proj.weight" not in tensors
    assert tensors["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (64, 32)


@pytest.mark.slow
def test_ignoring_norm_topk_prob_changes_the_tokens(moe_folder, tmp_path, tokenizer):
    """The same weights served without the renormalization give other greedy tokens than
    transformers with it: a test that ignored norm_topk_prob would fail."""
    folder, model = moe_folder
    prompts = random_prompts(2, 30)
    ref = reference_greedy(model, prompts, 12)
    assert engine_greedy(folder, tokenizer, prompts, 12) == ref
    unnormalized = _edited(folder, tmp_path, norm_topk_prob=False)
    assert engine_greedy(unnormalized, tokenizer, prompts, 12) != ref


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("use_sliding_window", True, r"use_sliding_window=True .*supported: False"),
        ("shared_expert_intermediate_size", 64, r"shared_expert_intermediate_size=64 is not implemented.*'qwen3_moe'"),
        ("hidden_act", "gelu", r"hidden_act='gelu'.*supported: 'silu' or 'swish'"),
        ("norm_topk_prob", "yes", r"norm_topk_prob='yes' must be true or false"),
    ],
)
def test_what_is_not_implemented_is_refused(moe_folder, tmp_path, field, value, message):
    folder = _edited(moe_folder[0], tmp_path, **{field: value})
    with pytest.raises(ValueError, match=message):
        read_model_config(folder)


def _random_model(moe: MoeSpec | None, int8: bool = False) -> LlamaModel:
    """A float32 two-layer model (no Q/K norms) with random weights, MoE on layer 0 where ``moe``."""
    cfg = ModelConfig("qwen3_moe", 128, 64, 96, 2, 4, 2, 16, moe=moe)
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) * 0.2 for n, s in expected_tensor_shapes(cfg).items()}
    model = LlamaModel(cfg, torch.device("cpu"), torch.bfloat16 if int8 else torch.float32, int8=int8)
    model.load_weights(state)
    return model


def test_an_moe_model_takes_the_decode_stack_with_its_expert_block(monkeypatch):
    """Where the C kernels run, the stack serves MoE models too (tests/engine/test_decode_stack_moe.py
    checks its steps); it is built only where ``engine.moe``'s kernel row limit is above 0."""
    from engine import moe
    from engine.decode_stack import ENV
    from engine.kernels import cpu_native

    if cpu_native.load() is None or not cpu_native.gemv_available():
        pytest.skip("no small-batch kernels here: no stack for any model")
    monkeypatch.setenv(ENV, "1")
    assert _random_model(MoeSpec(8, 2, 32, True, (0,))).stack is not None
    monkeypatch.setattr(moe, "KERNEL_MAX_ROWS", 0)
    assert _random_model(MoeSpec(8, 2, 32, True, (0,))).stack is None
    assert _random_model(None).stack is not None


def test_int8_experts_are_quantized_per_row_at_load():
    from engine.cpu_linear import int8_supported

    if int8_supported(torch.zeros(64, 64, dtype=torch.bfloat16)) is not None:
        pytest.skip("no int8 weights on this machine")
    model = _random_model(MoeSpec(8, 2, 32, True, (0,)), int8=True)
    w = model.layers[0].w
    assert w["experts_gate_up"].dtype == torch.int8 and w["experts_gate_up_scale"].shape == (8, 64)
    assert w["experts_down"].dtype == torch.int8 and w["experts_down_scale"].shape == (8, 64)
    ref = _random_model(MoeSpec(8, 2, 32, True, (0,))).layers[0].w["experts_down"]
    deq = w["experts_down"].float() * w["experts_down_scale"][..., None]
    # every weight within half a step of its row's scale (the model's bfloat16 weights, float32 here)
    assert ((deq - ref).abs() <= w["experts_down_scale"][..., None] / 2 + 1e-2 * ref.abs()).all()


def test_mixtral_names_and_spec():
    from engine.moe import mixtral_name

    p = "model.layers.3.block_sparse_moe."
    assert mixtral_name(p + "experts.7.w1.weight") == "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert mixtral_name(p + "experts.7.w3.weight") == "model.layers.3.mlp.experts.7.up_proj.weight"
    assert mixtral_name(p + "experts.7.w2.weight") == "model.layers.3.mlp.experts.7.down_proj.weight"
    assert mixtral_name(p + "gate.weight") == "model.layers.3.mlp.gate.weight"
    assert mixtral_name("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    spec = hf_moe_spec({"intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2}, 3, "mixtral")
    assert spec == MoeSpec(8, 2, 96, True, (0, 1, 2))


@pytest.fixture(scope="module")
def mixtral_folder(tmp_path_factory):
    from tests.support.hf_folders import MIXTRAL

    folder = tmp_path_factory.mktemp("mixtral")
    save_small_model("mixtral", folder, **MIXTRAL)
    return folder


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("sliding_window", 4096, r"sliding_window=4096 is not implemented.*'mixtral'; supported: None"),
        ("norm_topk_prob", False, r"norm_topk_prob=False is not implemented.*'mixtral'"),
    ],
)
def test_mixtral_refuses_what_it_does_not_implement(mixtral_folder, tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        read_model_config(_edited(mixtral_folder, tmp_path, **{field: value}))


def test_mixtral_loads_its_experts_under_the_shared_names(mixtral_folder):
    cfg, tensors = load_model_weights(mixtral_folder)
    assert cfg.moe == MoeSpec(8, 2, 96, True, (0, 1)) and cfg.rope_theta == 1e6 and not cfg.qk_norm
    assert tensors["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (96, 64)
