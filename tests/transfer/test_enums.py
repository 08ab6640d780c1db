"""The string enums (roles, finish reasons, request phases, retract releases) keep the strings the
wire, metrics labels and JSON always carried."""

from __future__ import annotations

import json

from engine.request import Phase, Release
from transfer.wire.enums import FinishReason, Role
from transfer.wire.protocol import TokenDelta, WorkerStats, decode, encode


def test_enums_keep_their_strings_on_the_wire_and_in_json():
    assert [str(r) for r in Role] == ["colocated", "prefill", "decode", "router"]
    assert Role.DECODE == "decode" and {"decode": 1}[Role.DECODE] == 1 and f"{Role.PREFILL}" == "prefill"
    assert (
        json.dumps({"r": Role.ROUTER, "f": FinishReason.LENGTH, "p": Phase.RUNNING, "x": Release.OFFLOAD})
        == '{"r": "router", "f": "length", "p": "running", "x": "offload"}'
    )
    stats = WorkerStats(worker_id="d0", role="decode", model="m", capacity_tokens=1, max_model_len=1, page_size=1)
    kind, header = encode(stats)
    assert json.loads(header)["role"] == "decode"
    back, _ = decode([kind, header])
    assert back.role is Role.DECODE and back == stats
    delta = TokenDelta.failed("r", "gone", 503)
    assert json.loads(delta.model_dump_json())["finish_reason"] == "abort"
    assert TokenDelta(rid="r", finish_reason="stop").finish_reason is FinishReason.STOP
    assert not FinishReason.ABORT.completed and FinishReason.STOP.completed
