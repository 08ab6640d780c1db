"""The KV transfer's completion notification (JSON bytes beside the KV, not a ZMQ message)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from transfer.wire.base import PROTOCOL_VERSION, PromptLogprobs


class TransferManifest(BaseModel):
    """Travels as the transfer's completion notification (JSON bytes, not a ZMQ message).

    ``checksum`` is CRC32 over the other fields; the decode side recomputes it and checks every
    field against what it asked for before it uses the KV.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    version: int = PROTOCOL_VERSION
    rid: str
    room: int
    generation: int
    n_tokens: int
    n_pages: int
    swa_pages: int = 0
    swa_missing: list[int] = []  # logical pages whose SWA KV the prefill side no longer had
    first_token: int
    first_logprob: float | None = None
    first_top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # generation 0 with params.prompt_logprobs only
    checksum: int = 0

    def _payload(self) -> bytes:
        return self.model_dump_json(exclude={"checksum"}).encode()

    def sealed(self) -> TransferManifest:
        import zlib

        return self.model_copy(update={"checksum": zlib.crc32(self._payload())})

    def verify(self) -> bool:
        import zlib

        return zlib.crc32(self._payload()) == self.checksum
