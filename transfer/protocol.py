"""Typed, versioned control messages over ZMQ multipart frames. No pickle anywhere.

Wire form: ``[kind, header_json, *raw_frames]``. ``kind`` is the ASCII name of the header model;
``header_json`` is the model's JSON (with ``version``); raw frames carry token ids as
little-endian int32 arrays (``ids_frame``/``frame_ids``). ``decode`` refuses unknown kinds and
versions with ``ProtocolError`` naming what it got and what it supports.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from engine.sampling import SamplingParams

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A frame set that is not a valid message of this protocol version."""


class Message(BaseModel):
    """Base of every control message. ``frames`` says how many raw frames follow the header."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int = PROTOCOL_VERSION
    n_frames: ClassVar[int] = 0


# ---- router -> worker ---------------------------------------------------------------------
class GenerateRequest(Message):
    """Start a request. Frame 0: prompt token ids (int32)."""

    rid: str
    params: SamplingParams
    n_frames: ClassVar[int] = 1


class AbortRequest(Message):
    rids: list[str]
    reason: str = "aborted by client"


class StatsRequest(Message):
    """Ask for a ``WorkerStats`` reply (health checks and /metrics)."""

    nonce: int = 0


class Shutdown(Message):
    pass


# ---- worker -> router ---------------------------------------------------------------------
class TokenEntry(BaseModel):
    """One request's new tokens in a ``TokenBatch``; its ids are the next ``n`` of the frame."""

    model_config = ConfigDict(extra="forbid")
    rid: str
    n: int
    logprobs: list[float | None] = []
    top_logprobs: list[list[tuple[int, float]] | None] = []
    finish_reason: str | None = None
    error: str | None = None
    error_status: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


class TokenBatch(Message):
    """All token events of one scheduler step. Frame 0: the entries' ids concatenated."""

    entries: list[TokenEntry]
    n_frames: ClassVar[int] = 1


class WorkerStats(Message):
    """Worker identity, capacity and counters (``counters``: cumulative, ``gauges``: current)."""

    nonce: int = 0
    worker_id: str
    role: str
    model: str
    capacity_tokens: int
    max_model_len: int
    page_size: int
    ready: bool = True
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}


MESSAGES: dict[str, type[Message]] = {
    cls.__name__: cls for cls in (GenerateRequest, AbortRequest, StatsRequest, Shutdown, TokenBatch, WorkerStats)
}


def ids_frame(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def frame_ids(frame: bytes) -> list[int]:
    if len(frame) % 4:
        raise ProtocolError(f"token frame of {len(frame)} bytes is not a whole number of int32")
    return np.frombuffer(frame, dtype="<i4").tolist()


def encode(msg: Message, *frames: bytes) -> list[bytes]:
    if len(frames) != msg.n_frames:
        raise ProtocolError(f"{type(msg).__name__} takes {msg.n_frames} raw frames, got {len(frames)}")
    return [type(msg).__name__.encode(), msg.model_dump_json().encode(), *frames]


def decode(parts: list[bytes]) -> tuple[Message, list[bytes]]:
    """Parse ``[kind, header, *frames]``; raises ``ProtocolError`` with a clear reason."""
    if len(parts) < 2:
        raise ProtocolError(f"expected [kind, header, ...] frames, got {len(parts)} frame(s)")
    kind = bytes(parts[0]).decode(errors="replace")
    cls = MESSAGES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}; known: {', '.join(MESSAGES)}")
    try:
        import json

        header = json.loads(bytes(parts[1]))
    except ValueError as e:
        raise ProtocolError(f"{kind}: header is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("version") != PROTOCOL_VERSION:
        got = header.get("version") if isinstance(header, dict) else None
        raise ProtocolError(f"{kind}: protocol version {got!r} not supported (this side speaks {PROTOCOL_VERSION})")
    try:
        msg = cls.model_validate(header)
    except ValidationError as e:
        raise ProtocolError(f"{kind}: invalid header: {e}") from None
    frames = [bytes(f) for f in parts[2:]]
    if len(frames) != cls.n_frames:
        raise ProtocolError(f"{kind} takes {cls.n_frames} raw frames, got {len(frames)}")
    return msg, frames
