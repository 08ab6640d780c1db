"""Results files: one JSON file per benchmark run, the figures with what produced them.

A file holds the benchmark, the commit, the UTC date, the machine (CPU model, the ISA flags that
decide which kernels run, cores, the read bandwidth where the run measured it), the exact command
and the figures as tables of named columns. ``benchmarks/render.py`` renders the README's table,
``docs/benchmarks.md`` and a plot from the files under ``benchmarks/results/``; among files of one
``name`` the newest is current. ``version`` changes when a field changes meaning.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from engine.cpu_features import cpu_flags

VERSION = 1
# the flags that pick the engine's kernels and dtypes (bfloat16 needs AVX512_BF16 or AMX)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
Cell = str | int | float | None


class Machine(BaseModel):
    """Where the figures were measured."""

    cpu: str | None = Field(None, description="CPU model name (/proc/cpuinfo)")
    flags: list[str] = Field(default_factory=list, description="the ISA flags of ISA_FLAGS the CPU has")
    cores: int | None = Field(None, description="CPUs this process could run on")
    read_bandwidth_gbs: float | None = Field(None, description="measured read bandwidth, GB/s (None: not measured)")


class Table(BaseModel):
    """One table of figures: a title, named columns and rows of cells (numbers where measured)."""

    title: str
    columns: list[str]
    rows: list[list[Cell]]

    @model_validator(mode="after")
    def _rows_fit(self) -> Table:
        bad = [i for i, r in enumerate(self.rows) if len(r) != len(self.columns)]
        if bad:
            raise ValueError(f"table {self.title!r}: rows {bad} do not have {len(self.columns)} cells")
        return self


class Results(BaseModel):
    """One benchmark run's results file."""

    version: Literal[1] = VERSION
    name: str = Field(description="series id: the newest file of a name is current (also the file name's stem)")
    benchmark: str = Field(description="what ran, e.g. 'pdserve bench serve'")
    title: str = Field(description="heading of the rendered tables")
    commit: str | None = Field(description="git commit of the code measured (None: unknown)")
    date: str = Field(description="UTC, ISO 8601")
    machine: Machine
    command: str = Field(description="the exact command that produced the figures")
    tables: list[Table]
    notes: list[str] = Field(default_factory=list, description="the conditions a reader needs (peers, load)")


def git_commit(where: Path | None = None) -> str | None:
    """``git rev-parse HEAD`` of the checkout holding ``where`` (this package by default); None outside git."""
    where = where or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def cpu_model(cpuinfo: str | None = None) -> str | None:
    """The ``model name`` of ``/proc/cpuinfo`` (None when unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def this_machine(read_bandwidth_gbs: float | None = None) -> Machine:
    """This host: CPU model, ISA flags, usable cores and ``read_bandwidth_gbs`` if the run measured it."""
    flags = cpu_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    bw = None if read_bandwidth_gbs is None else round(read_bandwidth_gbs, 1)
    return Machine(cpu=cpu_model(), flags=[f for f in ISA_FLAGS if f in flags], cores=cores, read_bandwidth_gbs=bw)


def utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def command_line(argv: list[str], prog: str = "pdserve bench") -> str:
    """The command as typed: ``prog`` and ``argv`` quoted for a shell."""
    return " ".join([prog, shlex.join(argv)]) if argv else prog


def new_results(
    name: str,
    benchmark: str,
    title: str,
    command: str,
    tables: list[Table],
    read_bandwidth_gbs: float | None = None,
    notes: list[str] | None = None,
) -> Results:
    """A results record of a run that just finished on this machine, at this commit."""
    return Results(
        name=name,
        benchmark=benchmark,
        title=title,
        commit=git_commit(),
        date=utc_now(),
        machine=this_machine(read_bandwidth_gbs),
        command=command,
        tables=tables,
        notes=notes or [],
    )


def file_name(r: Results) -> str:
    """``NAME-YYYYMMDDTHHMMSSZ.json``: sorted by name, then date."""
    stamp = r.date.replace("-", "").replace(":", "")
    return f"{r.name}-{stamp}.json"


def write(r: Results, directory: str | Path) -> Path:
    """Write ``r`` under ``directory`` (created if missing); returns the file's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / file_name(r)
    path.write_text(dumps(r.model_dump()) + "\n")
    return path


def dumps(x, depth: int = 0) -> str:
    """Indented JSON with each list of plain values (a table row, the columns) on one line."""
    pad = "  " * (depth + 1)
    if isinstance(x, dict) and x:
        items = [f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
    if isinstance(x, list) and any(isinstance(v, (dict, list)) for v in x):
        return "[\n" + ",\n".join(pad + dumps(v, depth + 1) for v in x) + "\n" + "  " * depth + "]"
    return json.dumps(x)


def load(path: str | Path) -> Results:
    """A results file, validated (``pydantic.ValidationError`` names what is wrong)."""
    return Results.model_validate_json(Path(path).read_text())


def current(directory: str | Path) -> list[Results]:
    """The newest file of each name under ``directory``, sorted by name."""
    newest: dict[str, Results] = {}
    for path in sorted(Path(directory).glob("*.json")):
        r = load(path)
        if r.name not in newest or r.date > newest[r.name].date:
            newest[r.name] = r
    return [newest[n] for n in sorted(newest)]


def write_if_asked(directory: str | None, r: Results) -> Path | None:
    """Write ``r`` under ``directory`` and say where; nothing when ``directory`` is None."""
    if not directory:
        return None
    path = write(r, directory)
    print(f"results file: {path}")
    return path
