"""The wheel holds the product only: the serving packages and ``pdserve bench`` with its harnesses,
never the tests, the one-off studies under ``benchmarks/`` or the tooling under ``tools/``."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("server/", "prefill_worker/", "decode_worker/", "transfer/", "cache/", "engine/", "configs/", "bench/")


def _wheel_files(tmp_path: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path),
        str(ROOT),
    ]
    subprocess.run(cmd, check=True, cwd=tmp_path, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_the_wheel_holds_the_product_and_nothing_else(tmp_path):
    names = _wheel_files(tmp_path)
    code = [n for n in names if ".dist-info/" not in n]
    strays = [n for n in code if not n.startswith(PRODUCT)]
    assert strays == [], f"files outside the product packages in the wheel: {strays[:10]}"
    assert not [n for n in code if "/tests/" in n or Path(n).name.startswith(("test_", "conftest"))]
    for needed in ("server/launch/cli.py", "bench/cli.py", "bench/harness/subprocess_server.py"):
        assert needed in code, f"{needed} missing from the wheel"


def _bench_imports(path: Path) -> set[str]:
    """``bench`` modules a file imports, statically or by a dotted name in a string (importlib)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return {n for n in found if n == "bench" or n.startswith("bench.")}


def _module_path(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def test_every_bench_module_is_reached_by_pdserve_bench():
    """A module under ``bench/`` that ``pdserve bench`` never reaches is a study: it belongs in
    ``benchmarks/``, outside the wheel."""
    seen, todo = set(), ["bench.cli", "bench.__main__"]
    while todo:
        name = todo.pop()
        path = _module_path(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run too
        todo += sorted(_bench_imports(path))
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "bench").rglob("*.py")}
    unreached = sorted(n for n in files if n.removesuffix(".__init__") not in seen)
    assert unreached == [], f"bench modules no `pdserve bench` command reaches: {unreached}"
