"""Core lending among the workers of one host's launch.

An unpinned launch of several workers on one host gives each worker a share of the cores as torch
threads (``server.worker.placement``). Under uneven load a share sits idle: in PD mode on a small host the
decode worker waits for a prompt's KV while the prefill worker computes that prompt with half the
machine. With lending (``cluster.core_lending``) the launch's workers share a ledger of one slot
per worker in shared memory (an anonymous ``memfd`` the launcher creates and every worker
inherits, so nothing is left behind): each worker publishes whether it is about to run the model
(``WorkerScheduler.has_model_work``: a decode worker that only reserves pages for a prompt being
prefilled is idle), and a *borrower* that is the only worker with model work runs its step with
every core of the launch instead of its share. The worker loop (``server.worker.loop``) makes
every call here, from its scheduler's state and step reports; schedulers know nothing of lending.

Contract:
- ``publish(busy, queued)`` is called before a worker blocks and before each of its steps, so a peer
  reads a state at most one step old. ``queued``: requests that wait here for something else (a decode
  worker's requests whose KV is being or about to be written) and will run the model once it is in
  (``WorkerScheduler.has_queued_model_work``: one whose only token comes with its KV will not).
- Why "about to run the model" and not "has work": with the latter, a prefill that starts while the
  decode worker is reserving that very prompt's pages finds that worker busy and runs on its own
  share alone, late to its first token.
- ``begin_step()`` picks the step's thread count: ``total`` when this worker may borrow, every
  other slot is idle, and either no KV handoff happened in the last ``handoff_grace_s`` or no other
  slot has ``queued`` requests; else ``own``. The grace covers a decode worker that just received
  KV and is about to be busy but may not have seen it yet: its ``queued`` flag, set since it
  reserved the pages, keeps the borrower off its core until its slot reads busy, so its first decode
  steps are not slowed. A decode worker with nothing to run after the KV lands (back-to-back
  one-token requests: the prefill worker computes the only token) does not hold the borrower back.
  ``handed_off()`` is called for a turn whose ``StepReport`` has handoffs, and such a turn pauses
  before computing (``server.worker.turn``): the compute after a handoff picks its threads in
  the grace.
- A lender that turns busy during a borrower's step shares its core with it until that step ends
  (one prefill chunk); the borrower's next step runs with its own share again.
- Only thread counts change, never affinity. oneDNN builds its kernels per thread count, so a
  borrower warms up at ``total`` threads too before it serves (``thread_counts``).

Who borrows is measured, not assumed (``core_lending``): with ``all`` (the default) the launcher
lets every worker borrow, and each worker times its steps' matmuls at start-up on its own share and
on every core (``server.worker.main.core_lending``), borrowing only at >= 1.1x. A prefill chunk
(compute-bound) gains; a decode step (memory-bound) gains on some machines and loses on others,
hence the measurement. A decode worker whose requests wait for a prefill worker
(``WorkerScheduler.awaits_peer_compute``) does not borrow even if that worker's slot still reads
idle: the prompt is about to be computed there. Without that rule decode borrowing cost output
tok/s at higher concurrency under PD; with it, it gains at every concurrency
(``bench/peers/compare_sequential.sh`` compares them). ``prefill`` keeps decode workers lending
only; ``off`` shares nothing.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SLOT = np.dtype([("busy", "<i4"), ("queued", "<i4"), ("threads", "<i4"), ("loaded", "<i4")])
LENDING_MODES = ("off", "prefill", "all")


def borrows(mode: str, role: str) -> bool:
    """Whether a worker of ``role`` may borrow idle cores under ``core_lending=mode``."""
    if mode not in LENDING_MODES:
        raise ValueError(f"core_lending must be one of {', '.join(LENDING_MODES)}, got {mode!r}")
    return mode == "all" or (mode == "prefill" and role == "prefill")


class CoreLedger:
    """``n`` slots (busy flag, queued flag, threads of the latest step, model loaded) over a shared buffer. Each
    slot is written by its own worker only; 4-byte aligned stores, so readers never see a torn value."""

    def __init__(self, buf) -> None:
        self._buf = buf  # keeps the mapping alive as long as the view
        self.slots = np.frombuffer(buf, dtype=SLOT)

    @classmethod
    def create(cls, n: int) -> tuple[CoreLedger, int]:
        """A fresh ledger of ``n`` idle slots and the memfd holding it (pass it to the workers)."""
        fd = os.memfd_create("pdserve-core-ledger")
        os.ftruncate(fd, n * SLOT.itemsize)
        return cls.open(fd), fd

    @classmethod
    def open(cls, fd: int) -> CoreLedger:
        """Map the ledger behind an inherited ``fd`` (shared: every worker sees every write)."""
        size = os.fstat(fd).st_size
        if size == 0 or size % SLOT.itemsize:
            raise ValueError(f"fd {fd} is not a core ledger ({size} bytes)")
        return cls(mmap.mmap(fd, size))

    def __len__(self) -> int:
        return len(self.slots)

    def set_busy(self, slot: int, busy: bool) -> None:
        self.slots["busy"][slot] = 1 if busy else 0

    def set_queued(self, slot: int, queued: bool) -> None:
        self.slots["queued"][slot] = 1 if queued else 0

    def set_threads(self, slot: int, threads: int) -> None:
        self.slots["threads"][slot] = threads

    def set_loaded(self, slot: int) -> None:
        self.slots["loaded"][slot] = 1

    def wait_all_loaded(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Block until every slot says its worker has loaded its model (True), or ``timeout_s``
        passed (False: a worker that died before loading must not hold the others back)."""
        deadline = time.monotonic() + timeout_s
        while not self.slots["loaded"].all():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def wait_others_idle(self, slot: int, timeout_s: float, poll_s: float = 0.01) -> bool:
        """Block until no other slot reads busy (True), or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.others_idle(slot):
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def others_idle(self, slot: int) -> bool:
        return not self._others_any("busy", slot)

    def others_queued(self, slot: int) -> bool:
        """Whether another slot has requests that will run the model once their KV is in."""
        return self._others_any("queued", slot)

    def _others_any(self, flag: str, slot: int) -> bool:
        column = self.slots[flag]
        return bool(column[:slot].any() or column[slot + 1 :].any())


@dataclass
class CoreLending:
    """One worker's side of the ledger; see the module docstring for the contract."""

    ledger: CoreLedger
    slot: int
    own: int  # this worker's share (threads)
    total: int  # threads while borrowing: every core of the launch (== own: never borrows)
    handoff_grace_s: float = 0.05
    set_threads: Callable[[int], None] | None = None  # default torch.set_num_threads
    clock: Callable[[], float] = time.monotonic
    threads: int = 0  # of the latest step
    borrowed_steps: int = 0
    _quiet_until: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.slot < len(self.ledger):
            raise ValueError(f"core ledger slot {self.slot} outside 0..{len(self.ledger) - 1}")
        if self.set_threads is None:
            import torch

            self.set_threads = torch.set_num_threads
        self.threads = self.own

    @property
    def thread_counts(self) -> tuple[int, ...]:
        """Every thread count a step may run with (warm up at each)."""
        return tuple(sorted({self.own, self.total}))

    def publish(self, busy: bool, queued: bool = False) -> None:
        """This worker's state for its peers. Flags that turn on are written before flags that turn
        off, so a peer never reads both clear while a request moves from queued to busy."""
        if busy:
            self.ledger.set_busy(self.slot, True)
        self.ledger.set_queued(self.slot, queued)
        if not busy:
            self.ledger.set_busy(self.slot, False)

    def handed_off(self) -> None:
        """KV just went to a decode worker: it may be about to be busy, whatever its busy flag says yet
        (for ``handoff_grace_s`` its ``queued`` flag decides)."""
        self._quiet_until = self.clock() + self.handoff_grace_s

    def begin_step(self, yield_to_peers: bool = False) -> int:
        """Set (if changed) and return the thread count of the step about to run. ``yield_to_peers``:
        another worker is about to compute for this one (``WorkerScheduler.awaits_peer_compute``),
        so this step keeps its own share even if that peer's slot still reads idle."""
        borrow = (
            self.total > self.own
            and not yield_to_peers
            and self.ledger.others_idle(self.slot)
            and (self.clock() >= self._quiet_until or not self.ledger.others_queued(self.slot))
        )
        n = self.total if borrow else self.own
        if n != self.threads:
            self.set_threads(n)
            self.threads = n
        self.ledger.set_threads(self.slot, n)
        self.borrowed_steps += borrow
        return n

    def stats(self) -> tuple[dict[str, float], dict[str, float]]:
        """(counters, gauges) for the worker's heartbeat."""
        return {"borrowed_core_steps": float(self.borrowed_steps)}, {"torch_threads": float(self.threads)}
