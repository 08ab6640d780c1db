"""One turn of a worker loop (or the in-process PD harness): ``settle``, then ``step``, except
right after KV handoffs.

A turn whose ``settle`` finished KV handoffs while the scheduler still has work ends there, at
most every other turn: the loop learns that a decode worker is about to run the model (its
``CoreLending.handed_off``) before it picks this worker's threads for the compute
(``CoreLending.begin_step``, next turn), and the next turn steps. Without the pause, the compute
right after a handoff could borrow the core that decode worker is about to need
(``server.worker.core_lending``). The pause does not depend on lending being on.
"""

from __future__ import annotations

from engine.scheduler.base import WorkerScheduler
from engine.scheduler.step_report import StepReport


class Turns:
    """Runs ``scheduler``'s turns; its one piece of state: whether the last turn paused."""

    def __init__(self, scheduler: WorkerScheduler) -> None:
        self.scheduler = scheduler
        self.paused = False  # the last turn finished handoffs and skipped its step

    def run(self) -> StepReport:
        """One turn's report (``settle``'s and, unless it paused, ``step``'s, folded in order)."""
        report = self.scheduler.settle()
        if report.handoffs and self.scheduler.has_work and not self.paused:
            self.paused = True
            return report
        self.paused = False
        return report.extend(self.scheduler.step())
