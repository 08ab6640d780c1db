"""Slow test phases named as they happen: a setup, call or teardown that takes ``SLOW_PHASE_S``
seconds or more (``PDSERVE_SLOW_PHASE_S``, default 60) is written to the terminal at once, with how
far into the run it ended. ``--durations`` lists the slowest only when the run ends; a run cut off by
a time limit (CI's) never gets there, and its progress dots do not say which test took the time.

Hooked into the session by tests/conftest.py (``pytest_runtest_makereport``)."""

from __future__ import annotations

import os
import time

SLOW_PHASE_S = float(os.environ.get("PDSERVE_SLOW_PHASE_S", "60"))
_STARTED = time.monotonic()


def slow_line(when: str, nodeid: str, duration_s: float, into_run_s: float, limit_s: float) -> str | None:
    """The line to print for a phase of ``duration_s`` that ended ``into_run_s`` after the run
    started, or None when it is under ``limit_s``."""
    if duration_s < limit_s:
        return None
    return f"[slow {when}] {nodeid}: {duration_s:.0f} s (ended {into_run_s:.0f} s into the run)"


def report(config, rep) -> None:
    """Write ``rep``'s phase to the terminal if it was slow (see ``slow_line``)."""
    line = slow_line(rep.when, rep.nodeid, rep.duration, time.monotonic() - _STARTED, SLOW_PHASE_S)
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if line is not None and terminal is not None:
        terminal.write_line("")
        terminal.write_line(line)
