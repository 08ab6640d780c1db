"""The project speaks of the product: no tracked file tells how it was built (a numbered work
session or tracker issue, a source document of the design, a dated lab entry). A measured fact names
its benchmark command or its results file under ``benchmarks/results/`` instead."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"\b(session|issue)s? [0-9]|\bissue-[0-9]|\bseed 0{2}", re.I)


def history_lines(paths: list[str]) -> list[str]:
    """``path:line: text`` of every line of ``paths`` (relative to the root) that tells history."""
    found = []
    for rel in paths:
        try:
            text = (ROOT / rel).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files (pictures) and paths of a moved file not yet committed
        found += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]
    return found


def test_no_tracked_file_tells_the_history_of_its_making():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert history_lines(files) == []


def test_the_check_finds_each_form(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    n, z = "1", "0"  # the forms are assembled here so that this file itself holds none of them
    (tmp_path / "a.py").write_text(f"x = 1  # as measured in session {n}2\n# Issue {n}: fixed\nok = 'sessions'\n")
    (tmp_path / "b.md").write_text(f"see the seed {z}{z}{n} document\nthe issue-{n}5 note\n")
    assert [h.split(":")[:2] for h in history_lines(["a.py", "b.md"])] == [
        ["a.py", "1"],
        ["a.py", "2"],
        ["b.md", "1"],
        ["b.md", "2"],
    ]
