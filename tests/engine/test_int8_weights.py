"""Weight-only int8 (``--weight-dtype int8``): the kernel (``cpu_gemv.c``'s ``pdserve_gemv_i8w``)
against the exact product, the quantizer's bound, ``linear``'s routing, the config's refusal, and the
real model against its dequantized reference (the same int8 weights widened to bfloat16 and served by
the bfloat16 path) and against float32 by logits tolerance. Measured on a Zen 4 (the paragraph's
prompt logprobs against float32): mean |delta| 0.084, max 0.62, top-1 agreement 0.92 (bfloat16
weights: 0.035 / 0.20 / 0.96 on a Zen 5, ``test_bf16_engine.py``)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from configs.engine import EngineConfig
from engine import cpu_linear
from engine.cpu_linear import PackedWeight, linear, pack, quantize_int8
from engine.kernels import cpu_native
from engine.llm import LLM, run_batch
from tests.engine.test_bf16_engine import TEXT
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit
needs_kernel = pytest.mark.skipif(
    not cpu_native.gemv_available() or not cpu_linear.packing_enabled(torch.zeros(8, 32, dtype=torch.bfloat16)),
    reason="this CPU has no AVX512-BF16: the int8 kernel is not built here",
)


def _check(y, ref, magnitude):
    """Every output is the exact result rounded to bfloat16, up to one bfloat16 step where the
    float32 sum sat next to a rounding boundary, plus float32 summation error (relative to the
    terms' ``magnitude``: a result that cancels to ~0 keeps it); 99% exactly rounded."""
    step = ref.abs() * 2.0**-7 + magnitude * 2.0**-20
    assert ((y.double() - ref).abs() <= step).all()
    assert (y == ref.to(torch.bfloat16)).float().mean() > 0.99


def _int8(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=g) * 0.05).bfloat16()
    return w, quantize_int8(w)


def test_quantize_int8_stays_within_half_a_step():
    w, rows = _int8((96, 64))
    w[3] = 0  # an all-zero row keeps a usable scale
    rows = quantize_int8(w)
    assert rows.q.dtype == torch.int8 and rows.scale.dtype == torch.float32 and rows.q.abs().max() <= 127
    err = (rows.q.double() * rows.scale.double()[:, None] - w.double()).abs()
    assert (err <= rows.scale.double()[:, None] * (0.5 + 1e-5)).all()  # + 127 x the scale's float32 rounding
    assert (rows.q.abs().amax(1)[torch.arange(96) != 3] == 127).all()  # each row's extreme maps to +-127
    assert rows.scale[3] == 1 and (rows.q[3] == 0).all()


@needs_kernel
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (64, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_kernel_matches_the_exact_product(shape, rows, with_bias):
    """y = (x . q) * scale + bias, rounded to bfloat16 once; both prefetch modes give the same bits."""
    torch.manual_seed(rows)
    _, q8 = _int8(shape, rows)
    x = torch.randn(rows, shape[1]).bfloat16()
    bias = torch.randn(shape[0]).bfloat16() if with_bias else None
    y = cpu_native.gemv_i8w(x, q8.q, q8.scale, bias, cpu_native.PREFETCH_L1)
    ref = (x.double() @ q8.q.double().T) * q8.scale.double()
    magnitude = (x.double().abs() @ q8.q.double().abs().T) * q8.scale.double()
    if with_bias:
        ref, magnitude = ref + bias.double(), magnitude + bias.double().abs()
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (rows, shape[0])
    _check(y, ref, magnitude)
    assert torch.equal(y, cpu_native.gemv_i8w(x, q8.q, q8.scale, bias, cpu_native.PREFETCH_L2))


@needs_kernel
def test_int8_kernel_refuses_what_it_cannot_take():
    _, q8 = _int8((64, 96))
    assert cpu_native.gemv_i8w(torch.randn(9, 96).bfloat16(), q8.q, q8.scale, None) is None  # over 8 rows
    _, odd = _int8((64, 80))
    assert cpu_native.gemv_i8w(torch.randn(1, 80).bfloat16(), odd.q, odd.scale, None) is None  # in % 32


@needs_kernel
def test_linear_takes_the_kernel_for_a_decode_step_and_onednn_for_a_prompt(monkeypatch):
    """Up to 8 rows: the int8 kernel, the exact product with q * scale rounded once; more: oneDNN
    on q * scale rounded to bfloat16 (the same weights up to bfloat16's rounding). 584 outputs: no
    64-output panels, so cpu_gemv.c's kernel (test_gemm_pairs.py routes the pair-panel one)."""
    w, _ = _int8((584, 576))
    p = pack(w, int8=True)
    assert isinstance(p, PackedWeight) and p.int8 is not None and p.plain is None and p.int8.pairs is None
    exact_w, rounded_w = p.int8.dequantize(torch.float64), p.int8.dequantize(torch.bfloat16).double()
    calls = []
    real = cpu_native.gemv_i8w
    monkeypatch.setattr(cpu_native, "gemv_i8w", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 8, 9, 64):
        x = torch.randn(rows, 576).bfloat16()
        y = linear(x, p)
        assert y.shape == (rows, 584)
        if rows <= 8:
            _check(y, x.double() @ exact_w.T, x.double().abs() @ exact_w.abs().T)
        else:
            torch.testing.assert_close(y.double(), x.double() @ rounded_w.T, rtol=1.6e-2, atol=1e-2)
    assert calls == [1, 8]


def test_pack_int8_refuses_with_the_reason():
    with pytest.raises(ValueError, match="bfloat16 activations"):
        pack(torch.randn(64, 64), int8=True)  # float32
    if cpu_native.gemv_available():
        with pytest.raises(ValueError, match="in % 32"):
            pack(torch.randn(64, 80).bfloat16(), int8=True)


def test_pack_int8_names_the_missing_instruction(monkeypatch):
    monkeypatch.setattr(cpu_native, "gemv_available", lambda: False)
    with pytest.raises(ValueError, match="AVX512-BF16"):
        pack(torch.randn(64, 64).bfloat16(), int8=True)


def test_a_cpu_without_bfloat16_refuses_int8_weights_at_load(embedded, monkeypatch):
    """--dtype bfloat16 falls back to float32 on such a CPU (a warning); int8 weights cannot, and
    the worker says so before loading anything."""
    from engine import dtype_choice

    monkeypatch.setattr(dtype_choice, "has_fast_bf16", lambda flags=None: False)
    with pytest.raises(
        ValueError,
        match=r"--weight-dtype int8 runs on CPUs with AVX512-BF16 \(this worker runs "
        r"cpu in float32\): drop --weight-dtype int8",
    ):
        LLM(engine_cfg(dtype="bfloat16", weight_dtype="int8"), sched_cfg(), loaded=embedded[:3])


def test_config_refuses_int8_weights_without_bfloat16():
    with pytest.raises(ValidationError, match="--weight-dtype int8 needs --dtype bfloat16"):
        EngineConfig(weight_dtype="int8")
    assert EngineConfig(weight_dtype="int8", dtype="bfloat16").weight_dtype == "int8"


def _score(llm, ids, new_tokens=0):
    """(logprob of each prompt token after the first, top-1 at each position, greedy tokens, their
    logprobs): the prompt's through prefill, the greedy tokens' through decode steps."""
    sp = SamplingParams(
        max_new_tokens=max(new_tokens, 1), temperature=0, prompt_logprobs=1, logprobs=0, ignore_eos=True
    )
    out = run_batch(llm.scheduler, [ids], [sp])[0]
    entries = out.prompt_logprobs[1:]
    return torch.tensor([e[0] for e in entries]), [e[1][0][0] for e in entries], out.token_ids, out.logprobs


def _dequantized_reference(embedded, int8_llm):
    """A bfloat16 engine whose matmul weights are the int8 engine's values widened to bfloat16."""
    ref = LLM(engine_cfg(dtype="bfloat16"), sched_cfg(), loaded=embedded[:3])
    src, dst = int8_llm.runner.model, ref.runner.model
    for a, b in zip(src.layers, dst.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            b.w[name] = pack(a.w[name].int8.dequantize(torch.bfloat16))
    dst.lm_head = pack(src.lm_head.int8.dequantize(torch.bfloat16))
    return ref


@needs_kernel
def test_int8_engine_against_its_dequantized_reference_and_float32(embedded, monkeypatch):
    """The int8 engine serves its own weights. Prompt logits (prefill: oneDNN on the widened
    weights) equal the dequantized reference's; each greedy token's logprob from a decode step (the
    int8 kernel) matches the reference's logprob of the same token scored in its prompt (a
    different path: only bfloat16 rounding apart). Against float32 it is held to what int8 allows."""
    ids = embedded[2].encode(TEXT)
    int8 = LLM(engine_cfg(dtype="bfloat16", weight_dtype="int8"), sched_cfg(), loaded=embedded[:3])
    assert all(
        isinstance(layer.w[n], PackedWeight) and layer.w[n].int8 is not None
        for layer in int8.runner.model.layers
        for n in ("qkv", "o", "gate_up", "down")
    )
    got_lp, got_top, greedy, greedy_lp = _score(int8, ids, new_tokens=16)
    monkeypatch.setattr(cpu_linear, "pairs_take_all", lambda: False)  # the reference's prompts on oneDNN too
    ref = _dequantized_reference(embedded, int8)
    ref_lp, _, _, _ = _score(ref, ids)
    assert (got_lp - ref_lp).abs().max() < 1e-3
    scored, _, _, _ = _score(ref, ids + greedy)
    delta = (torch.tensor(greedy_lp) - scored[-len(greedy) :]).abs()
    # decode and prefill of one bfloat16 engine differ by as much (rounding in another order)
    assert len(greedy) == 16 and delta.mean() < 0.05 and delta.max() < 0.25, delta
    f32_lp, f32_top, _, _ = _score(LLM(engine_cfg(dtype="float32"), sched_cfg(), loaded=embedded[:3]), ids)
    delta = (got_lp - f32_lp).abs()
    agree = sum(a == b for a, b in zip(got_top, f32_top)) / len(f32_top)
    assert delta.mean() < 0.15 and delta.max() < 1.5, (delta.mean(), delta.max())
    assert agree >= 0.85, agree


@needs_kernel
def test_kv_handshake_refuses_a_peer_with_other_weights(embedded):
    """KV computed with int8 weights must not be continued with bfloat16 ones (or back): the
    runner's KV descriptor names the weights, and the prefill side's handshake check compares it."""
    from prefill_worker.kv_sender import KVSender
    from transfer.wire.protocol import KVHandshake

    int8 = LLM(engine_cfg(dtype="bfloat16", weight_dtype="int8"), sched_cfg(), loaded=embedded[:3]).runner
    bf16 = LLM(engine_cfg(dtype="bfloat16"), sched_cfg(), loaded=embedded[:3]).runner
    assert int8.kv_descriptor() == {**bf16.kv_descriptor(), "weights": "int8"}
    assert bf16.kv_descriptor()["weights"] == "bfloat16"
    hs = KVHandshake(
        worker_id="decode-0", model="m", layout=int8.kv_descriptor(), transport="nixl", transport_metadata=""
    )
    err = KVSender(transport=None, unit_bytes=1, threaded=False).accept_peer(None, hs, "m", bf16.kv_descriptor())
    assert err == "KV layout mismatch on weights: decode has 'int8', prefill has 'bfloat16'"


@needs_kernel
def test_a_vocabulary_the_kernel_cannot_block_keeps_a_bfloat16_head(tiny):
    """The tiny model's 97-row head stays bfloat16 (packed as usual); its layers go int8."""
    from engine.model import LlamaModel

    cfg, weights = tiny[:2]
    model = LlamaModel(cfg, torch.device("cpu"), torch.bfloat16, int8=True)
    model.load_weights(weights)
    assert model.lm_head.int8 is None and model.layers[0].w["qkv"].int8 is not None
