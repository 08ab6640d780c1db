"""Start-up measurements remembered per machine (engine/probe_memo.py): what is stored comes back under
the same key within the day and never after, nor under another key, nor from a torn or foreign file;
``QuietWindow`` sees another process's CPU time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from engine import probe_memo
from engine.probe_memo import TTL_S, ProbeMemo, QuietWindow, machine

KEY = {"probe": "core_lending", "rows": 8, "threads": [1, 2], "model": "abc"}


def test_a_stored_value_comes_back_within_the_day_and_not_after(tmp_path):
    memo = ProbeMemo(tmp_path / "probes.json")
    assert memo.get(KEY) is None
    memo.put(KEY, {"alone_s": 0.01, "shared_s": 0.006}, now=1000.0)
    found = memo.get(KEY, now=1000.0 + TTL_S - 1)
    assert found is not None and found.value == {"alone_s": 0.01, "shared_s": 0.006} and found.at == 1000.0
    assert memo.get(KEY, now=1000.0 + TTL_S + 1) is None
    assert memo.get({**KEY, "model": "other"}, now=1001.0) is None
    assert memo.get({**KEY, "threads": [1, 1]}, now=1001.0) is None


def test_entries_of_other_keys_are_kept_and_expired_ones_dropped(tmp_path):
    memo = ProbeMemo(tmp_path / "probes.json")
    memo.put(KEY, {"v": 1}, now=1000.0)
    memo.put({**KEY, "rows": 128}, {"v": 2}, now=1000.0 + TTL_S / 2)
    assert memo.get(KEY, now=1000.0 + TTL_S / 2).value == {"v": 1}
    memo.put({**KEY, "rows": 64}, {"v": 3}, now=1000.0 + TTL_S + 1)  # the first is past the day: dropped
    entries = json.loads((tmp_path / "probes.json").read_text())["entries"]
    assert sorted(e["value"]["v"] for e in entries.values()) == [2, 3]
    assert all(e["key"]["probe"] == "core_lending" for e in entries.values())


def test_off_a_torn_file_and_another_format_remember_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_PROBE_MEMO", "off")
    off = ProbeMemo.from_env()
    off.put(KEY, {"v": 1})
    assert off.path is None and off.get(KEY) is None
    path = tmp_path / "probes.json"
    monkeypatch.setenv("PDSERVE_PROBE_MEMO", str(path))
    memo = ProbeMemo.from_env()
    assert memo.path == path
    path.write_text('{"format": 1, "entries": {')
    assert memo.get(KEY) is None
    memo.put(KEY, {"v": 1})  # a torn file is replaced whole
    assert memo.get(KEY).value == {"v": 1}
    path.write_text(json.dumps({"format": 99, "entries": json.loads(path.read_text())["entries"]}))
    assert memo.get(KEY) is None


def test_a_failed_write_is_ignored(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    memo = ProbeMemo(blocker / "probes.json")  # its folder cannot be made: a file is in the way
    memo.put(KEY, {"v": 1})
    assert memo.get(KEY) is None


def test_the_machine_key_names_this_cpu_and_build():
    m = machine()
    assert m["cores"] >= 1 and m["torch"] and m["capability"] and m["flags"]


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_this_process_own_work_does_not_count_against_the_window(monkeypatch):
    """On a host where only this process runs (the host's busy time is its own), a window it spins
    in is quiet; the host's busy time from /proc/stat grows at least by what it spun."""
    host0 = probe_memo._host_busy_s()
    monkeypatch.setattr(probe_memo, "_host_busy_s", probe_memo._own_cpu_s)
    window = QuietWindow()
    spin(0.3)
    assert abs(window.others_cpu_s()) < 0.05 and window.quiet()
    monkeypatch.undo()
    assert probe_memo._host_busy_s() - host0 >= 0.25


@pytest.mark.process
def test_a_window_beside_a_busy_process_is_not_quiet():
    code = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.3)  # past its start-up
        window = QuietWindow()
        time.sleep(1.0)
        assert window.others_cpu_s() >= 0.5 and not window.quiet()
    finally:
        child.wait(10)


def test_others_work_on_cores_the_probe_left_unused_does_not_count(monkeypatch):
    """0.8 CPU s of other processes over a 1 s window: not quiet where the probe used every core,
    quiet where one core was left to them."""
    busy = [100.0]
    monkeypatch.setattr(probe_memo, "_host_busy_s", lambda: busy[0])
    monkeypatch.setattr(probe_memo, "_own_cpu_s", lambda: 5.0)
    clock = [10.0]
    monkeypatch.setattr(probe_memo.time, "monotonic", lambda: clock[0])
    window = QuietWindow()
    busy[0], clock[0] = 100.8, 11.0
    assert window.others_cpu_s() == pytest.approx(0.8)
    assert not window.quiet() and window.quiet(spare_cores=1)
