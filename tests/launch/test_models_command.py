"""``pdserve models`` lists what the loader accepts, computed from the loader's own tables: every
architecture it loads appears (and one added to the tables appears with nothing else edited), each
with the tests that check it against transformers, and nothing the loader refuses is listed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import hf_fields
from engine.config import MODEL_ARCHS, SUPPORTED_ARCHS
from engine.loader import _check_arch
from engine.supported_models import CHECKED_BY, supported_models
from server.launch.cli import main

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def _listed(capsys) -> list[str]:
    assert main(["models", "--json"]) == 0
    return [m["arch"] for m in json.loads(capsys.readouterr().out)["models"]]


def test_lists_every_architecture_the_loader_accepts_and_nothing_else(capsys):
    listed = _listed(capsys)
    assert sorted(listed) == sorted(MODEL_ARCHS)
    assert set(hf_fields.IMPLEMENTED) == set(SUPPORTED_ARCHS)  # the HF table is the loader's arch list
    for arch in SUPPORTED_ARCHS:
        assert _check_arch(arch) == arch
    for refused in ("cohere2", "starcoder2", "olmo3"):
        assert refused not in listed
        with pytest.raises(ValueError, match=refused):
            _check_arch(refused)


def test_text_names_formats_rope_types_traits_and_refusals(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    blocks = {b.split("\n")[0]: b for b in out.split("\n\n")}
    assert set(MODEL_ARCHS) <= set(blocks)
    assert "formats:    HF folder, GGUF" in blocks["qwen2"] and "q/k/v bias" in blocks["qwen2"]
    assert "Q/K RMSNorm" in blocks["qwen3"] and "q/k/v bias" not in blocks["qwen3"]
    assert "formats:    HF folder\n" in blocks["qwen2_moe"] and "q/k/v bias" in blocks["qwen2_moe"]
    assert "shared expert" in blocks["qwen2_moe"]
    assert "llama3, yarn, longrope" in blocks["llama"] and "sliding:    none" in blocks["llama"]
    assert "use_sliding_window" in blocks["qwen3"] and "formats:    GGUF\n" in blocks["gemma3"]
    assert "hidden_act: 'silu' or 'swish'" in blocks["mistral"]
    assert "formats:    HF folder\n" in blocks["phi3"] and "partial rotary" in blocks["phi3"]
    assert "partial_rotary_factor" not in blocks["phi3"].split("restricted:", 1)[-1]
    assert "soft-capping" in blocks["gemma2"] and "alternating, sliding first" in blocks["gemma2"]
    assert "Q/K RMSNorm" in blocks["gemma3_text"] and "rope_local_base_freq" in blocks["gemma3_text"]
    assert "refused at load:" in out and "cohere2" in out.split("refused at load:")[1]


def test_an_architecture_added_to_the_table_appears(capsys, monkeypatch):
    monkeypatch.setitem(hf_fields.IMPLEMENTED, "newarch", hf_fields.IMPLEMENTED["llama"] | {"sliding_window"})
    monkeypatch.setitem(hf_fields.ALLOWED_VALUES, "sliding_window", (None, 4096))
    monkeypatch.setattr(hf_fields, "QK_NORM_ARCHS", hf_fields.QK_NORM_ARCHS | {"newarch"})
    monkeypatch.setattr("engine.supported_models.QK_NORM_ARCHS", hf_fields.QK_NORM_ARCHS)
    assert "newarch" in _listed(capsys)
    (row,) = [m for m in supported_models() if m.arch == "newarch"]
    assert row.formats == ("HF folder", "GGUF") and row.attention == "Q/K RMSNorm"
    assert row.sliding.startswith("HF: sliding_window;") and "sliding_window: None or 4096" in row.restricted
    assert row.checked_by == ()  # no test named for it: the coverage test below would fail


def test_every_architecture_names_tests_that_exist():
    for m in supported_models():
        assert m.checked_by, f"{m.arch}: no test checks it against transformers (engine.supported_models.CHECKED_BY)"
        for path in m.checked_by:
            assert (ROOT / path).is_file(), path
    assert set(CHECKED_BY) == {m.arch for m in supported_models()}
