"""The base of every control message (``transfer.wire.protocol`` lists them all)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from transfer.wire.base import PROTOCOL_VERSION


class Message(BaseModel):
    """Base of every control message. ``frames`` says how many raw frames follow the header."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int = PROTOCOL_VERSION
    n_frames: ClassVar[int] = 0
