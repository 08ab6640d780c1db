"""Tests for engine.tokenizer on the embedded SmolLM2 GGUF.

Expected ids are llama.cpp's tokenization (pre-tokenizer type ``smollm``: every ``\\p{N}``
isolated, then GPT-2's regex). They were produced with transformers' GGUF vocab/merges in a
``tokenizers`` pipeline whose pre-tokenizer was Digits(individual_digits=True) + ByteLevel
(what SmolLM2's own tokenizer.json uses) and hard-coded here. transformers' stock GGUF
tokenizer differs on " ٣" (it merges the space into the digit).
"""

from __future__ import annotations

import json
import random

import pytest

from engine.model_paths import resolve_model_path
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

EXPECTED = {
    "12345 and 3.14": [33, 34, 35, 36, 37, 284, 216, 35, 30, 33, 36],
    "Hello  world,   multiple    spaces": [19556, 216, 905, 28, 256, 2701, 333, 5600],
    "héllo wörld 你好 🙂": [88, 2756, 31394, 267, 29989, 400, 216, 18645, 250, 48392, 138, 47526],
    "line1\nline2\n\n  indented\ttab": [1311, 33, 198, 1311, 34, 8866, 641, 6574, 197, 15999],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
    "x²+½ ٣ 1,000,000": [104, 19133, 27, 16738, 216, 164, 113, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32],
    "It's   don't\r\n": [1589, 506, 256, 1326, 982, 2738],
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(resolve_model_path("default"))


def test_special_ids_and_vocab(tok):
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    assert tok.vocab_size == 49152
    assert tok.id_to_token(1) == "<|im_start|>" and tok.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("text", list(EXPECTED))
def test_encode_matches_reference_ids(tok, text):
    assert tok.encode(text) == EXPECTED[text]


@pytest.mark.parametrize(
    "text", list(EXPECTED) + ["", "   ", "a\u00a0b\u200dc", "\U0001f468\u200d\U0001f469\u200d\U0001f467"]
)
def test_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_one_token_each(tok):
    for text in ("0123456789", " 2024", "v1.2.3", "a99b"):
        ids = tok.encode(text)
        digit_ids = [i for i in ids if tok.decode([i]).isdigit()]
        assert len(digit_ids) == sum(ch.isdigit() for ch in text), text
        assert all(len(tok.decode([i])) == 1 for i in digit_ids)
    # non-ASCII \p{N} chars are isolated too: no merge across them or with a leading space
    assert tok.encode("٣٤") == tok.encode("٣") + tok.encode("٤")
    assert tok.encode(" ٣") == tok.encode(" ") + tok.encode("٣")


def test_no_bos_added_for_this_model(tok):
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi") == [6004]


def test_control_tokens_are_single_ids_and_skippable(tok):
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nok"
    assert tok.encode("<|im_start") != [1]  # partial control text is ordinary text


def test_chat_template_adds_default_system_prompt(tok):
    out = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert out == SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(out)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_chat_template_respects_system_and_no_generation_prompt(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_incremental_detokenizer_one_token_at_a_time(tok):
    text = "héllo wörld 你好 🙂 ok"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.feed([i]) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]  # the emoji's first byte-token was held back
    assert pieces[-3:] == [" 🙂", " ok", ""]


def test_incremental_detokenizer_batches_and_specials(tok):
    ids = tok.encode("<|im_start|>assistant\n你好🙂<|im_end|>")
    for skip in (False, True):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out = detok.feed(ids[:3]) + detok.feed(ids[3:7]) + detok.feed(ids[7:]) + detok.flush()
        assert out == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_flushes_incomplete_tail(tok):
    ids = tok.encode("🙂")
    detok = IncrementalDetokenizer(tok)
    assert detok.feed(ids[:1]) == ""
    assert detok.flush() == tok.decode(ids[:1]) == "\ufffd"


def test_incremental_detokenizer_random_byte_tokens(tok):
    """Random ids rich in single-byte tokens (broken UTF-8 mid-stream) in random batches."""
    rng = random.Random(0)
    byte_ids = [i for i in range(tok.vocab_size) if len(tok.id_to_token(i)) == 1]
    for _ in range(60):
        ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(tok.vocab_size) for _ in range(30)]
        detok, out, k = IncrementalDetokenizer(tok), "", 0
        while k < len(ids):
            n = rng.randrange(1, 4)
            out, k = out + detok.feed(ids[k : k + n]), k + n
        assert out + detok.flush() == tok.decode(ids)


def test_hf_folder_tokenizer(tok, tmp_path):
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": {"content": "<|im_end|>"},
                "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}",
            }
        )
    )
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_path(tmp_path)
    assert hf.bos_token_id == 1 and hf.eos_token_ids == (2, 0)
    for text, ids in EXPECTED.items():
        assert hf.encode(text) == ids
    assert hf.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


def test_missing_or_failing_chat_template(tok, tmp_path):
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    hf = Tokenizer.from_path(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        hf.apply_chat_template([{"role": "user", "content": "x"}])
    hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        hf.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed(tok, tmp_path):
    tok._tok.save(str(tmp_path / "tokenizer.json"))
    hf = Tokenizer.from_path(tmp_path)
    for template in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"):
        hf.chat_template = template
        with pytest.raises(ValueError, match="unsafe"):
            hf.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent"):
        Tokenizer.from_path(tmp_path / "absent")
