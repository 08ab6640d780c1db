"""The client side of a failover check: streamed completions recorded whole (per choice its text,
token ids, logprobs and finish reason; the usage; every error chunk; the largest gap between two
chunks that carried tokens), a mixed load of such requests, and how to find and time a worker's
death (its pid among the launcher's children, the router's "is dead" log line).

Shared by the failover end-to-end tests, the chaos row and ``benchmarks.failover``: each compares
a run with a fault against a fault-free run of the same bodies, so what is recorded is what the
client would compare."""

from __future__ import annotations

import datetime
import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.harness.subprocess_server import LaunchedServer

#: A JSON schema whose matcher must carry on across a failover (a long string keeps it generating).
STORY = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string", "minLength": 400}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


class StreamRecord:
    """What one streamed completion delivered; ``add`` takes each SSE line in order."""

    def __init__(self, on_chunk: Callable[[dict], None] | None = None) -> None:
        self.out: dict = {"choices": {}, "usage": None, "errors": [], "gap_s": 0.0, "tokens": 0, "status": None}
        self._last: float | None = None
        self._on_chunk = on_chunk

    def add(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk, out = json.loads(line[6:]), self.out
        if "error" in chunk:
            out["errors"].append(chunk["error"])
            return
        out["usage"] = chunk.get("usage") or out["usage"]
        now = time.monotonic()
        if any(c.get("token_ids") for c in chunk.get("choices", [])):
            out["gap_s"] = max(out["gap_s"], now - self._last) if self._last is not None else 0.0
            self._last = now
        for c in chunk.get("choices", []):
            mine = out["choices"].setdefault(
                c["index"], {"text": "", "token_ids": [], "logprobs": [], "finish_reason": None, "prompt_logprobs": []}
            )
            if c.get("prompt_logprobs") is not None:  # each time they come (once, with the opening chunk)
                mine["prompt_logprobs"].append(c["prompt_logprobs"])
            mine["text"] += c.get("text", "")
            mine["token_ids"] += c.get("token_ids") or []
            mine["logprobs"] += (c.get("logprobs") or {}).get("token_logprobs") or []
            mine["finish_reason"] = c.get("finish_reason") or mine["finish_reason"]
            out["tokens"] += len(c.get("token_ids") or [])
        if self._on_chunk is not None:
            self._on_chunk(out)


def _streamed(body: dict) -> dict:
    return {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}


def stream(url: str, body: dict, on_chunk: Callable[[dict], None] | None = None) -> dict:
    """A streamed completion (HTTP 200 asserted): ``StreamRecord.out`` once it ended."""
    rec = StreamRecord(on_chunk)
    with httpx.stream("POST", f"{url}/v1/completions", json=_streamed(body), timeout=300, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        rec.out["status"] = r.status_code
        for line in r.iter_lines():
            rec.add(line)
    return rec.out


async def astream(client: httpx.AsyncClient, body: dict, on_chunk: Callable[[dict], None] | None = None) -> dict:
    """``stream`` on an async client; a non-200 answer or a broken connection is recorded as an error
    (``status`` and ``errors``), never raised, so one failed request does not hide the others."""
    rec = StreamRecord(on_chunk)
    try:
        async with client.stream("POST", "/v1/completions", json=_streamed(body)) as r:
            rec.out["status"] = r.status_code
            if r.status_code != 200:
                rec.out["errors"].append((await r.aread()).decode(errors="replace"))
                return rec.out
            async for line in r.aiter_lines():
                rec.add(line)
    except httpx.HTTPError as e:
        rec.out["errors"].append(f"transport error: {type(e).__name__}: {e}")
    return rec.out


def _usage(u: dict | None) -> dict | None:
    """Usage without ``prompt_tokens_details``: the fault-free run of the same prompts warms the
    prefix cache, so the second run's ``cached_tokens`` differ whether or not a failover happened."""
    return None if u is None else {k: v for k, v in u.items() if k != "prompt_tokens_details"}


def differences(got: dict, ref: dict, logprob_tol: float = 1e-3) -> list[str]:
    """What of ``got`` is not ``ref``'s: "errors", "usage", "choices", or per choice "text", "token_ids",
    "finish_reason", "logprobs" (values within ``logprob_tol`` are equal); empty when the same."""
    out = [
        k
        for k, bad in (
            ("errors", got["errors"] or got["status"] != 200),
            ("usage", _usage(got["usage"]) != _usage(ref["usage"])),
        )
        if bad
    ]
    if sorted(got["choices"]) != sorted(ref["choices"]):
        return [*out, "choices"]
    for i, r in sorted(ref["choices"].items()):
        g = got["choices"][i]
        out += [f"{k}[{i}]" for k in ("text", "token_ids", "finish_reason") if g[k] != r[k]]
        if len(g["logprobs"]) != len(r["logprobs"]) or any(
            abs(a - b) > logprob_tol for a, b in zip(g["logprobs"], r["logprobs"])
        ):
            out.append(f"logprobs[{i}]")
    return out


def same_output(got: dict, ref: dict, logprob_tol: float = 1e-3) -> bool:
    """Whether ``got`` ended without an error with ``ref``'s choices (text, token ids, finish reason,
    logprobs within ``logprob_tol``) and usage (but its cache hits: ``_usage``)."""
    return not differences(got, ref, logprob_tol)


#: The kinds of request a mixed load cycles through, each a sampling setup whose continuation must be exact.
MIXES: dict[str, dict] = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.8, "seed": 1234},
    "json_schema": {
        "temperature": 0.7,
        "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}},
    },
    "n2": {"temperature": 0.9, "seed": 99, "n": 2},
    "logprobs": {"temperature": 0, "logprobs": 2},
    # a stop string rarely met: the router's held-back text must carry on across the failover
    "stop": {"temperature": 0.6, "seed": 5, "stop": [" Chapter", "\n\n\n"]},
}


def mixed_bodies(count: int, max_tokens: int, words: list[str], seed: int = 0) -> list[tuple[str, dict]]:
    """``count`` completion bodies of ``max_tokens`` tokens (``ignore_eos``), cycling through ``MIXES``,
    each on its own seeded prompt of 8 to 24 of ``words``; (mix name, body) pairs."""
    rng = random.Random(seed)
    names = sorted(MIXES)
    out = []
    for i in range(count):
        name = names[i % len(names)]
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(8, 24)))
        out.append((name, {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **MIXES[name]}))
    return out


def worker_pid(server: LaunchedServer, worker_id: str) -> int:
    """The pid of the launcher's child that runs ``worker_id`` (its ``--worker-id`` argument)."""
    for pid in server.worker_pids():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--worker-id" in cmd and cmd[cmd.index(b"--worker-id") + 1] == worker_id.encode():
            return pid
    raise LookupError(worker_id)


_DEAD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ERROR \S+: worker (\S+) is dead", re.M)


def dead_at(log: str, worker_id: str, after: float) -> float | None:
    """Wall-clock time (``time.time()`` scale, millisecond resolution) of the router's first
    ``worker <id> is dead`` log line at or after ``after`` - 1 ms; None if there is none. The
    launcher logs with ``%(asctime)s`` (local time), which this reads back as local time."""
    for stamp, wid in _DEAD.findall(log):
        t = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if wid == worker_id and t >= after - 0.001:
            return t
    return None


def first_difference(got: dict, ref: dict) -> tuple[int, int] | None:
    """(choice index, first output index) where ``got``'s token ids leave ``ref``'s; None if none do."""
    for i, r in sorted(ref["choices"].items()):
        g = got["choices"].get(i, {"token_ids": []})["token_ids"]
        k = next((j for j, (a, b) in enumerate(zip(g, r["token_ids"])) if a != b), min(len(g), len(r["token_ids"])))
        if g != r["token_ids"]:
            return i, k
    return None
