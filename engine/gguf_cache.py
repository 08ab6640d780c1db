"""Dequantized GGUF weights kept on disk, so a model's second load reads float32 instead of decoding.

Why: decoding a quantized GGUF (``gguf.quants.dequantize``, numpy) is most of a worker's load, paid again
by every worker of a launch and by every restart of a worker after a failure, while reading the same
float32 tensors from a safetensors file takes a fraction of it: ``python -m benchmarks.gguf_load``
printed 1.57 s of CPU decoded against 0.31 s read from the cache for SmolLM2-135M's Q4_1 file, and
4.60 s against 0.98 s for Gemma 3 270M's Q4_K_M (``--model gemma3-270m``), on a 2-core AVX2 host.

Contract:
- ``cached_tensors(path, tag, build)`` returns ``build()``'s tensors (float32 CPU, name -> tensor),
  from the cache when an entry for this file's content and ``tag`` is there, else from ``build()``,
  then stored. The entry's key hashes the file's bytes, so a copy of the same file elsewhere hits and
  an edited file misses; ``tag`` names what ``build`` does to the decoded tensors (a loader's renames,
  permutations, offsets), so two loaders never share an entry.
- Tensors that share storage (tied embeddings) come back sharing it, as ``build`` gave them.
- The cache is ``$PDSERVE_WEIGHTS_CACHE`` (default ``~/.cache/pdserve/weights``); ``off`` disables it.
  Entries are written whole (a temporary file renamed into place), so concurrent workers loading the
  same file never read half an entry. Past ``MAX_BYTES`` the least recently used entries are removed.
- A cache that cannot be written (read-only, full) or an entry that cannot be read (corrupt) is logged
  and skipped: the load itself never fails because of the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "PDSERVE_WEIGHTS_CACHE"
FORMAT = 1  # bump when an entry's layout changes: older entries are then never read
MAX_BYTES = 8 << 30
_HASH_CHUNK = 16 << 20
_ALIASES = "pdserve.aliases"

Tensors = dict[str, torch.Tensor]


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


def cached_tensors(path: Path, tag: str, build: Callable[[], Tensors]) -> Tensors:
    """``build()``'s tensors for GGUF file ``path``, read from the cache when it holds them (module docstring)."""
    folder = cache_dir()
    if folder is None:
        return build()
    entry = entry_path(folder, path, tag)
    tensors = _read(entry)
    if tensors is not None:
        return tensors
    tensors = build()
    _write(folder, entry, tensors, path)
    return tensors


def _read(entry: Path) -> Tensors | None:
    """The entry's tensors with their shared storage restored, or None (absent or unreadable)."""
    if not entry.exists():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(entry), framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get(_ALIASES, "{}"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        for name, target in aliases.items():
            tensors[name] = tensors[target]
    except Exception as exc:  # noqa: BLE001 - any unreadable entry is decoded again
        log.warning("weights cache: cannot read %s (%s): decoding the GGUF instead", entry, exc)
        return None
    try:
        os.utime(entry)  # its last use, for the eviction order
    except OSError:
        pass  # evicted by another process since: the tensors are in memory already
    return tensors


def _write(folder: Path, entry: Path, tensors: Tensors, source: Path) -> None:
    """Store ``tensors`` as ``entry`` (shared storage saved once), then evict past ``MAX_BYTES``."""
    from safetensors.torch import save_file

    unique, aliases, seen = {}, {}, {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key], unique[name] = name, t.contiguous()
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(unique, str(tmp), metadata={_ALIASES: json.dumps(aliases)})
        os.replace(tmp, entry)
    except Exception as exc:  # noqa: BLE001 - an OSError or safetensors' own error: the load goes on
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        log.warning("weights cache: cannot write %s (%s): the next load decodes the GGUF again", entry, exc)
        return
    size = entry.stat().st_size
    log.info(
        "weights cache: %s decoded once into %s (%.0f MiB); later loads read it (%s=off disables)",
        source.name,
        entry,
        size / 2**20,
        ENV,
    )
    evict(folder, MAX_BYTES)


def evict(folder: Path, max_bytes: int) -> list[Path]:
    """Remove the least recently used entries of ``folder`` until they hold at most ``max_bytes``; the
    removed paths."""
    stats = []
    for p in folder.glob("*.safetensors"):
        try:
            stats.append((p.stat(), p))
        except OSError:
            continue  # removed by another process meanwhile
    kept, removed = 0, []
    for st, p in sorted(stats, key=lambda sp: sp[0].st_mtime, reverse=True):
        kept += st.st_size
        if kept > max_bytes:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed
