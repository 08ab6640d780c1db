"""Grammar engines side by side on this CPU: llguidance (what pdserve uses), xgrammar, outlines-core.

For the served model's tokenizer (SmolLM2, 49152 ids) and the constraints of ``benchmarks.grammar_cost``
(a 4-field json_schema, the forced tool-call grammar) plus a regex, each engine is measured on:

- the one-time tokenizer build (its vocabulary index, once per worker);
- compiling each constraint (once per request, or once per distinct constraint with a cache);
- the per-token next-token mask, replaying one fixed valid output token by token through a fresh
  matcher (the engine's own bitmask fill, then its advance by the token); per repeat the mean over
  the output, and the min and median of those over ``--repeat`` replays, and the first replay
  apart (it pays whatever an engine builds lazily: llguidance's lexer states);
- that the engine accepts the same output: every replayed token is allowed by the mask before it,
  and EOS is allowed after the last one.

Engines run interleaved (llguidance, xgrammar, outlines-core, llguidance, ...) so a load change on
a busy machine hits them alike; the minimum is the figure least inflated by other processes. An
engine that is not installed is skipped with a line saying so (``pip install 'pdserve[grammar-bench]'``
installs the two others).

``python -m benchmarks.grammar_compare [--repeat 30]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from benchmarks.grammar_cost import PERSON, TIME, WEATHER
from benchmarks.grammar_engines import TOOL_PREFIX, TOOL_SUFFIX, Case, Engine, Vocab, available, vocab_of


@dataclass
class Row:
    """One (engine, case) result; times in microseconds."""

    engine: str
    case: str
    tokens: int
    compile_us: float
    mask_us: list[float] = field(default_factory=list)  # per repeat: mean bitmask time per token
    advance_us: list[float] = field(default_factory=list)  # per repeat: mean advance time per token
    accepted: bool = True
    note: str = ""


def cases() -> list[Case]:
    """The measured constraints: those of ``benchmarks.grammar_cost`` and a regex."""
    call = {
        "anyOf": [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {"name": {"const": n}, "arguments": p},
            }
            for n, p in (("get_weather", WEATHER), ("get_time", TIME))
        ]
    }
    person = json.dumps(
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"]}
    )
    stamp = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(Z|[+-]\d{2}:\d{2})"
    return [
        Case("json_schema (4 fields)", "json", json.dumps(PERSON), person),
        Case(
            "tool call (required, 2 tools)",
            "tool_call",
            json.dumps(call),
            TOOL_PREFIX + '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' + TOOL_SUFFIX,
        ),
        Case("regex (ISO timestamp)", "regex", stamp, "2026-12-02T20:43:44+01:00"),
    ]


def _replay(engine: Engine, compiled, ids: list[int], eos: Sequence[int]) -> tuple[float, float, bool]:
    """(mean mask us / token, mean advance us / token, accepted) for one replay of ``ids``."""
    m = engine.matcher(compiled)
    mask_s = adv_s = 0.0
    ok = True
    for t in ids:
        a = time.perf_counter()
        raw = m.fill()
        b = time.perf_counter()
        ok = ok and bool(m.allowed(raw)[t])
        c = time.perf_counter()
        try:
            m.advance(t)
        except ValueError:
            ok = False
        adv_s += time.perf_counter() - c
        mask_s += b - a
    ok = ok and bool(m.allowed(m.fill())[list(eos)].any())
    n = len(ids)
    return mask_s / n * 1e6, adv_s / n * 1e6, ok


def compare(
    engines: Sequence[Engine], case_list: Sequence[Case], vocab: Vocab, encode: Callable[[str], list[int]], repeat: int
) -> tuple[dict[str, float], list[Row]]:
    """Measure every engine on every case, interleaved per repeat: ({engine: tokenizer build us},
    rows). A case an engine cannot compile gets a row with the error in ``note``."""
    builds = {}
    for e in engines:
        t0 = time.perf_counter()
        e.build(vocab)
        builds[e.name] = (time.perf_counter() - t0) * 1e6
    rows: dict[tuple[str, str], Row] = {}
    compiled: dict[tuple[str, str], object] = {}
    ids = {c.label: encode(c.output) for c in case_list}
    for e in engines:
        for c in case_list:
            t0 = time.perf_counter()
            try:
                compiled[e.name, c.label] = e.compile(c)
                note = ""
            except Exception as err:  # an engine refusing a constraint is a result, not a crash
                note = f"cannot compile: {type(err).__name__}: {str(err).splitlines()[0][:80]}".replace("|", "/")
            rows[e.name, c.label] = Row(
                e.name, c.label, len(ids[c.label]), (time.perf_counter() - t0) * 1e6, accepted=not note, note=note
            )
    for _ in range(repeat):
        for c in case_list:
            for e in engines:
                if (e.name, c.label) not in compiled:
                    continue
                mask, adv, ok = _replay(e, compiled[e.name, c.label], ids[c.label], vocab.eos_ids)
                r = rows[e.name, c.label]
                r.mask_us.append(mask)
                r.advance_us.append(adv)
                r.accepted = r.accepted and ok
    return builds, list(rows.values())


HEADER = (
    "| engine | constraint | tokens | compile | mask / token (min) | mask / token (median) "
    "| mask / token (first replay) | advance / token (min) | accepts the output |"
)


def table(builds: dict[str, float], rows: Sequence[Row]) -> str:
    """The markdown table of ``compare``'s result: one line per engine for the tokenizer build,
    then one row per (engine, constraint)."""
    lines = ["| engine | tokenizer build (once per worker) |", "|---|---|"]
    lines += [f"| {name} | {us / 1e3:.0f} ms |" for name, us in builds.items()]
    lines += ["", HEADER, "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.case, r.engine)):
        if r.note:
            lines.append(f"| {r.engine} | {r.case} | {r.tokens} | - | - | - | - | - | {r.note} |")
            continue
        lines.append(
            f"| {r.engine} | {r.case} | {r.tokens} | {r.compile_us / 1e3:.1f} ms | {min(r.mask_us):.1f} us "
            f"| {statistics.median(r.mask_us):.1f} us | {r.mask_us[0]:.1f} us | {min(r.advance_us):.1f} us "
            f"| {'yes' if r.accepted else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    from engine.model_paths import resolve_model_path
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(resolve_model_path("default"))
    engines, missing = available()
    for line in missing:
        print(line)
    builds, rows = compare(engines, cases(), vocab_of(tok), tok.encode, a.repeat)
    print(f"vocab {tok.vocab_size}, {a.repeat} interleaved repeats\n")
    print(table(builds, rows))


if __name__ == "__main__":
    main()
