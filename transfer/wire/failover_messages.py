"""Decode -> router: where a request's prompt is computed (``decode_worker.scheduler``,
``decode_worker.continuation``). Re-exported by ``transfer.wire.protocol``, which registers it."""

from __future__ import annotations

from transfer.wire.message import Message


class PrefilledLocally(Message):
    """Decode worker -> router: request ``rid`` is prefilled here (a new request taken by selective
    disaggregation: its prompt; a continuation: prompt + output so far), not by its prefill worker,
    which holds nothing of it. From then on only this worker's death fails it: the prefill worker's
    costs it nothing, and a failover after this worker's death has no prefill worker whose cache
    holds the prompt. Sent once, when the request is taken, before any of its tokens."""

    rid: str
