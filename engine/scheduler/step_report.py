"""What one scheduler step hands its worker loop: the ``Outbox`` to send and facts about the step
that the loop acts on (core lending, ``server.worker.core_lending``). The outbox stays pure
messages; nothing here decides anything."""

from __future__ import annotations

from dataclasses import dataclass, field

from transfer.wire.outbox import Outbox


@dataclass
class StepReport:
    """The result of ``WorkerScheduler.settle`` or ``step``: ``outbox`` (what to send) and
    ``handoffs``, the requests whose KV the call finished writing into decode workers (each of
    those is about to run the model, whatever it has told its peers yet)."""

    outbox: Outbox = field(default_factory=Outbox)
    handoffs: int = 0

    def extend(self, later: StepReport) -> StepReport:
        """Fold a later report of the same turn into this one (outboxes in order)."""
        self.outbox.extend(later.outbox)
        self.handoffs += later.handoffs
        return self
