"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model == "llama"``, e.g. Gemma 3).

llama.cpp tokenizes these like SentencePiece's BPE: spaces become U+2581, control and
user-defined tokens written in the text are matched whole first, then adjacent pieces are merged
best score first (leftmost on ties), and characters outside the vocabulary fall back to
``<0xXX>`` byte tokens. We rebuild that with ``tokenizers``: a BPE model whose merge ranks are
the scores of the merged tokens (every split of a NORMAL token into two NORMAL tokens is a merge),
``byte_fallback``, a ``" " -> "▁"`` normalizer and no pre-tokenizer (merges cross words, as in
SentencePiece). llama.cpp's converter stores user-defined whitespace tokens with real spaces
(``"  "``), so they are matched in the raw text as added tokens. No BOS/space prefix is added
by the normalizer: ``Tokenizer.encode(..., add_special_tokens=True)`` prepends BOS when the file
says ``add_bos_token``.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as _HFTokenizer

from engine.gguf_fast_reader import FastGGUF

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
SPM_MODEL = "llama"
_CHAT_TEMPLATES = {"gemma3": "gemma3_chat_template.jinja"}


def spm_tokenizer_from_gguf(reader: FastGGUF) -> tuple[_HFTokenizer, dict] | None:
    """The backend of the GGUF file ``reader`` parsed (``engine.gguf_common.open_gguf``) and the
    keyword arguments of ``engine.tokenizer.Tokenizer`` when its vocabulary is SentencePiece-style,
    else None (this module does not import ``Tokenizer``).

    Raises ``ValueError`` for malformed vocabulary metadata.
    """
    path = reader.path
    if reader.meta("tokenizer.ggml.model", None) != SPM_MODEL:
        return None
    tokens = reader.meta("tokenizer.ggml.tokens")
    scores = reader.meta("tokenizer.ggml.scores")
    types = reader.meta("tokenizer.ggml.token_type")
    if not len(tokens) == len(scores) == len(types):
        raise ValueError(f"{path}: tokens, scores and token types differ in length")
    unk = reader.meta("tokenizer.ggml.unknown_token_id", None)
    eos = [reader.meta(k, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    if "<end_of_turn>" in tokens:  # Gemma: a chat turn ends with it
        eos.append(tokens.index("<end_of_turn>"))
    return spm_backend(tokens, scores, types, tokens[unk] if unk is not None else None), dict(
        bos_token_id=reader.meta("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=[e for e in eos if e is not None],
        chat_template=reader.meta("tokenizer.chat_template", None) or _bundled_template(reader),
        add_bos=bool(reader.meta("tokenizer.ggml.add_bos_token", True)),
    )


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging, best first.

    Each NORMAL token splits into every (left, right) pair of NORMAL tokens; a merge ranks by
    the merged token's score (higher first), ties by token id.
    """
    normal = {t: i for i, t in enumerate(tokens) if types[i] == _NORMAL}
    ranked = []
    for tok, i in normal.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def spm_backend(tokens: list[str], scores: list[float], types: list[int], unk: str | None) -> _HFTokenizer:
    """``tokenizers.Tokenizer`` for a SentencePiece-style vocabulary (see the module docstring)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    bpe = models.BPE(
        vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    backend = _HFTokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    )
    return backend


def _bundled_template(reader: FastGGUF) -> str | None:
    """The chat template we ship for architectures whose GGUF files carry none (Gemma 3)."""
    name = _CHAT_TEMPLATES.get(reader.meta("general.architecture", ""))
    return (Path(__file__).with_name("templates") / name).read_text(encoding="utf-8") if name else None
