"""``python -m benchmarks.peer_ratios [--base NAME]... FILE.json...``: one table of output tok/s, TPOT and
TTFT per target and load level across the JSON files of a sitting (``pdserve bench serve --out``, one
file per target as ``bench/peers/compare_sequential.sh`` writes them), then each target's tok/s over
each ``--base`` target's at the same load level.

Contract: only the ``all`` records of each file count (an interference run's parts are left out); a
target that ran twice in the sitting keeps each run apart as ``name#2``, ``name#3``, ... in file
order, so a repeat is read as a second measurement, never averaged in; a base that did not run a
level gives ``-`` there. Nothing is launched: this reads files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_runs(paths: list[Path]) -> list[dict]:
    """``{"target", "load", "tok_s", "tpot_ms", "ttft_ms", "failed"}`` per ``all`` record, in file order."""
    rows: list[dict] = []
    seen: dict[str, int] = {}
    for path in paths:
        runs = [r for r in json.loads(path.read_text())["runs"] if r.get("kind", "all") == "all"]
        for target in dict.fromkeys(r["target"] for r in runs):
            seen[target] = seen.get(target, 0) + 1
        for r in runs:
            name = r["target"] if seen[r["target"]] == 1 else f"{r['target']}#{seen[r['target']]}"
            s = r["stats"]
            rows.append(
                {
                    "target": name,
                    "load": r["load"],
                    "tok_s": s["output_throughput"],
                    "tpot_ms": (s.get("tpot") or {}).get("mean_ms"),
                    "ttft_ms": (s.get("ttft") or {}).get("mean_ms"),
                    "failed": s["failed"],
                }
            )
    return rows


def ratio_rows(rows: list[dict], base: str) -> list[tuple[str, str, float | None]]:
    """``(target, load, tok/s over base's tok/s at that load)`` for every target but ``base``."""
    base_tok = {r["load"]: r["tok_s"] for r in rows if r["target"] == base}
    out = []
    for r in rows:
        if r["target"] == base:
            continue
        b = base_tok.get(r["load"])
        out.append((r["target"], r["load"], r["tok_s"] / b if b else None))
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def render(rows: list[dict], bases: list[str]) -> str:
    """The runs table, then one ratio table per base, as GitHub markdown."""
    lines = ["| target | load | tok/s | TPOT mean ms | TTFT mean ms | failed |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['load']} | {r['tok_s']:.1f} | {_ms(r['tpot_ms'])} | ")
        lines[-1] += f"{_ms(r['ttft_ms'])} | {r['failed']} |"
    for base in bases:
        lines += ["", f"| target | load | tok/s over {base} |", "|---|---|---|"]
        lines += [f"| {t} | {load} | {'-' if x is None else f'{x:.2f}x'} |" for t, load, x in ratio_rows(rows, base)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_ratios", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="bench serve --out JSON files")
    p.add_argument("--base", action="append", default=[], help="target the others are divided by (repeatable)")
    a = p.parse_args(argv)
    print(render(load_runs(a.files), a.base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
