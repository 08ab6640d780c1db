"""``pdserve generate`` reads ``PDSERVE_<FIELD>`` variables as every other subcommand does, and its
flags win over them (settings precedence: preset < environment < flags)."""

from __future__ import annotations

from server.launch.cli import main


def test_generate_reads_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_DTYPE", "float64")  # not a dtype pdserve runs: refused before any load
    assert main(["generate", "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert "dtype" in capsys.readouterr().err
    monkeypatch.setenv("PDSERVE_DTYPE", "float32")
    monkeypatch.setenv("PDSERVE_MAX_RUNNING_REQUESTS", "0")  # a scheduler field, refused the same way
    assert main(["generate", "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert "max_running_requests" in capsys.readouterr().err


def test_generate_flags_win_over_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_DTYPE", "float64")
    rc = main(["generate", "--prompt", "hi", "--max-tokens", "1", "--dtype", "float32", "--kv-pool-tokens", "256"])
    assert rc == 0, capsys.readouterr().err
