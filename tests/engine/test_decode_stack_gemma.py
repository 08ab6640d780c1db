"""The C decode stack on Gemma 2 and Gemma 3 text (small random HF models built with transformers):
a decode step through the stack computes bitwise what the per-layer Python path computes (logits and
every KV byte of both pools), for the sliding layers' windows (contexts past the window of 8), the
SWA pool or none, Gemma 2's attention soft cap and Gemma 3's Q/K norms and local RoPE base, at 1, 3
and 8 rows; and greedy tokens through the stack still equal transformers'.

float32 runs everywhere the kernels build: without AVX-512F the layer weights are packed as panels for
the library's portable float32 loop (``tests/support/cpu_kernels.py``), which the stack and the layer
path both call. bfloat16 needs the small-batch kernels (AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_linear
from engine.decode_stack import ENV
from engine.forward_batch import ForwardMode
from engine.llm import LLM
from engine.loader import load_for_engine
from engine.model_runner import ModelRunner, SeqChunk
from tests.support.cpu_kernels import needs_small_batch_kernels, portable_float32_panels
from tests.support.decode_stack_paths import BothPaths
from tests.support.hf_folders import (
    GEMMA2,
    GEMMA3,
    random_prompts,
    reference_greedy,
    reference_variant,
    save_small_model,
)
from tests.support.models import engine_cfg, sched_cfg
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

NEW = 8
KINDS = {"gemma2": GEMMA2, "gemma3_text": GEMMA3}


@pytest.fixture(autouse=True)
def _stack_on(monkeypatch):
    """The stack on whatever the environment says (the suite may run with it off)."""
    monkeypatch.setenv(ENV, "1")


@pytest.fixture(scope="module", params=sorted(KINDS))
def folder(request, tmp_path_factory):
    """``(kind, folder, transformers model)`` of a small random Gemma 2 or Gemma 3 text model."""
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    return kind, path, save_small_model(kind, path, **KINDS[kind])


def _llm(folder, tokenizer, dtype: str, **engine) -> LLM:
    ecfg = engine_cfg(dtype=dtype, page_size=4, attention_backend="cpu", **engine)
    cfg, weights = load_for_engine(folder, ecfg)
    return LLM(ecfg, sched_cfg(max_running_requests=8), loaded=(cfg, weights, tokenizer))


def _compare(llm: LLM) -> list[tuple[int, bool, bool]]:
    """(rows, same logits, same pools) of every step the stack took over prompts of 1, 3 and 8 requests
    (unequal lengths of 9..44 tokens: past the window, different pages and ranges per row)."""
    assert llm.runner.model.stack is not None
    both = BothPaths(llm.runner.model)
    for rows in (1, 3, 8):
        prompts = [p[: 9 + 5 * i] for i, p in enumerate(random_prompts(rows, 30, seed=rows))]
        llm.generate_ids(prompts, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    return [(rows, torch.equal(a, b), torch.equal(s, p)) for rows, a, b, s, p in both.steps]


def _assert_bitwise(compared) -> None:
    assert {1, 3, 8} <= {c[0] for c in compared}, compared
    assert all(same_logits and same_pools for _, same_logits, same_pools in compared), compared


@pytest.mark.parametrize("swa_pool_tokens", [None, 0], ids=["swa-pool", "one-pool"])
def test_float32_steps_through_the_stack_are_bitwise_the_layer_path(folder, tokenizer, monkeypatch, swa_pool_tokens):
    portable_float32_panels(monkeypatch)
    llm = _llm(folder[1], tokenizer, "float32", **({} if swa_pool_tokens is None else {"swa_pool_tokens": 0}))
    assert (llm.runner.pools.swa is not None) == (swa_pool_tokens is None)
    _assert_bitwise(_compare(llm))


@pytest.mark.parametrize("windows", [{}, {"sliding_window": 8, "layer_types": "alternate"}], ids=["full", "windows"])
def test_llama_float32_steps_stay_bitwise_the_layer_path(tokenizer, monkeypatch, tmp_path, windows):
    """The Llama layers the stack ran before Gemma (their attention now through the per-layer views), and
    a Llama with alternate sliding layers (window 8, the SWA pool), which the stack now takes too."""
    portable_float32_panels(monkeypatch)
    save_small_model("llama", tmp_path)
    llm = _llm(tmp_path, tokenizer, "float32", **windows)
    assert (llm.runner.pools.swa is not None) == bool(windows)
    _assert_bitwise(_compare(llm))


@needs_small_batch_kernels
def test_bfloat16_steps_through_the_stack_are_bitwise_the_layer_path(folder, tokenizer):
    _assert_bitwise(_compare(_llm(folder[1], tokenizer, "bfloat16")))


@pytest.mark.slow
def test_greedy_tokens_through_the_stack_equal_transformers(folder, tokenizer, monkeypatch):
    """Every decode step of a batch of 3 prompts past the window runs the stack (float32)."""
    portable_float32_panels(monkeypatch)
    kind, path, model = folder
    prompts = random_prompts(3, 30)
    llm = _llm(path, tokenizer, "float32")
    stack, forward, took = llm.runner.model.stack, llm.runner.model.forward, []

    def spy(batch, attn):
        if batch.mode is ForwardMode.DECODE:
            took.append(stack.takes(batch, attn))
        return forward(batch, attn)

    llm.runner.model.forward = spy
    out = llm.generate_ids(prompts, SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True))
    assert took and all(took)
    assert [r.token_ids for r in out] == reference_greedy(model, prompts, NEW)


def test_decode_logits_through_the_stack_equal_transformers_under_the_final_cap(tokenizer, monkeypatch, tmp_path):
    """Gemma 2: a decode step past the window through the stack gives transformers' logits, whose final
    cap of 2 (applied after the stack, on the LM head's output) bounds them; uncapped they reach past it."""
    portable_float32_panels(monkeypatch)
    model = save_small_model("gemma2", tmp_path, **GEMMA2)
    ecfg = engine_cfg(page_size=4, attention_backend="cpu", swa_pool_tokens=0)
    cfg, weights = load_for_engine(tmp_path, ecfg)
    runner = ModelRunner(ecfg, cfg, weights)
    stack, calls = runner.model.stack, []
    real = stack.run
    monkeypatch.setattr(stack, "run", lambda *a: calls.append(a[1].batch_size) or real(*a))
    ids, pages = random_prompts(1, 37)[0], list(range(10))
    runner.forward(ForwardMode.EXTEND, [SeqChunk(ids[:-1], 0, pages)])
    got = runner.forward(ForwardMode.DECODE, [SeqChunk(ids[-1:], len(ids) - 1, pages)])[0]
    assert calls == [1]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1]
        uncapped = reference_variant("gemma2", tmp_path, final_logit_softcapping=None)(torch.tensor([ids])).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert uncapped[0, -1].abs().max() > 2.0 >= want.abs().max()


def test_the_gemma_stack_is_built_only_where_it_can_run(folder, monkeypatch):
    """float32 layer weights in panels: built, running the Gemma layers up to the panels' row limit;
    float16 (no kernels) and ``PDSERVE_DECODE_STACK=0``: none."""
    from engine.gemma3 import Gemma3Model

    portable_float32_panels(monkeypatch)
    cfg, weights = load_for_engine(folder[1], engine_cfg())

    def built(dtype: torch.dtype):
        model = Gemma3Model(cfg, torch.device("cpu"), dtype)
        model.load_weights(weights)
        return model.stack

    stack = built(torch.float32)
    assert stack is not None and stack.gemma and stack.max_rows == cpu_linear.PANELS_ROWS
    assert built(torch.float16) is None
    monkeypatch.setenv(ENV, "0")
    assert built(torch.float32) is None
