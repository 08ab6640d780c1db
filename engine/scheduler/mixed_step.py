"""Mixed steps: one forward carries the running decodes plus a chunk of prefill.

A step's token budget is ``max_num_batched_tokens``: the decode rows come first (one token each,
every running request), prefill gets what is left (never less than the decode rows), at most
``chunked_prefill_size``; a step with nothing decoding prefills a whole chunk (``prefill_budget``). On a CPU the
win is in the linear layers: the decode rows ride in the prefill chunk's GEMMs instead of paying
a weight-bound forward of their own after it, and they never wait behind a prefill step.

The piece is the same for every scheduler that both decodes and prefills locally (the colocated
worker today; a decode worker that prefills short prompts itself later). The caller runs the
first half of the decode step (``RunningBatch.prepare_decode``: retract if short, pages for the
step), deals with its victims (colocated: back to the waiting queue) and then calls
``MixedStep.run``, which admits the prefill chunk against the pages that are left and runs the
one forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from configs.scheduler import SchedulerConfig
from engine.request import Request
from engine.scheduler.admission import Admission, ExtendItem
from engine.scheduler.running_batch import DecodeResult, RunningBatch
from transfer.wire.protocol import TokenDelta


def prefill_budget(cfg: SchedulerConfig, decode_rows: int) -> int:
    """Prefill tokens a step with ``decode_rows`` decode rows may add (``cfg`` after ``for_device``).

    Nothing decoding: ``chunked_prefill_size`` (nobody waits on the step). Otherwise the rows
    ``max_num_batched_tokens`` leaves after the decode rows, but never fewer than the decode rows
    (prefill keeps at least half of a step however many decode), at most ``chunked_prefill_size``.
    Why the step is small while requests decode: every decode row waits for the whole step, so its
    length is their inter-token latency. A shorter step cuts the ITL tail at little cost in output
    tok/s until per-step overhead dominates; the CPU default sits there
    (``python -m benchmarks.mixed_ab --max-num-batched-tokens N`` measures a value)."""
    if decode_rows == 0:
        return cfg.chunked_prefill_size
    return min(cfg.chunked_prefill_size, max(cfg.max_num_batched_tokens - decode_rows, decode_rows))


@dataclass
class MixedResult:
    """What one mixed step did: ``decode`` as ``RunningBatch.decode_step`` reports it (its
    ``retracted``/``aborted`` filled by ``prepare_decode``), the prefill ``items`` it computed and
    the deltas of those that completed their prompt (``extended``: they are RUNNING or FINISHED
    now and not yet in the running batch)."""

    decode: DecodeResult
    items: list[ExtendItem] = field(default_factory=list)
    extended: list[tuple[Request, TokenDelta]] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        """True when the step ran a forward."""
        return bool(self.items or self.decode.tokens)


class MixedStep:
    """Admits a prefill chunk beside ``running``'s decode rows and runs both in one forward."""

    def __init__(self, running: RunningBatch, admission: Admission, cfg: SchedulerConfig) -> None:
        self.running = running
        self.admission = admission
        self.cfg = cfg

    def run(self, prepared: DecodeResult, waiting: deque[Request]) -> MixedResult:
        """The step after ``prepared = running.prepare_decode(...)``: every request still running
        decodes one token; waiting requests (and the chunked one) are admitted into the tokens
        left (``prefill_budget``), leaving ``waiting``. Counts ``extend_steps`` (a step with
        prefill), ``mixed_steps`` (with both) and the prefill tokens; the decode side counts as
        ``decode_step`` does."""
        rows = list(self.running.reqs)
        res = MixedResult(prepared)
        res.items = self.admission.select(waiting, rows, self.running.ratio.value, prefill_budget(self.cfg, len(rows)))
        if not rows and not res.items:
            return res
        stats = self.running.stats
        if res.items:
            stats.extend_steps += 1
            stats.prefill_computed_tokens += sum(it.length for it in res.items)
            stats.mixed_steps += bool(rows)
        decoded, res.extended = self.running.executor.mixed(rows, res.items)
        if rows:
            self.running.absorb(prepared, decoded)
        return res
