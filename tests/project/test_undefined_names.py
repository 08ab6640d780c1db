"""Names used but never defined, in every package and benchmark: pyflakes finds them statically,
so a path no test runs (a benchmark part, an error branch) cannot keep a NameError until someone
runs it (a benchmark part that loses an import when its neighbour moves out fails nowhere else)."""

from __future__ import annotations

from pathlib import Path

import pytest

pyflakes_api = pytest.importorskip("pyflakes.api")
from pyflakes import messages  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "bench",
    "benchmarks",
    "cache",
    "configs",
    "decode_worker",
    "engine",
    "prefill_worker",
    "server",
    "transfer",
    "docker",
    "tests",
)
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, UNDEFINED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:  # noqa: N802 - pyflakes' name
        self.found.append(f"{filename}:{lineno}: syntax error: {msg}")

    def unexpectedError(self, filename, msg) -> None:  # noqa: N802
        self.found.append(f"{filename}: {msg}")


def _undefined(paths) -> list[str]:
    rep = _Collect()
    for path in paths:
        pyflakes_api.checkPath(str(path), rep)
    return rep.found


def test_no_module_uses_an_undefined_name():
    files = [p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 300
    assert _undefined(files) == []


def test_the_check_sees_a_missing_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def median(xs):\n    return statistics.median(xs)\n")
    assert ["undefined name 'statistics'" in f for f in _undefined([bad])] == [True]
