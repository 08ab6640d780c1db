"""Results files (``bench/results.py``): what a benchmark writes with ``--results-dir``, read back
and validated; the newest file of a name is current; the engine, roofline and serve figures become
tables of named columns."""

from __future__ import annotations

import json
import re
from datetime import datetime

import pytest
from pydantic import ValidationError

from bench import results as res
from bench.harness.subprocess_server import free_port
from bench.results import Machine, Results, Table
from bench.roofline import Roof

CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\nflags\t: fpu\n"


def _results(name: str = "serve", date: str = "2026-12-05T11:48:00Z", value: float = 1.0) -> Results:
    return Results(
        name=name,
        benchmark="pdserve bench serve",
        title="Serving",
        commit=None,
        date=date,
        machine=Machine(cpu="AMD EPYC", flags=["avx512_bf16"], cores=2),
        command="pdserve bench serve --concurrency 1",
        tables=[Table(title="runs", columns=["target", "output tok/s"], rows=[["colocated", value]])],
    )


def test_a_written_file_reads_back_equal_with_every_field(tmp_path):
    table = Table(title="decode", columns=["batch", "tok/s"], rows=[[1, 84.2], [8, None]])
    r = res.new_results("engine", "pdserve bench engine", "Engine", "pdserve bench engine", [table], 35.24)
    path = res.write(r, tmp_path / "results")
    assert re.fullmatch(r"engine-\d{8}T\d{6}Z\.json", path.name)
    assert res.load(path) == r
    raw = json.loads(path.read_text())
    assert raw["version"] == 1 and raw["tables"][0]["rows"] == [[1, 84.2], [8, None]]
    assert datetime.fromisoformat(raw["date"].replace("Z", "+00:00")).utcoffset().total_seconds() == 0
    assert raw["machine"]["read_bandwidth_gbs"] == 35.2
    assert set(raw["machine"]["flags"]) <= set(res.ISA_FLAGS) and raw["machine"]["cores"] >= 1
    assert raw["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", raw["commit"])


def test_a_row_with_the_wrong_number_of_cells_is_refused():
    with pytest.raises(ValidationError, match="rows \\[1\\]"):
        Table(title="t", columns=["a", "b"], rows=[[1, 2], [3]])
    with pytest.raises(ValidationError):
        Results.model_validate({**_results().model_dump(), "version": 2})


def test_the_newest_file_of_each_name_is_current(tmp_path):
    for r in (
        _results("serve", "2026-12-04T10:00:00Z", 1.0),
        _results("serve", "2026-12-05T10:00:00Z", 2.0),
        _results("llama-cpp", "2026-12-01T10:00:00Z", 3.0),
    ):
        res.write(r, tmp_path)
    now = res.current(tmp_path)
    assert [(r.name, r.tables[0].rows[0][1]) for r in now] == [("llama-cpp", 3.0), ("serve", 2.0)]


def test_machine_fields_from_cpuinfo_and_git(tmp_path):
    assert res.cpu_model(CPUINFO) == "AMD EPYC 9R14 96-Core Processor"
    assert res.cpu_model("processor : 0\n") is None
    assert res.git_commit(tmp_path) is None  # not a checkout
    assert res.command_line(["serve", "--server-args", "--mode pd"]) == "pdserve bench serve --server-args '--mode pd'"


def test_engine_and_roofline_figures_become_tables():
    from bench.engine_bench import engine_tables
    from bench.roofline import CLASSES
    from bench.roofline_report import roofline_tables

    seconds = {**dict.fromkeys(CLASSES, 0.0), "matmuls": 0.006, "attention": 0.002}
    figures = {"decode_b1": 84.23, "decode_b1_hf": 40.0, "decode_b1_ratio": 2.1058, "prefill": 900.04}
    decode, prefill = engine_tables(figures, [1], 512)
    assert decode.rows == [[1, 84.2, 40.0, 2.11]] and prefill.rows == [[512, 900.0, None, None]]
    out = {
        "decode": [{"dtype": "bfloat16", "batch": 8, "context": 80, "bytes": 271e6, "roof": Roof(0.0078, 0.0156)}],
        "prefill": [
            {"dtype": "bfloat16", "tokens": 512, "flops": 117.8e9, "peak": 930e9, "roof": Roof(0.1267, 0.1629)}
        ],
        "breakdown": [{"dtype": "bfloat16", "batch": 1, "wall": 0.01, "seconds": seconds}],
    }
    d, p, b = roofline_tables(out)
    assert d.rows == [["bfloat16", 8, 80, 271.0, 7.8, 15.6, 512.8, 0.5]]
    assert p.rows[0][-1] == 0.78 and b.columns[3:] == list(CLASSES)
    assert dict(zip(b.columns, b.rows[0]))["matmuls"] == 75.0


def test_serve_writes_its_results_file_with_the_runs_it_made(tmp_path):
    from bench.cli import main

    argv = ["serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--served-model-name", "m"]
    argv += ["--tokenizer", "words", "--num-prompts", "2", "--concurrency", "2", "--warmup", "0", "--no-progress"]
    assert main([*argv, "--results-dir", str(tmp_path)]) == 1  # nothing listens: every request fails
    (path,) = tmp_path.glob("serve-*.json")
    r = res.load(path)
    assert r.benchmark == "pdserve bench serve" and r.command == "pdserve bench " + " ".join(
        argv + ["--results-dir", str(tmp_path)]
    )
    runs = dict(zip(r.tables[0].columns, r.tables[0].rows[0]))
    assert (runs["target"], runs["load"], runs["ok"], runs["failed"]) == ("server", "c=2", 0, 2)
    assert runs["TTFT mean ms"] is None
    assert "prompts of 128-128 tokens" in r.notes[0]
