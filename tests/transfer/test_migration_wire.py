"""The migration messages carry a moving request's speculative-decoding record (``DraftRecord``) through
the wire unchanged, refuse a malformed one, and a peer of the protocol before it is refused by version."""

from __future__ import annotations

import json

import pytest

from transfer.wire.protocol import (
    PROTOCOL_VERSION,
    DraftRecord,
    MigrateRequest,
    MigrationOffer,
    ProtocolError,
    decode,
    encode,
    ids_frame,
)
from transfer.wire.sampling_params import SamplingParams

RECORD = DraftRecord(hits=3.25, misses=0.5, wait=2, backoff=4)


def offer(draft: DraftRecord | None) -> MigrationOffer:
    return MigrationOffer(rid="r", n_tokens=9, pages=3, prompt_len=4, params=SamplingParams(), draft=draft)


@pytest.mark.parametrize("draft", [RECORD, None])
def test_the_record_crosses_the_wire_in_both_migration_messages(draft):
    params = SamplingParams(max_new_tokens=8, temperature=0)
    request = MigrateRequest(rid="r", params=params, room=1, source_addr="a", prompt_len=4, n_tokens=9, draft=draft)
    for msg in (offer(draft), request):
        back, frames = decode(encode(msg, ids_frame(list(range(10)))))
        assert back == msg and back.draft == draft and len(frames) == 1


@pytest.mark.parametrize(
    "bad", [dict(hits=-1.0), dict(misses=float("nan")), dict(hits=float("inf")), dict(wait=-1), dict(extra=1)]
)
def test_a_malformed_record_is_refused(bad):
    kind, header, frame = encode(offer(RECORD), ids_frame([1]))
    doc = json.loads(header)
    doc["draft"] |= bad
    with pytest.raises(ProtocolError, match="invalid header"):
        decode([kind, json.dumps(doc).encode(), frame])


def test_a_peer_of_the_previous_protocol_is_refused():
    kind, header, frame = encode(offer(None), ids_frame([1]))
    doc = json.loads(header) | {"version": PROTOCOL_VERSION - 1}
    with pytest.raises(ProtocolError, match="protocol version"):
        decode([kind, json.dumps(doc).encode(), frame])
