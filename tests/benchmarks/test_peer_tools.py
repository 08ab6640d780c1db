"""The peer-comparison helpers: the MoE folder both servers load (pdserve's loader serves it with the
tokenizer it was given, transformers' tokenizer reads it too) and the ratios across a sitting's JSON
files (a repeated target stays a separate measurement)."""

from __future__ import annotations

import json

import pytest

from benchmarks.peer_moe_folder import build
from benchmarks.peer_ratios import load_runs, ratio_rows, render
from transfer.wire.sampling_params import SamplingParams

# a few parameters per tensor: the folder's layout is what is checked, not the model
TINY = {
    "qwen3_moe": {"hidden": 64, "layers": 2, "experts": 4, "top_k": 2, "expert_size": 32},
    "mixtral": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 32,
    },
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, tokenizer):
    """The embedded model's tokenizer as an HF folder, with the config.json the builder reads (the
    special ids of benchmarks.hf_export's, unk_token_id too)."""
    folder = tokenizer.save_hf_folder(tmp_path_factory.mktemp("tok"))
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_ids[0], "unk_token_id": 0}
    (folder / "config.json").write_text(json.dumps({"vocab_size": tokenizer.vocab_size, **ids}))
    return folder


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_folder_serves_with_the_given_tokenizer(tmp_path, tokenizer_dir, tokenizer, arch):
    from transformers import AutoTokenizer

    from engine.llm import LLM
    from engine.loader import load_for_engine
    from engine.tokenizer import Tokenizer
    from tests.support.models import engine_cfg, sched_cfg

    folder = build(tmp_path / arch, arch, tokenizer_dir, TINY[arch])
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["vocab_size"] == tokenizer.vocab_size
    assert cfg["bos_token_id"] == tokenizer.bos_token_id and cfg["eos_token_id"] == tokenizer.eos_token_ids[0]
    text = "Repeat the text above word for word."
    assert Tokenizer.from_path(folder).encode(text) == tokenizer.encode(text)
    assert AutoTokenizer.from_pretrained(str(folder)).encode(text, add_special_tokens=False) == tokenizer.encode(text)

    ecfg = engine_cfg(dtype="float32", model=str(folder))
    model_cfg, weights = load_for_engine(folder, ecfg)
    assert model_cfg.moe is not None and model_cfg.moe.num_experts == TINY[arch].get("experts", 8)
    llm = LLM(ecfg, sched_cfg(), loaded=(model_cfg, weights, Tokenizer.from_path(folder)))
    out = llm.generate_ids([tokenizer.encode(text)], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and all(0 <= t < tokenizer.vocab_size for t in out[0].token_ids)


def _bench_json(path, *runs):
    """A ``bench serve --out`` file with ``(target, load, tok/s, failed)`` runs (plus one part of an
    interference run, which the ratios leave out)."""
    records = [
        {
            "target": t,
            "load": load,
            "kind": "all",
            "stats": {"output_throughput": tok, "failed": failed, "tpot": {"mean_ms": 1000 / tok}, "ttft": None},
        }
        for t, load, tok, failed in runs
    ]
    records.append({"target": runs[0][0], "load": "c=1", "kind": "short", "stats": {"output_throughput": 1.0}})
    path.write_text(json.dumps({"runs": records}))
    return path


def test_ratios_over_each_base_keep_repeats_apart(tmp_path):
    files = [
        _bench_json(tmp_path / "a.json", ("vllm-ngram", "c=1", 50.0, 0), ("vllm-ngram", "c=8", 200.0, 0)),
        _bench_json(tmp_path / "b.json", ("pd-ngram", "c=1", 80.0, 0), ("pd-ngram", "c=8", 150.0, 1)),
        _bench_json(tmp_path / "c.json", ("vllm-ngram", "c=1", 40.0, 0)),
    ]
    rows = load_runs(files)
    assert [(r["target"], r["load"]) for r in rows] == [
        ("vllm-ngram", "c=1"),
        ("vllm-ngram", "c=8"),
        ("pd-ngram", "c=1"),
        ("pd-ngram", "c=8"),
        ("vllm-ngram#2", "c=1"),
    ]
    ratios = {(t, load): x for t, load, x in ratio_rows(rows, "vllm-ngram")}
    assert ratios[("pd-ngram", "c=1")] == pytest.approx(1.6) and ratios[("pd-ngram", "c=8")] == pytest.approx(0.75)
    assert ratios[("vllm-ngram#2", "c=1")] == pytest.approx(0.8)
    # a base that did not run the level gives no ratio there
    assert dict(((t, load), x) for t, load, x in ratio_rows(rows, "vllm-ngram#2"))[("pd-ngram", "c=8")] is None
    table = render(rows, ["vllm-ngram"])
    assert "| pd-ngram | c=1 | 1.60x |" in table and "| pd-ngram | c=8 | 150.0 | 7 | - | 1 |" in table
