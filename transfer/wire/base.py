"""The wire's version, its error, and the raw frames messages carry (token ids as little-endian
int32, page hashes as little-endian uint64). No pickle anywhere."""

from __future__ import annotations

import numpy as np

PROTOCOL_VERSION = 19  # 2: cluster_id in KVHandshake and WorkerStats; 3: SWA pages and pool geometry;
# 4: Drain, and draining in WorkerStats
# 5: TokenDelta.stop_token_id/stop_logprob/stop_top_logprobs (the stop token travels with its delta)
# 6: KV events (KvSnapshotRequest, KvEvents, KvSnapshot; WorkerStats.kv_events_port/kv_events_seq) and
#    migration (MigrationOffer, MigrationDeclined, MigrateRequest, MigrationEnded)
# 7: PrefillWithdrawn (a decode worker prefilled the request itself: selective disaggregation)
# 8: KVWriteStarted (prefill -> decode: the write is posted, start polling); with a cluster key the
#    transports' notifications are sealed (transfer/notif_seal.py)
# 9: GenerateRequest.preempt (a request of an API key under its share may displace one that is not)
# 10: QueuedOffer / QueuedMove (a request still waiting for pages, not prefilled, moves to a peer
#     decode worker before its prefill)
# 11: GenerateRequest.resume_output_ids (a continuation: the output a dead worker already streamed)
# 12: SwitchRole / RoleSwitched (a worker changes role at runtime)
# 13: PrefilledLocally (a decode worker prefills a continuation itself: its prefill worker is out of it)
# 14: PrefillRequest.continuation (a continuation's recompute: its computed tokens are counted apart)
# 15: MigrationOffer.draft / MigrateRequest.draft (a moving request's speculative-decoding record)
# 16: TokenDelta.handed_back (a decode worker changing role hands back a request that streamed nothing:
#     the router sends it again without using a retry); PrefillWithdrawn releases a prefill under way
# 17: PrefillFailed.handed_back (a prefill worker changing role gives back a prompt whose KV it has not written)
# 18: PrefilledLocally also for a new request a decode worker prefills itself (selective disaggregation)
# 19: PrefillRequest.answer_router (a one-token request: its prefill worker answers the router itself)


PromptLogprobs = list[tuple[float, list[tuple[int, float]], int] | None]
"""Per prompt token: None for the first, else ``(its logprob, the top (id, logprob) pairs, its rank)``
(rank 1 = the most likely token), under the raw distribution given the tokens before it."""


class ProtocolError(ValueError):
    """A frame set that is not a valid message of this protocol version."""


def ids_frame(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def frame_ids(frame: bytes) -> list[int]:
    if len(frame) % 4:
        raise ProtocolError(f"token frame of {len(frame)} bytes is not a whole number of int32")
    return np.frombuffer(frame, dtype="<i4").tolist()


def hashes_frame(hashes) -> bytes:
    """Page hashes as a little-endian uint64 frame."""
    return np.asarray(hashes, dtype="<u8").tobytes()


def frame_hashes(frame: bytes) -> list[int]:
    if len(frame) % 8:
        raise ProtocolError(f"hash frame of {len(frame)} bytes is not a whole number of uint64")
    return np.frombuffer(frame, dtype="<u8").tolist()
