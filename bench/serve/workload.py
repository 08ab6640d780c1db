"""Synthetic workloads: prompts of chosen token lengths, an optional shared prefix, Poisson arrivals.

Lengths are counted with the served model's tokenizer when one is available (``TokenCounter``),
otherwise one word is taken as one token (``WordCounter``). Everything is drawn from
``random.Random(seed)``: the same arguments give the same prompts and arrival times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Protocol

# Common English words: prompts read like text, so tokenizers split them as they split real input.
_WORDS = (
    "the of and to in is was for on that with as by at from his her they this are have not be one had "
    "all their which were when we there can an your would what so if about out them many then these some "
    "time has look two more write go see number no way could people my than first water been call who oil "
    "its now find long down day did get come made may part over new sound take only little work know place "
    "year live me back give most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show also around form "
    "three small set put end does another well large must big even such because turn here why ask went men "
    "read need land different home us move try kind hand picture again change off play spell air away animal "
    "house point page letter mother answer found study still learn should america world high every near add "
    "food between own below country plant last school father keep tree never start city earth eye light "
    "thought head under story saw left few while along might close something seem next hard open example "
    "begin life always those both paper together got group often run important until children side feet car "
    "mile night walk white sea began grow took river four carry state once book hear stop without second late"
).split()


class LengthCounter(Protocol):
    """Makes text of about ``n`` tokens and counts tokens of a text."""

    name: str

    def make_text(self, n: int, rng: random.Random) -> str:
        """Text of ``n`` tokens (exact for words; for a tokenizer, ``count`` says what it became)."""

    def count(self, text: str) -> int:
        """Tokens in ``text``."""


class WordCounter:
    """One word = one token: the approximation used when no tokenizer is available."""

    name = "words"

    def make_text(self, n: int, rng: random.Random) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def count(self, text: str) -> int:
        return len(text.split())


class TokenCounter:
    """Lengths in the tokens of ``tokenizer`` (anything with ``encode(text)`` / ``decode(ids)``)."""

    def __init__(self, tokenizer, name: str = "tokenizer") -> None:
        self.tok = tokenizer
        self.name = name

    def make_text(self, n: int, rng: random.Random) -> str:
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < n:  # words are 1-3 tokens: a few rounds at most
            words += [rng.choice(_WORDS) for _ in range(n - len(ids) + 1)]
            ids = self.tok.encode(" ".join(words))
        return self.tok.decode(ids[:n])

    def count(self, text: str) -> int:
        return len(self.tok.encode(text))


def load_counter(spec: str | None) -> LengthCounter:
    """``"words"`` -> ``WordCounter``; a model spec (``"default"``, a .gguf, an HF folder) -> its
    tokenizer. A tokenizer that cannot be loaded falls back to words (with a notice on stderr)."""
    import sys

    if spec in (None, "words"):
        return WordCounter()
    try:
        from engine.model_paths import resolve_model_path
        from engine.tokenizer import Tokenizer

        return TokenCounter(Tokenizer.from_path(resolve_model_path(spec)), name=f"tokenizer:{spec}")
    except (OSError, ValueError, ImportError) as e:
        print(f"bench serve: tokenizer {spec!r} unavailable ({e}); counting words as tokens", file=sys.stderr)
        return WordCounter()


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. ``arrival_s``: offset from the start in open loop (None: closed loop)."""

    index: int
    prompt: str
    prompt_len: int
    output_len: int
    kind: str = "main"
    arrival_s: float | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # chat: (role, content) history; None: one user turn


@dataclass(frozen=True)
class PromptShape:
    """Prompt lengths uniform in ``[input_min, input_max]`` tokens, the first ``shared_prefix_len``
    of them the same for every prompt, and ``output_len`` generated tokens (uniform in
    ``[output_len, output_max]`` when ``output_max`` is given). An ``instruction`` follows the drawn
    text of every prompt (an input-grounded task: the answer quotes the text before it)."""

    num_prompts: int
    input_min: int
    input_max: int
    output_len: int
    shared_prefix_len: int = 0
    kind: str = "main"
    output_max: int | None = None
    instruction: str = ""  # appended to every prompt after a blank line (not counted in the lengths above)

    def __post_init__(self) -> None:
        if not 1 <= self.input_min <= self.input_max:
            raise ValueError(f"input lengths must satisfy 1 <= min <= max, got {self.input_min}..{self.input_max}")
        if not 0 <= self.shared_prefix_len < self.input_min:
            raise ValueError(
                f"shared prefix ({self.shared_prefix_len}) must be shorter than the shortest prompt "
                f"({self.input_min} tokens)"
            )
        if self.num_prompts < 0 or self.output_len < 1:
            raise ValueError("num_prompts must be >= 0 and output_len >= 1")
        if self.output_max is not None and self.output_max < self.output_len:
            raise ValueError(f"output lengths must satisfy min <= max, got {self.output_len}..{self.output_max}")


def make_requests(shape: PromptShape, counter: LengthCounter, seed: int, start_index: int = 0) -> list[RequestSpec]:
    """``shape.num_prompts`` requests with lengths drawn from ``shape``; deterministic in ``seed`` (a
    shape without ``output_max`` draws nothing for the output, so its prompts do not depend on it)."""
    rng = random.Random(seed)
    prefix = counter.make_text(shape.shared_prefix_len, rng) if shape.shared_prefix_len else ""
    out = []
    for i in range(shape.num_prompts):
        n = rng.randint(shape.input_min, shape.input_max)
        body = counter.make_text(n - shape.shared_prefix_len, rng)
        text = f"{prefix} {body}" if prefix else body
        if shape.instruction:
            text = f"{text}\n\n{shape.instruction}"
        out_len = shape.output_len if shape.output_max is None else rng.randint(shape.output_len, shape.output_max)
        out.append(RequestSpec(start_index + i, text, counter.count(text), out_len, shape.kind))
    return out


def poisson_offsets(n: int, rate: float, seed: int, first_at_zero: bool = True) -> list[float]:
    """``n`` arrival times (s) with exponential gaps of mean ``1/rate`` s (``rate=inf``: all at 0),
    seeded. The first is 0, or one random gap when ``first_at_zero`` is False."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    if not first_at_zero and not math.isinf(rate):
        t = rng.expovariate(rate)
    for _ in range(n):
        out.append(t)
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    return out


def poisson_arrivals(
    requests: list[RequestSpec], rate: float, seed: int, first_at_zero: bool = True
) -> list[RequestSpec]:
    """Requests with exponential inter-arrival gaps of mean ``1/rate`` s (``rate=inf``: all at 0).
    The first arrives at 0, or after one random gap when ``first_at_zero`` is False."""
    times = poisson_offsets(len(requests), rate, seed, first_at_zero)
    return [replace(r, arrival_s=t) for r, t in zip(requests, times)]


def merge_by_arrival(*streams: list[RequestSpec]) -> list[RequestSpec]:
    """Streams merged in arrival order, re-indexed 0..n-1 (their ``kind`` tells them apart)."""
    merged = sorted((r for s in streams for r in s), key=lambda r: (r.arrival_s or 0.0, r.kind, r.index))
    return [replace(r, index=i) for i, r in enumerate(merged)]


@dataclass(frozen=True)
class NamedWorkload:
    """A preset of prompt and output lengths (``--workload NAME``), inclusive token ranges."""

    name: str
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    about: str
    instruction: str = ""  # PromptShape.instruction


# As DistServe evaluates: a chatbot (short prompts, long answers) and summarization (long prompts,
# short answers). Summarize needs room for 2,064 tokens per request in flight (see the README).
# Grounded: the answer copies its prompt (quote / rewrite / extract from a given passage), the case
# n-gram speculation is for; chat is the one it must not slow down.
WORKLOADS = {
    "chat": NamedWorkload("chat", (64, 256), (128, 128), "chat: prompts of 64-256 tokens, 128 output tokens"),
    "summarize": NamedWorkload(
        "summarize", (1500, 2000), (32, 64), "summarization: prompts of 1500-2000 tokens, 32-64 output tokens"
    ),
    "grounded": NamedWorkload(
        "grounded",
        (192, 320),
        (128, 128),
        "grounded: a passage of 192-320 tokens to repeat word for word, 128 output tokens",
        "Repeat the text above word for word.",
    ),
}
