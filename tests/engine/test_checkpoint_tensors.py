"""A HF checkpoint is read in its stored dtype, one tensor at a time (``engine.checkpoint_tensors``):
loading a bfloat16 checkpoint into a bfloat16 model makes no float32 copy of any weight, a float32
model gets the bfloat16 values exactly, int8 experts are quantized one expert at a time, and a
corrupt shard is refused naming its file."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from engine import moe
from engine.loader import load_model_weights, read_model_config
from engine.model import LlamaModel
from tests.support.hf_folders import QWEN3_MOE, save_small_model

CPU = torch.device("cpu")


class Float32Outputs(TorchDispatchMode):
    """While active, records the element count of every float32 tensor an aten op returns (``sizes``):
    a conversion (``.float()``, ``.to(torch.float32)``), a float32 allocation, float32 arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [
            t.numel()
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype == torch.float32
        ]
        return out


def _bf16_folder(folder, kind: str, **fields):
    """A small ``kind`` model saved to ``folder`` as a bfloat16 checkpoint."""
    save_small_model(kind, folder, **fields).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _load(folder, dtype: torch.dtype) -> tuple[LlamaModel, Float32Outputs]:
    """``(model, float32 outputs seen)``: the checkpoint read and built in ``dtype``, the tensors read
    under :class:`Float32Outputs` (the kernels' warm-up and the decode stack, which read no
    checkpoint, left out)."""
    model = LlamaModel(read_model_config(folder), CPU, dtype)
    model.warm_up = lambda: None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("engine.model.DecodeStack.build", lambda m: None)
        with Float32Outputs() as seen:
            _, weights = load_model_weights(folder)
            model.load_weights(weights)
    return model, seen


@pytest.mark.parametrize(
    "kind, fields", [("llama", {"tie_word_embeddings": True}), ("qwen3_moe", QWEN3_MOE)], ids=["llama", "qwen3_moe"]
)
def test_a_bf16_checkpoint_loads_into_bf16_without_a_float32_copy(tmp_path, kind, fields):
    """No op of the load returns a float32 tensor as large as the smallest weight matrix: a loader
    that read the checkpoint as float32 (or a getter that widened a weight) fails here."""
    folder = _bf16_folder(tmp_path, kind, **fields)
    model, seen = _load(folder, torch.bfloat16)
    _, weights = load_model_weights(folder)
    smallest = min(math.prod(weights.shape(n)) for n in weights if len(weights.shape(n)) == 2)
    assert max(seen.sizes, default=0) < smallest
    assert model.embed.dtype == torch.bfloat16 and torch.equal(model.embed, weights["model.embed_tokens.weight"])
    assert torch.equal(model.norm, weights["model.norm.weight"])


def test_the_check_sees_a_float32_copy(tmp_path, monkeypatch):
    """The measure above is not vacuous: reading the checkpoint as float32 (the old loader) trips it."""
    from engine.checkpoint_tensors import StoredTensor

    folder = _bf16_folder(tmp_path, "llama")
    read = StoredTensor.read
    monkeypatch.setattr(StoredTensor, "read", lambda self: read(self).to(torch.float32))
    _, seen = _load(folder, torch.bfloat16)
    assert max(seen.sizes) == 128 * 64  # the embedding, widened


def test_a_bf16_checkpoint_served_in_float32_is_exact(tmp_path):
    folder = _bf16_folder(tmp_path, "llama")
    model, _ = _load(folder, torch.float32)
    _, weights = load_model_weights(folder)
    assert model.embed.dtype == torch.float32
    assert torch.equal(model.embed, weights["model.embed_tokens.weight"].float())
    assert torch.equal(
        model.layers[1].w["post_norm"], weights["model.layers.1.post_attention_layernorm.weight"].float()
    )


def test_int8_experts_are_quantized_one_expert_at_a_time():
    """The float32 math of ``quantize_rows`` holds one expert's weights, and its result is the
    whole-tensor formula's, bit for bit."""
    t = (torch.randn(8, 64, 32, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    t[3, 5] = 0  # an all-zero row: scale 1
    with Float32Outputs() as seen:
        q, scale = moe.quantize_rows(t)
    assert max(seen.sizes) <= 64 * 32
    absmax = t.float().abs().amax(dim=-1)
    want_scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    assert torch.equal(scale, want_scale) and scale[3, 5] == 1
    assert torch.equal(q, torch.round(t.float() / want_scale[..., None]).clamp(-127, 127).to(torch.int8))


def test_a_truncated_or_corrupt_shard_is_refused_naming_it(tmp_path):
    folder = _bf16_folder(tmp_path, "llama")
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # the last tensor's bytes cut: its range lies outside the file
    with pytest.raises(ValueError, match=r"not a valid safetensors file: .*model\.safetensors: .* lies outside"):
        load_model_weights(folder)
    shard.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match=r"not a valid safetensors file: .*bad header length"):
        read_model_config(folder)


def test_a_tensor_is_read_whole_across_short_reads():
    """One ``read`` returns at most ~2 GiB on Linux: a tensor larger than that comes in pieces."""
    import io

    from engine.checkpoint_tensors import _read_into

    class Trickle(io.BytesIO):
        def readinto(self, b):
            return super().readinto(memoryview(b)[:5])

    buf = bytearray(23)
    assert _read_into(Trickle(bytes(range(23))), memoryview(buf)) == 23 and bytes(buf) == bytes(range(23))
    assert _read_into(Trickle(b"abc"), memoryview(bytearray(8))) == 3
