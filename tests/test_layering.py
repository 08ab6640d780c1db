"""The module boundaries the design relies on: the router and the wire protocol never load torch,
``cache/`` knows nothing of ``engine/``, and token deltas survive the wire unchanged."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from transfer.protocol import ProtocolError, TokenBatch, TokenDelta, decode, encode

ROOT = Path(__file__).resolve().parents[1]


def test_router_and_protocol_do_not_import_torch():
    code = ("import sys, transfer.protocol, server.router.app; "
            "print(sorted(m for m in ('torch', 'engine.sampling', 'engine.model') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_cache_imports_nothing_from_engine():
    offenders = {p.name: sorted(m for m in _imports(p) if m.split(".")[0] == "engine")
                 for p in (ROOT / "cache").glob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_token_batch_round_trip():
    deltas = [TokenDelta(rid="a", token_ids=[5, 6], logprobs=[-0.1, -0.2], top_logprobs=[None, [(6, -0.2)]]),
              TokenDelta.failed("b", "KV pool too small", 500),
              TokenDelta(rid="c", token_ids=[7], finish_reason="length", prompt_tokens=3, cached_tokens=2)]
    msg, frames = decode(encode(*TokenBatch.pack(deltas)))
    assert msg.unpack(frames[0]) == deltas
    assert b"token_ids" not in encode(*TokenBatch.pack(deltas))[1]  # ids travel in the int32 frame


def test_token_batch_counts_must_match_the_frame():
    msg, frame = TokenBatch.pack([TokenDelta(rid="a", token_ids=[1, 2, 3])])
    with pytest.raises(ProtocolError, match="do not match"):
        msg.unpack(frame[:8])
