"""Sliding-window hybrid models: loading (HF model types, GGUF), the overrides, start-up checks.

Tiny random HF folders (config.json + safetensors + tokenizer.json) of each model type are run by
pdserve's colocated engine (loaded from the folder like a worker does) and by transformers on the
same folder; logits are compared at every prefill and decode position (off-by-one windows often
keep the greedy tokens, so tokens alone prove little).
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from configs.sliding_window import parse_layer_types, validate_swa_pool
from engine.llm import LLM, run_batch
from engine.loader import load_for_engine, load_model_weights
from engine.swa_config import SlidingOverrides, gguf_sliding_spec
from transfer.wire.sampling_params import SamplingParams

F, S = "full_attention", "sliding_attention"
VOCAB, LAYERS, WINDOW = 97, 3, 8
PROMPTS = [[(7 * i + 3) % (VOCAB - 3) + 3 for i in range(44)], [(11 * i + 5) % (VOCAB - 3) + 3 for i in range(53)]]
DECODE_STEPS = 6
TOL = 2e-4

# model type -> config.json keys that set its sliding layers (besides the common ones)
CASES = {
    "ministral": dict(sliding_window=WINDOW, layer_types=[S, F, S]),
    "mistral": dict(sliding_window=WINDOW),
    "qwen2-max-window-layers": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen2-off": dict(use_sliding_window=False, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW + 4, layer_types=[F, S, S]),
}
# expected per-layer kinds (what transformers computes, asserted against it below too)
EXPECTED = {
    "ministral": (S, F, S),
    "mistral": (S, S, S),
    "qwen2-max-window-layers": (F, S, S),
    "qwen2-off": (F, F, F),
    "qwen3": (F, S, S),
}


def _write_tokenizer(folder) -> None:
    """A word-level tokenizer over the tiny vocabulary (t0 ... t96), enough for the engine to load."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def build_folder(case: str, folder, drop_layer_types: bool = False, **extra):
    """Save a tiny random model of ``case`` to ``folder``; return transformers' model loaded back."""
    import transformers

    kind = case.split("-")[0]
    cls = {"ministral": "Ministral", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[kind]
    torch.manual_seed(zlib.crc32(case.encode()))
    cfg = getattr(transformers, cls + "Config")(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **{**CASES[case], **extra},
    )
    getattr(transformers, cls + "ForCausalLM")(cfg).save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder)
    if drop_layer_types:  # transformers saves the layer_types it derived: drop them to test the derivation
        raw = json.loads((folder / "config.json").read_text())
        raw.pop("layer_types", None)
        (folder / "config.json").write_text(json.dumps(raw))
    return hf_load(folder)


def hf_load(folder, **overrides):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **overrides).eval()


def hf_windows(model) -> list[int | None]:
    """The window each layer of a transformers model attends with (None: full attention)."""
    cfg = model.config
    if cfg.model_type == "mistral":  # MistralAttention uses config.sliding_window on every layer
        return [cfg.sliding_window] * cfg.num_hidden_layers
    return [a.self_attn.sliding_window for a in model.model.layers]


def pd_windows(cfg) -> list[int | None]:
    return [cfg.sliding_window if t == S else None for t in cfg.layer_types]


def hf_reference(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and log-softmax rows [steps, vocab], each by a full recompute (no cache)."""
    ids, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            rows.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt) :], torch.stack(rows)


def run_engine(engine: EngineConfig, sched: SchedulerConfig | None = None):
    """pdserve's colocated engine on ``engine.model``: per prompt (tokens, top-20 logprob pairs per step)."""
    llm = LLM(engine, sched or SchedulerConfig())
    params = SamplingParams(max_new_tokens=DECODE_STEPS, temperature=0, logprobs=20, ignore_eos=True)
    outs = run_batch(llm.scheduler, PROMPTS, [params] * len(PROMPTS))
    llm.scheduler.check_integrity()
    return llm, [(o.token_ids, o.top_logprobs) for o in outs]


def assert_matches(outs, model) -> float:
    """Tokens equal and every returned logprob within TOL of transformers'; returns the max error."""
    worst = 0.0
    for prompt, (tokens, tops) in zip(PROMPTS, outs):
        ref_tokens, ref_rows = hf_reference(model, prompt, DECODE_STEPS)
        assert tokens == ref_tokens
        for step, pairs in enumerate(tops):
            assert len(pairs) == 20
            ids = torch.tensor([t for t, _ in pairs])
            err = (torch.tensor([lp for _, lp in pairs]) - ref_rows[step, ids]).abs().max().item()
            worst = max(worst, err)
    assert worst < TOL, f"logprobs differ from transformers by {worst}"
    return worst


def assert_sensitive(model_a, model_b) -> None:
    """The comparison can fail: transformers itself differs by far more than TOL between two windows."""
    _, rows_a = hf_reference(model_a, PROMPTS[0], 2)
    _, rows_b = hf_reference(model_b, PROMPTS[0], 2)
    assert (rows_a - rows_b).abs().max().item() > 50 * TOL


@pytest.mark.parametrize(
    "case, page_size, chunk",
    [
        ("ministral", 4, 2048),
        ("mistral", 16, 16),
        ("qwen2-max-window-layers", 8, 2048),
        ("qwen2-off", 4, 2048),
        ("qwen3", 16, 2048),
    ],
)
@pytest.mark.slow
def test_engine_logits_match_transformers(tmp_path, case, page_size, chunk):
    model = build_folder(case, tmp_path, drop_layer_types=case == "qwen2-max-window-layers")
    llm, outs = run_engine(
        EngineConfig(model=str(tmp_path), page_size=page_size, kv_pool_tokens=1024),
        SchedulerConfig(chunked_prefill_size=chunk),
    )
    cfg = llm.model_config
    assert cfg.layer_types == EXPECTED[case]
    assert pd_windows(cfg) == hf_windows(model)
    assert min(map(len, PROMPTS)) > 4 * WINDOW
    assert_matches(outs, model)
    window = CASES[case]["sliding_window"]
    # (transformers saves qwen's sliding_window as null when sliding is off: give it back to turn it on)
    other = (
        dict(use_sliding_window=True, sliding_window=window, layer_types=[F, S, S])
        if case == "qwen2-off"
        else dict(sliding_window=window + 1)
    )
    assert_sensitive(model, hf_load(tmp_path, **other))


def test_hf_layer_types_follow_transformers_per_model_type(tmp_path):
    """Derivations without a saved layer_types list, and lists transformers ignores."""
    cases = [
        ("ministral", dict(layer_types=None), (S, S, S)),  # window set: every layer slides
        ("ministral", dict(layer_types=None, sliding_window=None), (F, F, F)),
        # MistralConfig ignores layer_types, but AutoConfig reads a mistral config.json that has the
        # key as ministral: the list counts (null: every layer slides, as plain mistral)
        ("mistral", dict(layer_types=[S, F, F]), (S, F, F)),
        ("mistral", dict(layer_types=None), (S, S, S)),
        ("qwen3", dict(layer_types=None, max_window_layers=2), (F, F, S)),
        ("qwen2-off", dict(layer_types=None), (F, F, F)),
    ]
    for i, (case, extra, expected) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        drop = extra.get("layer_types", 0) is None and case != "mistral"
        model = build_folder(case, folder, drop_layer_types=drop, **extra)
        if case == "mistral":  # MistralConfig does not save layer_types: write the key by hand
            raw = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**raw, "layer_types": extra["layer_types"]}))
            model = hf_load(folder)
            assert type(model).__name__ == "MinistralForCausalLM"
        cfg, _ = load_model_weights(folder)
        assert cfg.layer_types == expected, (case, extra)
        assert pd_windows(cfg) == hf_windows(model), (case, extra)


def test_qwen_sliding_off_ignores_layer_types(tmp_path):
    """use_sliding_window=false: transformers forces the window to None, so a layer_types list with
    sliding layers cannot run there (it fails at the first forward); pdserve runs every layer full."""
    build_folder("qwen2-off", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["layer_types"] = [S, S, F]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg, _ = load_model_weights(tmp_path)
    assert cfg.layer_types == (F, F, F) and cfg.sliding_window is None
    with pytest.raises((TypeError, ValueError)):  # its window is None: the cache or the mask fails
        hf_load(tmp_path)(torch.tensor([PROMPTS[0]]))


@pytest.mark.slow
def test_overrides_run_like_transformers_with_the_same_settings(tmp_path):
    """--layer-types alternate --sliding-window 6 on a ministral folder == transformers given the same."""
    build_folder("ministral", tmp_path)
    engine = EngineConfig(
        model=str(tmp_path), page_size=4, kv_pool_tokens=1024, sliding_window=6, layer_types="alternate"
    )
    llm, outs = run_engine(engine)
    assert llm.model_config.layer_types == (S, F, S) and llm.model_config.sliding_window == 6
    model = hf_load(tmp_path, sliding_window=6, layer_types=[S, F, S])
    assert pd_windows(llm.model_config) == hf_windows(model)
    assert_matches(outs, model)
    assert_sensitive(model, hf_load(tmp_path))

    cfg, _ = load_for_engine(tmp_path, EngineConfig(layer_types="full,full,sliding"))
    assert cfg.layer_types == (F, F, S) and cfg.sliding_window == WINDOW  # the model's window
    cfg, _ = load_for_engine(tmp_path, EngineConfig(layer_types="full,full,full"))
    assert cfg.sliding_window is None


def test_cli_flags_parse_into_the_engine_config():
    import argparse

    from configs.cli_flags import add_flags, collect

    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig)
    args = parser.parse_args(["--sliding-window", "8", "--layer-types", "sliding, full,sliding"])
    engine = EngineConfig(**collect(args, EngineConfig))
    assert (engine.sliding_window, engine.layer_types) == (8, "sliding,full,sliding")
    assert EngineConfig(layer_types=["sliding", "full"]).layer_types == "sliding,full"  # YAML list
    with pytest.raises(ValueError, match=r"--layer-types: entry 1 is 'banana'"):
        EngineConfig(layer_types="sliding,banana")
    with pytest.raises(ValueError, match="sliding_window"):
        EngineConfig(sliding_window=0)


def test_layer_types_parsing():
    assert parse_layer_types("alternate", 5) == (S, F, S, F, S)
    assert parse_layer_types("full_attention,sliding", 2) == (F, S)
    with pytest.raises(ValueError, match=r"--layer-types lists 2 layers but the model has 3"):
        parse_layer_types("sliding,full", 3)
    with pytest.raises(ValueError, match=r"--layer-types: entry 0 is ''"):
        parse_layer_types("", 1)


def test_override_errors_name_the_flag(tmp_path):
    build_folder("qwen2-off", tmp_path)
    with pytest.raises(ValueError, match=r"--layer-types lists 2 layers but the model has 3"):
        load_for_engine(tmp_path, EngineConfig(layer_types="sliding,full"))
    with pytest.raises(ValueError, match=r"no window: set --sliding-window"):  # sliding off: no window known
        load_for_engine(tmp_path, EngineConfig(layer_types="alternate"))
    cfg, _ = load_for_engine(tmp_path, EngineConfig(sliding_window=5))  # no sliding layer: all slide
    assert cfg.layer_types == (S, S, S) and cfg.sliding_window == 5


def test_window_larger_than_context_fails_at_start(tmp_path):
    build_folder("ministral", tmp_path)  # max_position_embeddings 256, window 8
    with pytest.raises(ValueError, match=r"sliding window 300 is larger than the context length 256.*--sliding-window"):
        load_for_engine(tmp_path, EngineConfig(sliding_window=300))
    with pytest.raises(
        ValueError,
        match=r"larger than the context length 6 .*--sliding-window to at most 6 or "
        r"raise --max-model-len to at least 8",
    ):
        LLM(EngineConfig(model=str(tmp_path), max_model_len=6, kv_pool_tokens=256))
    cfg, _ = load_for_engine(tmp_path, EngineConfig(max_model_len=8))  # window == context is fine
    assert cfg.sliding_window == 8


def test_worker_start_up_fails_on_a_bad_window(tmp_path):
    """The worker process's loader path applies the same overrides and checks."""
    from configs.schema import load_config
    from server.worker.main import load_runner

    build_folder("ministral", tmp_path)
    cfg = load_config(
        cli={"model": str(tmp_path), "kv_pool_tokens": 256, "sliding_window": 4, "layer_types": "alternate"}
    )
    runner, _ = load_runner(cfg)
    assert runner.model_config.layer_types == (S, F, S) and runner.backend.windows == [4, None, 4]
    with pytest.raises(ValueError, match="--max-model-len"):
        load_runner(load_config(cli={"model": str(tmp_path), "max_model_len": 4}))


def test_unsupported_sliding_configs_name_the_flag(tmp_path):
    raw = {"model_type": "cohere2", "num_hidden_layers": 2, "sliding_window": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError,
        match=r"unsupported architecture 'cohere2'.*sliding-window attention .* "
        r"choose another --model",
    ):
        load_model_weights(tmp_path)
    build_folder("ministral", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "layer_types": [S, "chunked_attention", F]}))
    with pytest.raises(ValueError, match=r"'chunked_attention'.*--layer-types"):
        load_model_weights(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))  # sliding layers, no window
    with pytest.raises(ValueError, match=r"layers \[0, 2\] use sliding-window attention .*--sliding-window"):
        load_model_weights(tmp_path)
    cfg, _ = load_model_weights(tmp_path, SlidingOverrides(sliding_window=8))  # the flag rescues it
    assert cfg.layer_types == (S, F, S) and cfg.sliding_window == 8


def test_swa_pool_must_be_whole_pages():
    validate_swa_pool(128, 16)
    with pytest.raises(
        ValueError,
        match=r"--swa-pool-tokens \(100\) must be a positive multiple of --page-size "
        r"\(16\): set --swa-pool-tokens to 96 or 112",
    ):
        validate_swa_pool(100, 16)
    with pytest.raises(ValueError, match=r"set --swa-pool-tokens to 16, or change --page-size"):
        validate_swa_pool(8, 16)


def test_gguf_sliding_pattern_follows_llama_cpp():
    assert gguf_sliding_spec(None, None, 3).layer_types == (F, F, F)
    assert gguf_sliding_spec(0, 4, 3).window is None
    assert gguf_sliding_spec(8, None, 3).layer_types == (S, S, S)
    assert gguf_sliding_spec(8, 4, 8).layer_types == (S, S, S, F, S, S, S, F)  # n=4: three sliding, one full
    assert gguf_sliding_spec(8, 0, 2).layer_types == (S, S)
    assert gguf_sliding_spec(8, 1, 2).layer_types == (F, F)
    assert gguf_sliding_spec(8, [True, False, True], 3).layer_types == (S, F, S)
    with pytest.raises(ValueError, match="--layer-types"):
        gguf_sliding_spec(8, [True], 3)


def _write_gguf(path, window: int | None, pattern) -> None:
    """A tiny llama-arch GGUF (F32 tensors) with optional sliding-window metadata."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    hidden, ffn, heads, kv, layers = 32, 48, 4, 2, 4
    for add, value in [
        (w.add_block_count, layers),
        (w.add_embedding_length, hidden),
        (w.add_feed_forward_length, ffn),
        (w.add_head_count, heads),
        (w.add_head_count_kv, kv),
        (w.add_context_length, 128),
        (w.add_vocab_size, VOCAB),
        (w.add_layer_norm_rms_eps, 1e-5),
    ]:
        add(value)
    if window is not None:
        w.add_sliding_window(window)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.2  # noqa: E731
    w.add_tensor("token_embd.weight", r(VOCAB, hidden))
    w.add_tensor("output_norm.weight", 1 + r(hidden))
    w.add_tensor("output.weight", r(VOCAB, hidden))
    hd = hidden // heads
    for i in range(layers):
        for name, shape in [
            ("attn_q", (hidden, hidden)),
            ("attn_k", (kv * hd, hidden)),
            ("attn_v", (kv * hd, hidden)),
            ("attn_output", (hidden, hidden)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
            ("attn_norm", (hidden,)),
            ("ffn_norm", (hidden,)),
        ]:
            w.add_tensor(f"blk.{i}.{name}.weight", r(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "window, pattern, expected",
    [
        (None, None, (F, F, F, F)),
        (8, None, (S, S, S, S)),
        (8, 2, (S, F, S, F)),
        (8, [False, True, True, False], (F, S, S, F)),
    ],
)
def test_gguf_sliding_window_metadata(tmp_path, window, pattern, expected):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, window, pattern)
    cfg, _ = load_model_weights(path)
    assert cfg.layer_types == expected
    assert cfg.sliding_window == (window if S in expected else None)
    cfg, _ = load_model_weights(path, SlidingOverrides(sliding_window=5, layer_types="alternate"))
    assert (cfg.layer_types, cfg.sliding_window) == ((S, F, S, F), 5)


def test_check_startup_reads_no_weights_and_agrees_with_the_load(tmp_path):
    from engine.loader import check_startup, read_model_config

    build_folder("qwen3", tmp_path)
    engine = EngineConfig(sliding_window=6, layer_types="alternate")
    assert check_startup(tmp_path, engine) == load_for_engine(tmp_path, engine)[0]
    assert read_model_config(tmp_path) == load_model_weights(tmp_path)[0]
    with pytest.raises(ValueError, match="--sliding-window"):
        check_startup(tmp_path, EngineConfig(sliding_window=300))


def test_cli_refuses_a_bad_window_before_starting_workers(tmp_path, capsys):
    from server.launch.cli import main

    build_folder("ministral", tmp_path)
    rc = main(["launch", "--mode", "colocated", "--model", str(tmp_path), "--sliding-window", "300", "--port", "0"])
    assert rc == 2
    assert "sliding window 300 is larger than the context length 256" in capsys.readouterr().err
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "t3 t4", "--max-tokens", "2", "--max-model-len", "4"])
    assert rc == 2
    assert "raise --max-model-len to at least 8" in capsys.readouterr().err
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "t3 t4", "--max-tokens", "2", "--layer-types", "full"])
    assert rc == 2
    assert "--layer-types lists 1 layers but the model has 3" in capsys.readouterr().err
