"""The dequantized-weights cache (``engine.gguf_cache``): a GGUF's second load reads the cached float32
tensors bit for bit instead of decoding, each tensor is decoded once while the entry is written, and
the cache never fails a load."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine import gguf_cache, gguf_common, gguf_source, loader


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "weights"
    monkeypatch.setenv(gguf_cache.ENV, str(folder))
    return folder


@pytest.fixture
def decodes(monkeypatch):
    """How many tensors the loaders dequantize (the work the cache saves)."""
    calls = []
    real = gguf_common.dequantize_tensor

    def counting(t, path):
        calls.append(t.name)
        return real(t, path)

    monkeypatch.setattr(gguf_source, "dequantize_tensor", counting)
    return calls


def _gguf(tmp_path):
    """The embedded SmolLM2 GGUF."""
    from engine.model_paths import resolve_model_path

    return resolve_model_path("default")


def _load(path) -> tuple:
    """(config, every tensor read) of one load."""
    cfg, tensors = loader.load_model_weights(path)
    return cfg, dict(tensors)


def test_the_second_load_reads_the_cache_bit_for_bit(cache, decodes, tmp_path, monkeypatch):
    path = _gguf(tmp_path)
    cfg, first = _load(path)
    decoded = len(decodes)
    assert decoded > 0 and len(set(decodes)) == decoded  # each tensor decoded once, writing the entry
    assert len(list(cache.glob("*.safetensors"))) == 1
    cfg2, second = _load(path)
    assert len(decodes) == decoded  # nothing decoded again
    assert cfg2 == cfg and second.keys() == first.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert torch.equal(second["lm_head.weight"], second["model.embed_tokens.weight"])  # tied
    monkeypatch.setenv(gguf_cache.ENV, "off")
    _, decoded_now = _load(path)
    assert all(torch.equal(first[k], decoded_now[k]) for k in first)  # the entry holds what decoding gives


def test_a_copy_of_the_file_hits_and_off_disables(cache, decodes, tmp_path, monkeypatch):
    path = _gguf(tmp_path)
    _load(path)
    decoded = len(decodes)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    _load(copy)
    assert len(decodes) == decoded  # the key is the content, not the path
    monkeypatch.setenv(gguf_cache.ENV, "off")
    _load(copy)
    assert set(decodes[decoded:]) == set(decodes[:decoded])  # every tensor decoded again


def test_a_corrupt_entry_is_decoded_again_and_rewritten(cache, decodes, tmp_path):
    path = _gguf(tmp_path)
    _, first = _load(path)
    (entry,) = cache.glob("*.safetensors")
    entry.write_bytes(b"not a safetensors file")
    decoded = len(decodes)
    _, again = _load(path)
    assert set(decodes[decoded:]) == set(decodes[:decoded])  # every tensor decoded again
    assert torch.equal(again["model.norm.weight"], first["model.norm.weight"])
    assert entry.stat().st_size > 1 << 20  # rewritten whole


def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch, decodes):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_cache.ENV, str(blocker / "weights"))  # a folder under a file: mkdir fails
    _, tensors = _load(_gguf(tmp_path))
    assert "model.norm.weight" in tensors and decodes


def test_eviction_removes_the_least_recently_used_entries_past_the_bound(tmp_path):
    for i, name in enumerate(("old", "mid", "new")):
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(b"x" * 100)
        os.utime(p, (1000 + i, 1000 + i))
    assert gguf_cache.evict(tmp_path, 250, now=1000 + gguf_cache.IN_USE_S) == []  # all in use
    removed = gguf_cache.evict(tmp_path, 250, now=2000 + gguf_cache.IN_USE_S)
    assert [p.name for p in removed] == ["old.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid.safetensors", "new.safetensors"]
