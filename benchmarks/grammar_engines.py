"""The grammar engines ``benchmarks.grammar_compare`` measures, behind one interface (``Engine``):
llguidance (as pdserve drives it, and filling a preallocated tensor), xgrammar and outlines-core;
``Case`` (a constraint in engine-neutral form) and ``Vocab`` (the tokenizer as the engines need it,
``vocab_of``); ``available()`` lists the installed engines and a line for each missing one."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

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
            grammar = m.grammar_from_lark(
                f"start: {json.dumps(TOOL_PREFIX)} call {json.dumps(TOOL_SUFFIX)}\ncall: %json {case.spec}"
            )
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
        frame = xgr.Grammar.concat(
            xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_PREFIX)}"),
            xgr.Grammar.from_json_schema(case.spec),
            xgr.Grammar.from_ebnf(f"root ::= {json.dumps(TOOL_SUFFIX)}"),
        )
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
