"""bf16 on a CPU without native bf16 falls back to fp32 (it would be slower there)."""

from __future__ import annotations

import logging

import torch

from engine.cpu_features import has_fast_bf16
from engine.model_runner import resolve_dtype

AVX2 = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
AVX512_BF16 = AVX2 | {"avx512f", "avx512_bf16"}


def test_bf16_falls_back_to_fp32_without_native_bf16(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING):
        assert resolve_dtype("bfloat16", cpu, AVX2) is torch.float32
    assert "AVX512_BF16" in caplog.text and "float32" in caplog.text
    assert resolve_dtype("bfloat16", cpu, AVX512_BF16) is torch.bfloat16
    assert resolve_dtype("bfloat16", cpu, AVX2 | {"amx_bf16"}) is torch.bfloat16
    assert resolve_dtype("float16", cpu, AVX2) is torch.float16 and resolve_dtype("auto", cpu, AVX2) is torch.float32


def test_unknown_cpus_are_trusted():
    assert has_fast_bf16(frozenset()) is None
    assert has_fast_bf16(frozenset({"fp", "asimd", "bf16"})) is None  # aarch64: no x86 flags
    assert resolve_dtype("bfloat16", torch.device("cpu"), frozenset({"fp", "asimd"})) is torch.bfloat16


def test_auto_follows_bf16_weights_on_a_cpu_that_runs_them_natively():
    from engine.dtype_choice import choose_dtype

    cpu = torch.device("cpu")
    assert choose_dtype("auto", cpu, "bfloat16", AVX512_BF16) == (
        torch.bfloat16,
        "auto on CPU with bfloat16 weights and native bf16 instructions",
    )
    assert choose_dtype("auto", cpu, "bfloat16", AVX2)[0] is torch.float32  # bf16 would be slower there
    assert choose_dtype("auto", cpu, "bfloat16", frozenset({"fp", "asimd"}))[0] is torch.bfloat16  # trusted
    for stored in ("float32", "float16"):  # bfloat16 would round these weights
        dtype, why = choose_dtype("auto", cpu, stored, AVX512_BF16)
        assert dtype is torch.float32 and stored in why
    assert choose_dtype("float32", cpu, "bfloat16", AVX512_BF16) == (torch.float32, "--dtype float32")
    assert choose_dtype("float32", cpu, "quantized", AVX512_BF16) == (torch.float32, "--dtype float32")
    assert choose_dtype("auto", torch.device("cuda"), "float32")[0] is torch.bfloat16


def test_auto_runs_a_quantized_gguf_in_bfloat16_only_where_bf16_is_native():
    """The embedded Q4_1 model (every default launch): bfloat16 with AVX512-BF16 or AMX, float32 on
    an AVX2-only CPU (slower there) and where the CPU's bf16 support is unknown; the reason says so."""
    from engine.dtype_choice import choose_dtype

    cpu = torch.device("cpu")
    assert choose_dtype("auto", cpu, "quantized", AVX512_BF16) == (
        torch.bfloat16,
        "auto on CPU with quantized weights and native bf16 instructions",
    )
    assert choose_dtype("auto", cpu, "quantized", AVX2 | {"amx_bf16"})[0] is torch.bfloat16
    dtype, why = choose_dtype("auto", cpu, "quantized", AVX2)
    assert dtype is torch.float32 and "without AVX512-BF16/AMX" in why
    dtype, why = choose_dtype("auto", cpu, "quantized", frozenset({"fp", "asimd"}))
    assert dtype is torch.float32 and "unknown" in why


def test_the_runner_logs_the_dtype_it_picked_from_the_checkpoint(tmp_path, caplog, monkeypatch):
    """A bfloat16 HF folder: stored_dtype bfloat16; ``auto`` runs it in bfloat16 where the CPU is
    fast (flags faked), ``float32`` stays float32; the log names the choice and its reason."""
    from engine import dtype_choice
    from engine.loader import load_for_engine
    from engine.model_runner import ModelRunner
    from tests.support.hf_folders import save_small_model
    from tests.support.models import engine_cfg

    save_small_model("llama", tmp_path).to(torch.bfloat16).save_pretrained(tmp_path)
    monkeypatch.setattr(dtype_choice, "has_fast_bf16", lambda flags=None: True)
    for spec, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        ecfg = engine_cfg(dtype=spec, device="cpu")
        cfg, weights = load_for_engine(tmp_path, ecfg)
        assert cfg.stored_dtype == "bfloat16"
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="engine.model_runner"):
            runner = ModelRunner(ecfg, cfg, weights)
        assert runner.dtype is want
        name = str(want).removeprefix("torch.")
        assert f"dtype: {name} (" in caplog.text


def test_the_test_session_pins_float32_and_the_product_default_stays_auto():
    """tests/conftest.py sets ``PDSERVE_DTYPE=float32``: every launched server and every config read
    from the environment runs the exact mode; without the variable the default is ``auto``."""
    import os

    from configs.schema import load_config

    assert os.environ["PDSERVE_DTYPE"] == "float32"
    assert load_config().engine.dtype == "float32"
    assert load_config(environ={}).engine.dtype == "auto"
