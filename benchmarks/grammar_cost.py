"""The grammar engine's (llguidance) cost per constrained token on this CPU, for a forced tool call
(``tool_choice: "required"`` over two tools, the grammar ``server.router.tools`` sends) and for a
``response_format`` json_schema, with the served model's tokenizer (49152 ids).

A valid output of each constraint is replayed token by token through a fresh matcher, as a worker's
sampler drives it: ``bitmask()`` (the allowed next tokens), ``allowed_masks`` (those bits as the bool
row the sampler applies) and ``consume(token)``. Each step's time per token is the mean over the
output, the best of ``--repeat`` replays (a busy machine inflates the best one least); the first
replay's total is shown apart (it pays llguidance's lazily built lexer states). Also shown:
building one request's matcher (the grammar compiled, once per request) and llguidance's tokenizer
(once per worker).

``python -m benchmarks.grammar_cost [--repeat 20]``
"""

from __future__ import annotations

import argparse
import json
import time

from engine.grammar import GrammarCompiler, allowed_masks
from engine.model_paths import resolve_model_path
from engine.tokenizer import Tokenizer
from server.router.openai_schemas import ToolDef
from server.router.tools import ToolPlan
from transfer.wire.sampling_params import StructuredOutput

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "email", "tags"],
    "additionalProperties": False,
}


def cases() -> list[tuple[str, StructuredOutput, str]]:
    """(label, constraint, a valid output) for each measured constraint."""
    tools = tuple(
        ToolDef.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
        for n, p in (("get_weather", WEATHER), ("get_time", TIME))
    )
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    person = json.dumps(
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"]}
    )
    return [
        ("tool call (required, 2 tools)", ToolPlan(tools=tools, forced="required").constraint(), call),
        ("json_schema (4 fields)", StructuredOutput(kind="json", spec=json.dumps(PERSON)), person),
    ]


def replay_us(compiler: GrammarCompiler, so: StructuredOutput, ids: list[int], vocab: int) -> tuple[float, ...]:
    """(matcher build, bitmask, bool row, consume) in microseconds: the build once, the rest per token."""
    t0 = time.perf_counter()
    m = compiler.matcher(so)
    build = time.perf_counter() - t0
    mask_s = row_s = consume_s = 0.0
    for t in ids:
        a = time.perf_counter()
        mask = m.bitmask()
        b = time.perf_counter()
        row = allowed_masks([mask], vocab)
        c = time.perf_counter()
        m.consume(t)
        d = time.perf_counter()
        assert mask is not None and bool(row[0, t]), "the replayed output must be allowed at every token"
        mask_s, row_s, consume_s = mask_s + b - a, row_s + c - b, consume_s + d - c
    n = len(ids)
    return build * 1e6, mask_s / n * 1e6, row_s / n * 1e6, consume_s / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    tok = Tokenizer.from_path(resolve_model_path("default"))
    compiler = GrammarCompiler(tok.backend_json, tok.vocab_size, tok.eos_token_ids)
    t0 = time.perf_counter()
    compiler.matcher(StructuredOutput(kind="json", spec='{"type": "object"}'))  # builds llguidance's tokenizer
    print(
        "llguidance tokenizer build (once per worker, with the first matcher): "
        f"{(time.perf_counter() - t0) * 1e3:.0f} ms"
    )
    print(
        "| constraint | tokens | matcher build | bitmask / token | bool row / token | consume / token | total / token "
        "| first replay total / token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, so, text in cases():
        ids = tok.encode(text)
        runs = [replay_us(compiler, so, ids, tok.vocab_size) for _ in range(a.repeat)]
        build, mask, row, consume = (min(r[i] for r in runs) for i in range(4))
        first = sum(runs[0][1:])
        print(
            f"| {label} | {len(ids)} | {build:.0f} us | {mask:.1f} us | {row:.1f} us | {consume:.1f} us | "
            f"{mask + row + consume:.1f} us | {first:.1f} us |"
        )


if __name__ == "__main__":
    main()
