"""GGUF reading shared by the model loaders (``engine.loader``, ``engine.gguf_gemma3``) and the
tokenizer: open a file with a clear error, read metadata, dequantize one tensor, map tensor names.
Imports no other loader, so every GGUF reader can depend on it."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

_MISSING = object()


def progress(items: Iterable[Any], desc: str, total: int | None = None) -> Iterator[Any]:
    """Wrap ``items`` in a tqdm bar on stderr."""
    return iter(tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False))


def open_gguf(path: Path):
    """Open ``path`` with ``engine.gguf_fast_reader.FastGGUF`` (metadata and tensor views in well
    under a second; ``gguf.GGUFReader`` took ~2-4 s per open of SmolLM2's file, and a worker opened
    it three times at start). Any parse failure becomes ``ValueError("not a valid GGUF file: ...")``."""
    from engine.gguf_fast_reader import FastGGUF

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"not a valid GGUF file: {path}: bad magic {magic!r} (expected b'GGUF')")
    try:
        return FastGGUF(path)
    except ValueError as exc:
        size = path.stat().st_size
        raise ValueError(f"not a valid GGUF file: {path}: truncated or corrupt ({size} bytes): {exc}") from exc


def gguf_meta(reader, key: str, default: Any = _MISSING) -> Any:
    """Value of GGUF metadata ``key`` of an ``open_gguf`` reader (arrays as lists); ValueError if
    required and absent."""
    value = reader.meta(key, None)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    return value


def f32(value: Any) -> float:
    """GGUF stores float32: return its shortest decimal (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def gguf_to_hf_name(gguf_name: str, layer_names: dict, global_names: dict) -> str | None:
    """HF name of a GGUF tensor through the two name tables, or None for tensors not in them."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in global_names:
        return f"{global_names[parts[0]]}.{parts[1]}"
    return None


def dequantize_tensor(t, path: Path) -> np.ndarray:
    """Dequantize one GGUF tensor to a writable float32 array of shape [out, in]."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape))
    try:
        return np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except Exception as exc:
        raise ValueError(f"not a valid GGUF file: {path}: cannot decode tensor {t.name}: {exc}") from exc
