"""engine.grammar.GrammarCompiler's tokenizer build off the worker loop: ``prepare_in_background``
builds llguidance's tokenizer once, in its own thread (a worker calls it at start: its first
structured request no longer pays the ~3 s build inside the loop); a matcher asked for during the
build waits for that one build; a failed background build is logged and the first matcher retries
and raises it. (The launched workers logging the build at start: tests/e2e/test_tools_e2e.py.)"""

from __future__ import annotations

import logging
import threading

import pytest

pytest.importorskip("llguidance")

from engine.grammar import GrammarCompiler  # noqa: E402
from transfer.wire.sampling_params import StructuredOutput  # noqa: E402

pytestmark = pytest.mark.unit
DIGITS = StructuredOutput(kind="regex", spec="[0-9]+")


class Builder:
    """A ``tokenizer_json`` callable recording which threads call it; blocks until ``release``."""

    def __init__(self, tokenizer, fail_first: bool = False) -> None:
        self.json, self.calls, self.fail_first = tokenizer.backend_json(), [], fail_first
        self.release, self.entered = threading.Event(), threading.Event()

    def __call__(self) -> str:
        self.calls.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(30)
        if self.fail_first and len(self.calls) == 1:
            raise OSError("tokenizer file unreadable")
        return self.json


def compiler(tokenizer, builder) -> GrammarCompiler:
    return GrammarCompiler(builder, tokenizer.vocab_size, tokenizer.eos_token_ids)


def test_the_build_runs_once_in_the_background_thread(tokenizer):
    b = Builder(tokenizer)
    b.release.set()
    c = compiler(tokenizer, b)
    thread = c.prepare_in_background()
    thread.join(30)
    assert not thread.is_alive() and b.calls == ["grammar-tokenizer"]
    m = c.matcher(DIGITS)
    ok = tokenizer.encode("7")[0]
    assert m.bitmask()[ok // 8] >> (ok % 8) & 1
    c.matcher(DIGITS)
    assert b.calls == ["grammar-tokenizer"]  # matchers reuse the background build


def test_a_matcher_during_the_build_waits_for_it(tokenizer):
    b = Builder(tokenizer)
    c = compiler(tokenizer, b)
    thread = c.prepare_in_background()
    assert b.entered.wait(30)
    got = []
    asker = threading.Thread(target=lambda: got.append(c.matcher(DIGITS)))
    asker.start()
    asker.join(0.3)
    assert asker.is_alive() and not got  # waiting for the build, not starting a second one
    b.release.set()
    asker.join(30)
    thread.join(30)
    assert len(got) == 1 and got[0].bitmask() is not None and b.calls == ["grammar-tokenizer"]


def test_a_failed_background_build_is_logged_and_retried_by_the_first_matcher(tokenizer, caplog):
    b = Builder(tokenizer, fail_first=True)
    b.release.set()
    c = compiler(tokenizer, b)
    with caplog.at_level(logging.WARNING, logger="engine.grammar"):
        c.prepare_in_background().join(30)
    assert "building the grammar engine's tokenizer failed (OSError: tokenizer file unreadable)" in caplog.text
    assert c.matcher(DIGITS).bitmask() is not None
    assert b.calls == ["grammar-tokenizer", threading.current_thread().name]
