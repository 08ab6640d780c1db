"""Control messages of a failed-over stream (decode -> router: ``decode_worker.continuation``).
Re-exported by ``transfer.wire.protocol``, which registers them."""

from __future__ import annotations

from transfer.wire.message import Message


class ContinuationLocal(Message):
    """Decode worker -> router: continuation ``rid`` is prefilled here (prompt + output so far), not
    recomputed by its prefill worker, which holds nothing of it. From then on only this worker's
    death fails it over again: the prefill worker's costs it no failover. Sent once, when the
    continuation is taken, before any of its tokens."""

    rid: str
