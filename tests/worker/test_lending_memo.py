"""Core lending's verdict remembered per machine and model (server.worker.main.core_lending with an
``engine.probe_memo.ProbeMemo``)."""

from __future__ import annotations

import argparse
import os
import time

import torch

import server.worker.main as wm
from engine.probe_memo import ProbeMemo
from server.worker.core_lending import CoreLedger
from tests.support.lending import FakeRunner as _Runner


def test_a_quiet_measurement_is_remembered_and_reused_without_probing_or_waiting(monkeypatch, tmp_path):
    """With a memo: the first start measures and (the host quiet) stores the timings; the next start
    of the same model takes the same verdict from it without a probe matmul and without waiting for a
    busy peer (a worker restarted beside serving ones). A probe another process competed with is used
    and not stored."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    memo = ProbeMemo(tmp_path / "probes.json")
    ledger, fd = CoreLedger.create(2)
    ledger.set_loaded(0)
    args = argparse.Namespace(core_ledger_fd=fd, core_slot=1, lend_threads=2, role="decode")
    try:
        monkeypatch.setattr(wm.QuietWindow, "quiet", lambda self, spare_cores=0: False)
        noisy = _Runner({1: 0.01, 2: 0.006})
        assert wm.core_lending(args, noisy, memo=memo).total == 2 and noisy.asked
        assert memo.get({"probe": "core_lending", "rows": 8, "threads": [1, 2], "model": "the-model"}) is None
        monkeypatch.setattr(wm.QuietWindow, "quiet", lambda self, spare_cores=0: True)
        first = _Runner({1: 0.01, 2: 0.006})
        assert wm.core_lending(args, first, memo=memo).total == 2 and first.asked
        ledger.set_busy(0, True)  # a serving peer: a probe would wait LENDING_QUIET_WAIT_S for it
        again = _Runner({1: 0.01, 2: 0.5})  # a probe now would say "only lends"
        t0 = time.monotonic()
        cores = wm.core_lending(args, again, memo=memo)
        assert time.monotonic() - t0 < wm.LENDING_QUIET_WAIT_S / 2
        assert again.asked == [] and cores.total == 2 and again.warmed == (1, 2)
    finally:
        os.close(fd)
