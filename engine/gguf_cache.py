"""Dequantized GGUF weights kept on disk, so a model's second load reads float32 instead of decoding.

Why: decoding a quantized GGUF (``gguf.quants.dequantize``, numpy) is most of a worker's load, paid again
by every worker of a launch and by every restart of a worker after a failure, while reading the same
float32 tensors from a safetensors file takes a fraction of it: ``python -m benchmarks.gguf_load``
printed 0.86 s of CPU decoded against 0.40 s read from the cache for SmolLM2-135M's Q4_1 file, and
4.60 s against 0.98 s for Gemma 3 270M's Q4_K_M (``--model gemma3-270m``), on a 2-core AVX2 host.

Contract:
- ``cached_sources(path, tag, sources)``: the float32 tensors of GGUF file ``path`` as sources read on
  access (``engine.checkpoint_tensors``), over the cache entry for this file's content and ``tag``.
  On a miss the entry is written first, one tensor at a time (each source read once, so a load
  never holds the whole model beside the entry); where the cache is off or cannot be written,
  ``sources`` themselves. ``tag`` names what the sources do to the decoded tensors (a loader's renames,
  permutations, offsets), so two loaders never share an entry; the key hashes the file's bytes, so
  a copy of the same file elsewhere hits and an edited file misses.
- ``cached_tensors(path, tag, build)``: the same for a loader that builds a dict of float32 tensors:
  read whole from the entry, else ``build()``'s, then stored.
- The cache is ``$PDSERVE_WEIGHTS_CACHE`` (default ``~/.cache/pdserve/weights``); ``off`` disables it.
  Entries are written whole (a temporary file renamed into place), so concurrent workers loading the
  same file never read half an entry. Past ``MAX_BYTES`` the least recently used entries are removed,
  never one used in the last ``IN_USE_S``.
- A cache that cannot be written (read-only, full) or an entry that cannot be read (corrupt) is logged
  and skipped: the load itself never fails because of the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint_tensors import StoredTensor, TensorSource, shard_tensors

log = logging.getLogger(__name__)

ENV = "PDSERVE_WEIGHTS_CACHE"
FORMAT = 2  # bump when an entry's layout changes: older entries are then never read
MAX_BYTES = 8 << 30
IN_USE_S = 600.0  # an entry used this recently is never evicted: a worker may be reading it
_HASH_CHUNK = 16 << 20


def cache_dir() -> Path | None:
    """The cache folder, or None when ``$PDSERVE_WEIGHTS_CACHE`` is ``off``."""
    value = os.environ.get(ENV, "")
    if value.strip().lower() == "off":
        return None
    return Path(value) if value else Path.home() / ".cache" / "pdserve" / "weights"


def entry_path(folder: Path, path: Path, tag: str) -> Path:
    """Where the entry for ``path``'s content decoded by ``tag`` lives in ``folder``."""
    digest = hashlib.blake2b(f"{FORMAT}\0{tag}\0".encode(), digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return folder / f"{digest.hexdigest()}.safetensors"


@dataclass(frozen=True)
class _Ready:
    """A tensor already in memory, as a source."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def read(self) -> torch.Tensor:
        return self.tensor


def cached_sources(path: Path, tag: str, sources: Mapping[str, TensorSource]) -> Mapping[str, Any]:
    """``sources``' tensors as sources over the cache entry of GGUF file ``path`` (module docstring)."""
    folder = cache_dir()
    if folder is None:
        return sources
    entry = entry_path(folder, path, tag)
    stored = _stored(entry)
    if stored is None and _write(folder, entry, sources, path):
        stored = _stored(entry)
    return sources if stored is None else stored


def cached_tensors(path: Path, tag: str, build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``build()``'s float32 tensors for GGUF file ``path``, read from the cache when it holds them."""
    folder = cache_dir()
    if folder is None:
        return build()
    entry = entry_path(folder, path, tag)
    stored = _stored(entry)
    if stored is not None:
        return {name: source.read() for name, source in stored.items()}
    tensors = build()
    _write(folder, entry, {name: _Ready(t) for name, t in tensors.items()}, path)
    return tensors


def _stored(entry: Path) -> dict[str, StoredTensor] | None:
    """The entry's tensors as sources read on access, or None (absent or unreadable)."""
    if not entry.exists():
        return None
    try:
        stored = shard_tensors([entry])
    except (OSError, ValueError) as exc:
        log.warning("weights cache: cannot read %s (%s): decoding the GGUF instead", entry, exc)
        return None
    with contextlib.suppress(OSError):  # evicted by another process since: its file is open below anyway
        os.utime(entry)  # its last use, for the eviction order
    return stored


def _write(folder: Path, entry: Path, sources: Mapping[str, TensorSource], source: Path) -> bool:
    """Store ``sources`` as ``entry`` (a safetensors file of float32 tensors, each read once and
    written before the next is read), then evict past ``MAX_BYTES``; whether it was stored."""
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_safetensors(tmp, sources)
        os.replace(tmp, entry)
    except Exception as exc:  # noqa: BLE001 - an OSError or a source's own error: the load goes on
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        log.warning("weights cache: cannot write %s (%s): the next load decodes the GGUF again", entry, exc)
        return False
    log.info(
        "weights cache: %s decoded once into %s (%.0f MiB); later loads read it (%s=off disables)",
        source.name,
        entry,
        entry.stat().st_size / 2**20,
        ENV,
    )
    evict(folder, MAX_BYTES)
    return True


def _write_safetensors(out: Path, sources: Mapping[str, TensorSource]) -> None:
    """Write ``sources`` as a safetensors file of float32 tensors in their order, streaming: the header
    from the shapes alone, then each tensor's bytes as it is read."""
    header, offset = {}, 0
    for name, src in sources.items():
        nbytes = math.prod(src.shape) * 4
        header[name] = {"dtype": "F32", "shape": list(src.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    with open(out, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for name, src in sources.items():
            t = src.read()
            if t.dtype != torch.float32 or tuple(t.shape) != tuple(src.shape):
                raise ValueError(f"{name}: a {t.dtype} tensor of shape {tuple(t.shape)}, not float32 {src.shape}")
            f.write(t.contiguous().numpy().tobytes())


def evict(folder: Path, max_bytes: int, now: float | None = None) -> list[Path]:
    """Remove the least recently used entries of ``folder`` until they hold at most ``max_bytes``, never
    one used in the last ``IN_USE_S`` (a load may be reading it); the removed paths."""
    now = time.time() if now is None else now
    stats = []
    for p in folder.glob("*.safetensors"):
        try:
            stats.append((p.stat(), p))
        except OSError:
            continue  # removed by another process meanwhile
    kept, removed = 0, []
    for st, p in sorted(stats, key=lambda sp: sp[0].st_mtime, reverse=True):
        kept += st.st_size
        if kept > max_bytes and now - st.st_mtime > IN_USE_S:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed
