"""Grammar matchers for structured output (llguidance), one per constrained request.

``GrammarCompiler(tokenizer_json, vocab_size, eos_ids)`` builds llguidance's tokenizer once (about
0.5 s on CPU with the GGUF tokenizer read); a worker starts that build at start in a background
thread (``prepare_in_background``), beside the rest of its start-up, and joins it before it serves,
so no constrained request builds it inside the worker loop and no build competes with the loop for
the GIL; ``matcher(so)`` returns a
fresh ``Matcher`` for one request. A ``Matcher`` follows the request's output: ``consume(tok)``
after every token (the sampler state calls it), ``bitmask()`` for the next step. The state is a
function of the constraint and the tokens consumed, so a PD decode worker rebuilds it by
consuming the prefill worker's first token; a retract keeps the ``Request`` and so the matcher.

``allowed_masks(matchers, vocab)`` turns the next-token bitmasks of a batch's constrained rows into
one bool tensor ``[rows, vocab]`` (True: allowed), for the sampler to apply in one op.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.grammar_spec import _llguidance, grammar_of
from transfer.wire.sampling_params import StructuredOutput

log = logging.getLogger(__name__)


class Matcher:
    """One request's grammar state (see the module docstring)."""

    def __init__(self, inner) -> None:
        self._m = inner

    def consume(self, token_id: int) -> None:
        """Advance past ``token_id``; a token the mask did not allow puts the matcher in error
        (then every token stays allowed: the request ends by its own limits)."""
        self._m.consume_token(token_id)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the start, the grammar allows next in turn (the state is not
        changed); all of them when the matcher is in error (no constraint left)."""
        if self._m.is_error():
            return len(tokens)
        return self._m.validate_tokens(tokens)

    def bitmask(self) -> bytes | None:
        """The allowed next tokens, one bit per id (little-endian within each 32-bit word), or None
        when the matcher is in error (no constraint left to apply)."""
        if self._m.is_error():
            return None
        return self._m.compute_bitmask()


class GrammarCompiler:
    """Makes ``Matcher``s for one tokenizer; ``tokenizer_json`` is called once, by
    ``prepare_in_background``'s thread or else by the first ``matcher`` (thread-safe)."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._json, self._vocab, self._eos = tokenizer_json, vocab_size, list(eos_ids)
        self._tok = None
        self._lock = threading.Lock()  # held while the tokenizer is built: a matcher waits for the build

    def prepare_in_background(self) -> threading.Thread | None:
        """Start building llguidance's tokenizer in a daemon thread and return it; None (nothing
        started) when llguidance is not installed. A failed build is logged; the next ``matcher``
        then builds again and raises the error to its request."""
        if importlib.util.find_spec("llguidance") is None:
            return None
        thread = threading.Thread(target=self._prepare, name="grammar-tokenizer", daemon=True)
        thread.start()
        return thread

    def _prepare(self) -> None:
        t0 = time.perf_counter()
        try:
            self._tokenizer()
        except Exception as e:  # a daemon thread has no caller: log, and let the first request retry
            log.warning(
                "building the grammar engine's tokenizer failed (%s: %s); the first structured request retries",
                type(e).__name__,
                e,
            )
            return
        log.info("grammar engine tokenizer built in %.2f s (background, at start)", time.perf_counter() - t0)

    def _tokenizer(self):
        """llguidance's tokenizer, built on the first call (later callers wait for that build)."""
        with self._lock:
            if self._tok is None:
                self._tok = _llguidance().LLTokenizer(self._json(), n_vocab=self._vocab, eos_token=self._eos)
            return self._tok

    def matcher(self, so: StructuredOutput) -> Matcher:
        """A fresh matcher for ``so``; ``ValueError`` with llguidance's message if it is invalid."""
        tok = self._tokenizer()
        m = _llguidance().LLMatcher(tok, grammar_of(so), log_level=0)
        if m.is_error():
            raise ValueError(f"invalid {so.kind} constraint: {m.get_error()}")
        return Matcher(m)


def allowed_masks(masks: Sequence[bytes], vocab: int) -> torch.Tensor:
    """``[len(masks), vocab]`` bool: bit j of row i set means token j is allowed (ids past a mask's
    width are not)."""
    width = max(len(m) for m in masks)
    raw = np.zeros((len(masks), width), dtype=np.uint8)
    for i, m in enumerate(masks):
        raw[i, : len(m)] = np.frombuffer(m, dtype=np.uint8)
    bits = np.unpackbits(raw, axis=1, bitorder="little")[:, :vocab]
    if bits.shape[1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return torch.from_numpy(bits.astype(bool))
