"""benchmarks.grammar_compare's core and benchmarks.grammar_engines on llguidance alone (the engine `make
install` has), on the real tokenizer with a tiny regex: the engine accepts its valid output and
refuses a wrong one, every repeat is recorded, the table has the tokenizer line and one well-formed
row per case (a constraint the engine cannot compile is a row saying so), and an engine whose module
is missing is skipped with a line naming the install."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from benchmarks.grammar_compare import compare, table  # noqa: E402
from benchmarks.grammar_engines import Case, Llguidance, available, vocab_of  # noqa: E402

pytestmark = pytest.mark.unit


def test_compare_on_llguidance_makes_the_table(tokenizer):
    vocab = vocab_of(tokenizer)
    assert vocab.size == tokenizer.vocab_size and len(vocab.token_bytes) == vocab.size
    for i in tokenizer.encode(" the 123-abc\n"):  # byte-level symbols (Ġ, Ċ) decoded to bytes
        assert vocab.token_bytes[i] == tokenizer.decode([i]).encode()
    assert all(vocab.token_bytes[e] is None for e in vocab.eos_ids)  # special tokens carry no bytes
    ok = Case("digits", "regex", r"[0-9]{3}-[a-z]+", "123-abc")
    bad = Case("wrong output", "regex", r"[0-9]{3}-[a-z]+", "12-abc")
    broken = Case("broken", "regex", "[0-9", "1")
    builds, rows = compare([Llguidance()], [ok, bad, broken], vocab, tokenizer.encode, repeat=2)
    assert list(builds) == ["llguidance"] and builds["llguidance"] > 0
    by_case = {r.case: r for r in rows}
    assert by_case["digits"].accepted and not by_case["wrong output"].accepted
    assert not by_case["broken"].accepted and by_case["broken"].note.startswith("cannot compile: ")
    assert by_case["broken"].mask_us == []  # never replayed
    assert len(by_case["digits"].mask_us) == 2 and all(t > 0 for t in by_case["digits"].mask_us)
    text = table(builds, rows).splitlines()
    assert text[:3] == ["| engine | tokenizer build (once per worker) |", "|---|---|", text[2]]
    assert text[2].startswith("| llguidance | ") and text[2].endswith(" ms |")
    header, sep, *body = text[4:]
    cols = header.count("|")
    assert sep.count("|") == cols and len(body) == 3 and all(line.count("|") == cols for line in body)
    assert body[0].startswith("| llguidance | broken | 1 | - |") and "cannot compile" in body[0]
    assert body[1].startswith("| llguidance | digits | 5 |") and body[1].endswith("| yes |")
    assert body[2].startswith("| llguidance | wrong output |") and body[2].endswith("| NO |")


def test_a_missing_engine_is_skipped_with_a_line():
    class Absent(Llguidance):
        name, module = "absent-engine", "no_such_grammar_module_here"

    found, missing = available([Llguidance, Absent])
    assert [e.name for e in found] == ["llguidance"]
    assert missing == [
        ("skipped absent-engine: `no_such_grammar_module_here` is not installed (pip install 'pdserve[grammar-bench]')")
    ]
