"""Render the results files (``benchmarks/results/*.json``, written by ``pdserve bench ...
--results-dir``) into the README's benchmark table, the results section of ``docs/benchmarks.md``
and a plot, so no figure is kept by hand.

``python benchmarks/render.py`` rewrites what lies between ``<!-- results:begin -->`` and
``<!-- results:end -->`` in both files (the README: the ``HEADLINE`` results, docs: every current
result, one section per results name) and writes ``docs/images/results.png``. ``--check`` writes
nothing and exits 1 when either file differs from what it would render (the plot is not checked: a
PNG is not byte-stable across matplotlib versions); 2 when a file lacks the markers or the
headline results are missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADLINE = "serve-vs-vllm-cpu"  # the results name the README shows


def _results_module():
    """``bench.results`` of this checkout (the script may run as ``python benchmarks/render.py``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import results

    return results


def _cell(v) -> str:
    return "-" if v is None else str(v).replace("|", "\\|")


def table_md(table) -> str:
    """A GitHub-Markdown table of a results table."""
    lines = ["| " + " | ".join(map(_cell, table.columns)) + " |", "|" + "---|" * len(table.columns)]
    return "\n".join(lines + ["| " + " | ".join(map(_cell, row)) + " |" for row in table.rows])


def machine_md(m) -> str:
    parts = [m.cpu or "unknown CPU", f"{m.cores} cores" if m.cores else None, ", ".join(m.flags) or None]
    if m.read_bandwidth_gbs is not None:
        parts.append(f"{m.read_bandwidth_gbs} GB/s read")
    return ", ".join(p for p in parts if p)


def provenance_md(r) -> str:
    """Date, commit, machine and command of one results file, as a Markdown paragraph."""
    commit = f"`{r.commit[:12]}`" if r.commit else "unknown"
    return f"{r.date[:10]}, commit {commit}, {machine_md(r.machine)}.\nCommand: `{r.command}`"


def readme_block(current: list) -> str:
    """The README's block: the headline results' tables, notes and where they come from."""
    head = next((r for r in current if r.name == HEADLINE), None)
    if head is None:
        _fail(f"no results file named {HEADLINE!r}")
    link = "Every current result and how to run each benchmark: [docs/benchmarks.md](docs/benchmarks.md)."
    return "\n\n".join([f"**{head.title}**", *_body(head), link])


def _body(r) -> list[str]:
    """Provenance, each table under its title, the notes: the Markdown paragraphs of one result."""
    out = [provenance_md(r)]
    for t in r.tables:
        out += [f"{t.title[0].upper()}{t.title[1:]}:", table_md(t)]
    return out + (["\n".join(f"- {n}" for n in r.notes)] if r.notes else [])


def docs_block(current: list) -> str:
    """``docs/benchmarks.md``'s block: the plot, then every current result, one section each."""
    out = ["![Output tokens/s by concurrency](images/results.png)"]
    for r in current:
        out += [f"### {r.title}", *_body(r)]
    return "\n\n".join(out)


def replace_block(text: str, block: str, where: str) -> str:
    """``text`` with what lies between the markers replaced by ``block``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        _fail(f"{where} needs one {BEGIN} line before one {END} line")
    pre, rest = text.split(BEGIN)
    _, post = rest.split(END)
    return f"{pre}{BEGIN}\n{block}\n{END}{post}"


def _fail(msg: str):
    print(f"render: {msg}", file=sys.stderr)
    raise SystemExit(2)


def plot(current: list, path: Path) -> None:
    """Bars of the headline's output tok/s columns, one group per concurrency, one bar per server
    (the mean over the rows of that server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = next(r for r in current if r.name == HEADLINE)
    t = head.tables[0]
    key = t.columns.index("server") if "server" in t.columns else 0
    ys = [i for i, c in enumerate(t.columns) if c.endswith("tok/s")]
    servers = list(dict.fromkeys(row[key] for row in t.rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(servers), 1)
    for j, server in enumerate(servers):
        rows = [row for row in t.rows if row[key] == server]
        means = [_mean([row[i] for row in rows]) for i in ys]
        ax.bar([k + j * width for k in range(len(ys))], means, width, label=server, color=f"C{j}")
    ax.set_xticks([k + width * (len(servers) - 1) / 2 for k in range(len(ys))], [t.columns[i] for i in ys])
    ax.set_title(f"{head.title}\n{head.date[:10]}, {machine_md(head.machine)}", fontsize=9)
    ax.set_ylabel("output tokens/s")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mean(xs: list) -> float:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/render.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="results files' folder")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "results.png")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if README or docs are stale")
    a = p.parse_args(argv)
    current = _results_module().current(a.results)
    stale = []
    for path, block in ((a.readme, readme_block(current)), (a.docs, docs_block(current))):
        old = path.read_text()
        new = replace_block(old, block, str(path))
        if new != old:
            stale.append(str(path))
            if not a.check:
                path.write_text(new)
    if a.check:
        for s in stale:
            print(f"render: {s} is stale: run python benchmarks/render.py", file=sys.stderr)
        return 1 if stale else 0
    plot(current, a.plot)
    print(f"rendered {len(current)} results into {a.readme}, {a.docs} and {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
