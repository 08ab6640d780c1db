"""Grammar engines side by side on this CPU: llguidance (what pdserve uses), xgrammar, outlines-core.

For the served model's tokenizer (SmolLM2, 49152 ids) and the constraints of ``bench.grammar_cost``
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

``python -m bench.grammar_compare [--repeat 30]``
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bench.grammar_cost import PERSON, TIME, WEATHER

TOOL_PREFIX, TOOL_SUFFIX = "<tool_call>\n", "\n</tool_call>"


@dataclass(frozen=True)
class Case:
    """One constraint in engine-neutral form. ``kind``: "json" (``spec`` a JSON schema), "regex"
    (``spec`` a regex, matched whole), or "tool_call" (``spec`` the JSON schema of the call object,
    framed by ``<tool_call>\\n`` ... ``\\n</tool_call>``, as ``server.router.tools`` constrains a
    required tool call). ``output`` is a valid output every engine must accept."""

    label: str
    kind: str
    spec: str
    output: str


@dataclass(frozen=True)
class Vocab:
    """The tokenizer as the engines need it: the ``tokenizers`` JSON, the size, EOS ids, and each
    id's bytes (None for special/added tokens)."""

    tokenizer_json: str
    size: int
    eos_ids: tuple[int, ...]
    token_bytes: tuple[bytes | None, ...]


@dataclass
class Row:
    """One (engine, case) result; times in microseconds."""

    engine: str
    case: str
    tokens: int
    compile_us: float
    mask_us: list[float] = field(default_factory=list)   # per repeat: mean bitmask time per token
    advance_us: list[float] = field(default_factory=list)  # per repeat: mean advance time per token
    accepted: bool = True
    note: str = ""


class Engine(ABC):
    """One grammar engine behind a common interface. ``build(vocab)`` prepares the per-tokenizer
    state (timed as the tokenizer build); ``compile(case)`` returns a compiled constraint;
    ``matcher(compiled)`` a fresh matcher with ``fill()`` (the engine's own next-token bitmask, the
    part timed as the mask), ``allowed(raw) -> np.ndarray[bool]`` (that bitmask per id, length >=
    vocab size; not timed) and ``advance(token_id)`` (``ValueError`` if the engine refuses it)."""

    name = ""
    module = ""

    @abstractmethod
    def build(self, vocab: Vocab) -> None: ...

    @abstractmethod
    def compile(self, case: Case): ...

    @abstractmethod
    def matcher(self, compiled): ...


def _bits(words: np.ndarray) -> np.ndarray:
    """Little-endian bitmask words (any int dtype) -> bool per id."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little").astype(bool)


class Llguidance(Engine):
    name, module = "llguidance", "llguidance"

    def build(self, vocab: Vocab) -> None:
        import llguidance as lg
        self.lg = lg
        self.tok = lg.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.size, eos_token=list(vocab.eos_ids))

    def compile(self, case: Case):
        m = self.lg.LLMatcher
        if case.kind == "json":
            grammar = m.grammar_from_json_schema(case.spec)
        elif case.kind == "regex":
            grammar = m.grammar_from_regex(case.spec)
        else:
            grammar = m.grammar_from_lark(f"start: {json.dumps(TOOL_PREFIX)} call {json.dumps(TOOL_SUFFIX)}\n"
                                          f"call: %json {case.spec}")
        # llguidance compiles per matcher, lazily (the rest shows in the first replay's mask time)
        matcher = self.lg.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, compiled):
        m = self.lg.LLMatcher(self.tok, compiled, log_level=0)

        class M:
            def fill(self):
                return m.compute_bitmask()  # what pdserve's engine.grammar.Matcher.bitmask() calls

            def allowed(self, raw) -> np.ndarray:
                return _bits(np.frombuffer(raw, dtype=np.uint8))

            def advance(self, t: int) -> None:
                if not m.consume_token(t):
                    raise ValueError(m.get_error())
        return M()


class LlguidanceFill(Llguidance):
    """llguidance filling a preallocated bitmask tensor (``llguidance.torch.fill_next_token_bitmask``,
    as xgrammar and outlines-core are driven here) instead of returning new bytes per token as
    pdserve's ``Matcher.bitmask()`` does: separates the engine's mask cost from that allocation."""

    name = "llguidance (fill)"

    def matcher(self, compiled):
        import llguidance.torch as lt
        m = self.lg.LLMatcher(self.tok, compiled, log_level=0)
        bitmask = lt.allocate_token_bitmask(1, self.tok.vocab_size)

        class M:
            def fill(self):
                lt.fill_next_token_bitmask(m, bitmask, 0)
                return bitmask

            def allowed(self, raw) -> np.ndarray:
                return _bits(raw[0].numpy())

            def advance(self, t: int) -> None:
                if not m.consume_token(t):
                    raise ValueError(m.get_error())
        return M()


class Xgrammar(Engine):
    name, module = "xgrammar", "xgrammar"

    def build(self, vocab: Vocab) -> None:
        import xgrammar as xgr
        from tokenizers import Tokenizer as HFTok
        from transformers import PreTrainedTokenizerFast
        self.xgr, self.size = xgr, vocab.size
        hf = PreTrainedTokenizerFast(tokenizer_object=HFTok.from_str(vocab.tokenizer_json))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab.size, stop_token_ids=list(vocab.eos_ids))
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, case: Case):
        xgr = self.xgr
        if case.kind == "json":
            return self.compiler.compile_json_schema(case.spec)
        if case.kind == "regex":
            return self.compiler.compile_regex(case.spec)
        frame = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_PREFIX)}"),
                                   xgr.Grammar.from_json_schema(case.spec),
                                   xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_SUFFIX)}"))
        return self.compiler.compile_grammar(frame)

    def matcher(self, compiled):
        xgr, size = self.xgr, self.size
        m = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, size)

        class M:
            def fill(self):
                m.fill_next_token_bitmask(bitmask)
                return bitmask

            def allowed(self, raw) -> np.ndarray:
                return _bits(raw[0].numpy())

            def advance(self, t: int) -> None:
                if not m.accept_token(t):
                    raise ValueError(f"xgrammar refused token {t}")
        return M()


class OutlinesCore(Engine):
    name, module = "outlines-core", "outlines_core"

    def build(self, vocab: Vocab) -> None:
        import outlines_core as oc
        self.oc, self.size = oc, vocab.size
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if b is not None and i not in vocab.eos_ids:
                by_bytes.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(vocab.eos_ids[0], by_bytes)

    def _regex(self, case: Case) -> str:
        build = self.oc.json_schema.build_regex_from_schema
        if case.kind == "json":
            return build(case.spec)
        if case.kind == "regex":
            return case.spec
        return re.escape(TOOL_PREFIX) + build(case.spec) + re.escape(TOOL_SUFFIX)

    def compile(self, case: Case):
        return self.oc.Index(self._regex(case), self.vocab)

    def matcher(self, compiled):
        import torch
        g = self.oc.Guide(compiled)
        words = torch.zeros((self.size + 31) // 32, dtype=torch.int32)

        class M:
            def fill(self):
                g.write_mask_into(words.data_ptr(), words.numel(), words.element_size())
                return words

            def allowed(self, raw) -> np.ndarray:
                return _bits(raw.numpy())

            def advance(self, t: int) -> None:
                g.advance(t)
        return M()


ENGINES: tuple[Callable[[], Engine], ...] = (Llguidance, LlguidanceFill, Xgrammar, OutlinesCore)


def available(engines: Sequence[Callable[[], Engine]] = ENGINES) -> tuple[list[Engine], list[str]]:
    """(the installed engines, a line per engine that is not)."""
    import importlib.util
    found, missing = [], []
    for make in engines:
        e = make()
        if importlib.util.find_spec(e.module) is None:
            missing.append(f"skipped {e.name}: `{e.module}` is not installed (pip install 'pdserve[grammar-bench]')")
        else:
            found.append(e)
    return found, missing


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte, inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def vocab_of(tok) -> Vocab:
    """``Vocab`` of an ``engine.tokenizer.Tokenizer`` (byte-level BPE)."""
    from tokenizers import Tokenizer as HFTok
    raw = tok.backend_json()
    hf = HFTok.from_str(raw)
    added = set(hf.get_added_tokens_decoder())
    dec = _byte_decoder()
    out: list[bytes | None] = []
    for i in range(tok.vocab_size):
        s = hf.id_to_token(i)
        out.append(None if s is None or i in added else bytes(dec[c] for c in s))
    return Vocab(raw, tok.vocab_size, tuple(tok.eos_token_ids), tuple(out))


def cases() -> list[Case]:
    """The measured constraints: those of ``bench.grammar_cost`` and a regex."""
    call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": n}, "arguments": p}} for n, p in
                      (("get_weather", WEATHER), ("get_time", TIME))]}
    person = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                         "tags": ["math", "engines", "poetry"]})
    stamp = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(Z|[+-]\d{2}:\d{2})"
    return [Case("json_schema (4 fields)", "json", json.dumps(PERSON), person),
            Case("tool call (required, 2 tools)", "tool_call", json.dumps(call),
                 TOOL_PREFIX + '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                 + TOOL_SUFFIX),
            Case("regex (ISO timestamp)", "regex", stamp, "2026-12-02T20:43:44+01:00")]


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


def compare(engines: Sequence[Engine], case_list: Sequence[Case], vocab: Vocab, encode: Callable[[str], list[int]],
            repeat: int) -> tuple[dict[str, float], list[Row]]:
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
            rows[e.name, c.label] = Row(e.name, c.label, len(ids[c.label]), (time.perf_counter() - t0) * 1e6,
                                        accepted=not note, note=note)
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


HEADER = ("| engine | constraint | tokens | compile | mask / token (min) | mask / token (median) "
          "| mask / token (first replay) | advance / token (min) | accepts the output |")


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
        lines.append(f"| {r.engine} | {r.case} | {r.tokens} | {r.compile_us / 1e3:.1f} ms | {min(r.mask_us):.1f} us "
                     f"| {statistics.median(r.mask_us):.1f} us | {r.mask_us[0]:.1f} us | {min(r.advance_us):.1f} us "
                     f"| {'yes' if r.accepted else 'NO'} |")
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
