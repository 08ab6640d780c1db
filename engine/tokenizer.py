"""Tokenizer for GGUF files and HuggingFace folders, chat templates, streaming detokenization.

GGUF files carry a byte-level BPE vocabulary (``tokenizer.ggml.*`` metadata). We rebuild it
with the ``tokenizers`` library using llama.cpp's pre-tokenizer for the file's
``tokenizer.ggml.pre`` type, so ids match llama.cpp's tokenization.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types matched as whole tokens in text
_SUPPORTED_GGUF_MODELS = ("gpt2",)
# llama.cpp pre-tokenizer types that isolate each \p{N} before GPT-2's regex.
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_QWEN2_LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{DIGITS}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre type -> full-split regex applied before a regex-less ByteLevel.
_REGEX_PRES = {
    "qwen2": _QWEN2_LLAMA3_REGEX.replace("{DIGITS}", ""),
    "llama-bpe": _QWEN2_LLAMA3_REGEX.replace("{DIGITS}", "{1,3}"),
}
_GPT2_PRES = ("gpt-2",)


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    Attributes: ``bos_token_id`` (int | None), ``eos_token_ids`` (tuple of int),
    ``vocab_size`` (int, including added/special tokens), ``chat_template`` (str | None).
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None = None,
        add_bos: bool = False,
    ) -> None:
        """Wrap a ``tokenizers.Tokenizer``; prefer :meth:`from_path`."""
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template: tuple[str, Any] | None = None  # (source, compiled)

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer as its JSON text (what grammar engines build their vocabulary from)."""
        return self._tok.to_str()

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Build from a ``.gguf`` file or a HF folder (``tokenizer.json`` + configs).

        Raises ``FileNotFoundError`` naming a missing path/file and ``ValueError`` for an
        unsupported or malformed tokenizer.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer path does not exist: {path}")
        return _from_hf_folder(path) if path.is_dir() else _from_gguf(path)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) map
        to their single id. With ``add_special_tokens`` a BOS is prepended only if the model
        asks for one (SmolLM2 does not)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid/incomplete UTF-8 becomes U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of the exact vocabulary string ``token`` or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary string of ``token_id`` (byte-level form) or None."""
        return self._tok.id_to_token(token_id)

    def save_hf_folder(self, folder: str | Path) -> Path:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (BOS/EOS, chat template) into
        ``folder`` so that transformers' ``AutoTokenizer`` loads this tokenizer offline (tools
        such as guidellm and aiperf count tokens with it). Returns ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(folder / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": self.chat_template,
            "bos_token": self._token_text(self.bos_token_id) or None,
            "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None) or None,
            "add_bos_token": self.add_bos,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        return folder

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, extra: dict[str, Any] | None = None
    ) -> str:
        """Render ``messages`` (``{"role", "content"}`` dicts) with the model's Jinja chat
        template in a sandbox; ``extra`` adds template variables (e.g. ``documents``), never
        replacing the ones set here. Raises ``ValueError`` if the model has no template or the
        template raises."""
        from jinja2.exceptions import TemplateError

        try:
            return self._compiled_template().render(
                {
                    **(extra or {}),
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": self._token_text(self.bos_token_id),
                    "eos_token": self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
                }
            )
        except TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    def _token_text(self, token_id: int | None) -> str:
        """Surface text of a special token id ('' when None)."""
        return "" if token_id is None else self._tok.decode([token_id], skip_special_tokens=False)

    def _compiled_template(self):
        """Compile (once per source) the chat template in a sandboxed Jinja environment."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; format the prompt yourself")
        if self._template is None or self._template[0] != self.chat_template:
            self._template = (self.chat_template, _jinja_env().from_string(self.chat_template))
        return self._template[1]


class IncrementalDetokenizer:
    """Streaming decode: :meth:`feed` returns only newly completed text.

    Text whose tail is an incomplete UTF-8 sequence (decodes to U+FFFD) is held back until
    later tokens complete it; :meth:`flush` returns whatever is left. The concatenation of
    all returned pieces equals ``tokenizer.decode(all_ids, skip_special_tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        """Start an empty stream for ``tokenizer``."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: decoding from here reproduces the emitted tail
        self._read = 0  # ids before this are already emitted
        self._prefix_text = ""

    def feed(self, ids: Iterable[int]) -> str:
        """Append ``ids``; return the text they completed ('' if still incomplete)."""
        self.ids.extend(int(i) for i in ids)
        text = self._tok.decode(self.ids[self._prefix :], self._skip)
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Return all not yet emitted text, incomplete sequences included (end of stream)."""
        text = self._tok.decode(self.ids[self._prefix :], self._skip)
        return self._advance(text)

    def _advance(self, text: str) -> str:
        """Emit ``text`` past the known prefix and slide the window to the current end."""
        new = text[len(self._prefix_text) :]
        self._prefix_text = self._tok.decode(self.ids[self._read :], self._skip)
        self._prefix, self._read = self._read, len(self.ids)
        return new


# ----------------------------------------------------------------------------- helpers


def _jinja_env():
    """Sandboxed Jinja environment configured like HF chat templating."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env


def _gguf_pre_tokenizer(pre: str):
    """llama.cpp's pre-tokenizer for GGUF ``tokenizer.ggml.pre`` as a tokenizers pipeline.

    ``smollm`` (and other StarCoder-style types) isolate every ``\\p{N}`` char before the
    GPT-2 regex; ``qwen2``/``llama-bpe`` use their own regex; ``gpt-2`` is plain GPT-2.
    Raises ValueError for other types.
    """
    if pre in _REGEX_PRES:
        split = pre_tokenizers.Split(Regex(_REGEX_PRES[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    if pre in _GPT2_PRES:
        return byte_level
    supported = (*_DIGIT_SPLIT_PRES, *_REGEX_PRES, *_GPT2_PRES)
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(supported)}")


def _gguf_backend(tokens: list[str], merges: list[str], types: list[int], pre: str) -> _HFTokenizer:
    """Byte-level BPE ``tokenizers.Tokenizer`` from GGUF vocab metadata."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=pre == "llama-bpe")
    backend = _HFTokenizer(bpe)
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _GGUF_CONTROL]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _GGUF_USER_DEFINED]
    )
    return backend


def _from_gguf(path: Path) -> Tokenizer:
    """Tokenizer from GGUF ``tokenizer.ggml.*`` / ``tokenizer.chat_template`` metadata."""
    from engine.gguf_common import gguf_meta, open_gguf
    from engine.gguf_spm_tokenizer import spm_tokenizer_from_gguf  # SentencePiece-style (Gemma)

    reader = open_gguf(path)  # parsed once for both vocabulary kinds
    if (spm := spm_tokenizer_from_gguf(reader)) is not None:
        backend, fields = spm
        return Tokenizer(backend, **fields)
    model = gguf_meta(reader, "tokenizer.ggml.model")
    if model not in _SUPPORTED_GGUF_MODELS:
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} in {path}; supported: {_SUPPORTED_GGUF_MODELS}")
    tokens = gguf_meta(reader, "tokenizer.ggml.tokens")
    types = gguf_meta(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    backend = _gguf_backend(
        tokens, gguf_meta(reader, "tokenizer.ggml.merges"), types, gguf_meta(reader, "tokenizer.ggml.pre", "default")
    )
    eos = [gguf_meta(reader, k, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return Tokenizer(
        backend,
        bos_token_id=gguf_meta(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=[e for e in eos if e is not None],
        chat_template=gguf_meta(reader, "tokenizer.chat_template", None),
        add_bos=bool(gguf_meta(reader, "tokenizer.ggml.add_bos_token", False)),
    )


def _read_json(path: Path) -> dict:
    """JSON object from ``path``, or {} if the file does not exist."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _special_id(backend: _HFTokenizer, value: Any) -> int | None:
    """Id of a tokenizer_config special-token entry (string or ``{"content": ...}``)."""
    if isinstance(value, dict):
        value = value.get("content")
    return backend.token_to_id(value) if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    """int / list / None -> list of ints."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _chat_template(tok_cfg: dict, folder: Path) -> str | None:
    """Default chat template from tokenizer_config.json (str or named list) or chat_template.jinja."""
    tpl = tok_cfg.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl}
        tpl = named.get("default") or next(iter(named.values()), None)
    jinja_file = folder / "chat_template.jinja"
    if tpl is None and jinja_file.is_file():
        tpl = jinja_file.read_text(encoding="utf-8")
    return tpl


def _from_hf_folder(folder: Path) -> Tokenizer:
    """Tokenizer from ``tokenizer.json`` + ``tokenizer_config.json`` + ``config.json``."""
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"HF model folder has no tokenizer.json: {tok_file}")
    backend = _HFTokenizer.from_file(str(tok_file))
    tok_cfg, cfg = _read_json(folder / "tokenizer_config.json"), _read_json(folder / "config.json")
    bos = _special_id(backend, tok_cfg.get("bos_token"))
    bos = bos if bos is not None else next(iter(_ids(cfg.get("bos_token_id"))), None)
    eos = [_special_id(backend, tok_cfg.get("eos_token")), *_ids(cfg.get("eos_token_id"))]
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=[e for e in eos if e is not None],
        chat_template=_chat_template(tok_cfg, folder),
        add_bos=bool(tok_cfg.get("add_bos_token", False)),
    )
