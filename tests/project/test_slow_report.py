"""The slow-phase line (tests/support/slow_report.py): printed at the limit and over, never under."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support import slow_report
from tests.support.slow_report import slow_line


def test_a_phase_at_or_over_the_limit_is_named_with_its_time():
    assert slow_line("call", "tests/x.py::t", 59.9, 100.0, limit_s=60) is None
    assert slow_line("setup", "tests/x.py::t", 60.0, 1234.4, limit_s=60) == (
        "[slow setup] tests/x.py::t: 60 s (ended 1234 s into the run)"
    )


def test_report_writes_the_line_to_the_terminal(monkeypatch):
    lines: list[str] = []
    terminal = SimpleNamespace(write_line=lines.append)
    config = SimpleNamespace(pluginmanager=SimpleNamespace(get_plugin=lambda name: terminal))
    monkeypatch.setattr(slow_report, "SLOW_PHASE_S", 5.0)
    slow_report.report(config, SimpleNamespace(when="call", nodeid="n", duration=7.0))
    slow_report.report(config, SimpleNamespace(when="call", nodeid="m", duration=1.0))
    assert lines[0] == "" and lines[1].startswith("[slow call] n: 7 s") and len(lines) == 2
