"""``bench serve``'s CPU accounting (``bench/serve/cpu.py``): /proc stat parsing (a command name with
spaces and parentheses), worker names from command lines, the per-token and per-100-tok/s arithmetic,
the meter over this process, and the printed table. The real run in test_serve_bench.py checks the
fields against a launched server."""

from __future__ import annotations

import os
import time

import pytest

from bench.serve.cpu import (
    ROUTER,
    CpuMeter,
    cpu_fields,
    router_goal_line,
    router_pct_per_100_tok_s,
    server_processes,
    stat_cpu_seconds,
    stat_ppid,
    worker_name,
)
from bench.serve.report import RunRecord, cpu_table
from bench.serve.stats import RunStats

# pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
_STAT = "4242 (py (x) 2) S 17 4242 4242 0 -1 4194560 900 0 0 0 250 50 3 1 20 0 4 0 123 456 789"


def test_stat_line_with_spaces_and_parentheses_in_the_command_name():
    assert stat_cpu_seconds(_STAT, tick=100) == pytest.approx(3.0)  # (250 + 50) / 100
    assert stat_cpu_seconds(_STAT, tick=50) == pytest.approx(6.0)
    assert stat_ppid(_STAT) == 17


def test_worker_names_come_from_the_worker_command_line():
    argv = [
        "/venv/bin/python",
        "-m",
        "server.worker.main",
        "--role",
        "decode",
        "--worker-id",
        "decode-0",
        "--listen-fd",
        "5",
    ]
    assert worker_name(argv) == "decode-0"
    assert worker_name(["python", "-m", "server.launch.cli", "launch", "--mode", "pd"]) is None
    assert worker_name(["python", "-m", "server.worker.main", "--worker-id"]) is None


def test_per_token_and_per_100_tok_s_arithmetic():
    # 20 s wall, 2000 output tokens = 100 tok/s; router 2 CPU s = 10% of one core -> 10% per 100 tok/s
    f = cpu_fields({ROUTER: 2.0, "colocated-0": 30.0}, wall_s=20.0, output_tokens=2000)
    assert f["cpu_s"] == {ROUTER: 2.0, "colocated-0": 30.0} and f["cpu_wall_s"] == 20.0
    assert f["cpu_s_per_output_token"] == pytest.approx({ROUTER: 0.001, "colocated-0": 0.015})
    assert f["router_core_pct_per_100_tok_s"] == pytest.approx(10.0)
    # 4x the throughput at the same router CPU share: a quarter of the cost per 100 tok/s
    assert router_pct_per_100_tok_s(2.0, 20.0, 8000) == pytest.approx(2.5)
    assert router_pct_per_100_tok_s(2.0, 20.0, 0) is None and router_pct_per_100_tok_s(None, 20.0, 9) is None
    assert cpu_fields({ROUTER: 1.0}, 1.0, 0)["cpu_s_per_output_token"] == {ROUTER: None}
    unknown = cpu_fields(None, 0.0, 100)
    assert set(unknown) == set(f) and all(v is None for v in unknown.values())


def test_meter_reads_this_process():
    meter = CpuMeter(os.getpid())
    assert server_processes(os.getpid())[ROUTER] == os.getpid()
    meter.start()
    t_end = time.process_time() + 0.2
    while time.process_time() < t_end:
        pass
    meter.stop()
    assert meter.cpu_s[ROUTER] >= 0.1 and meter.wall_s >= meter.cpu_s[ROUTER] - 0.05


def _record(load: str, out_tokens: int, cpu_s: dict | None, wall_s: float = 10.0) -> RunRecord:
    s = RunStats(4, 4, 0, wall_s, 40, out_tokens, 0.4, out_tokens / wall_s, 0, None, None, None, None)
    return RunRecord("pd", load, 1, None, s, [], cpu_s=cpu_s, cpu_wall_s=wall_s)


def test_record_json_and_table():
    rec = _record("c=8", 1000, {ROUTER: 1.5, "prefill-0": 4.0, "decode-0": 6.0})
    d = rec.to_dict()
    assert d["cpu_s"]["decode-0"] == 6.0 and d["cpu_s_per_output_token"]["prefill-0"] == pytest.approx(0.004)
    assert d["router_core_pct_per_100_tok_s"] == pytest.approx(15.0)  # 15% of a core at 100 tok/s
    assert "cpu_wall_s" in d and "stats" in d
    table = cpu_table([rec, _record("c=1", 100, None)])
    assert "| c=8 | router | 1.50 | 1.50 | 15.0 |" in table
    assert "| c=8 | decode-0 | 6.00 | 6.00 | 60.0 |" in table and "c=1" not in table
    assert "15.0% of one core per 100 output tok/s (misses the < 10% goal)" in table
    assert cpu_table([_record("c=1", 100, None)]) == ""
    assert _record("c=1", 100, None).to_dict()["cpu_s"] is None
    assert "meets" in router_goal_line("c=1", 3.0) and "no figure" in router_goal_line("c=1", None)
