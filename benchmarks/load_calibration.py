"""The bursty benchmark's load relative to the host: what ONE worker of each kind sustains.

Constant arrival rates cannot stress every split on hosts of different speed (an idle host met
every SLO at rates a loaded one could not serve). So before the trace a short probe on the first
launched cluster measures, on the phase kinds' own prompts:

- **prefill**: prefill-heavy prompts sent one at a time (answers of 2 tokens), after
  ``PREFILL_WARM_PROMPTS`` of the same length range whose TTFTs are dropped: one prefill worker
  serves one prompt per median TTFT, so it sustains ``1 / median TTFT`` req/s (its prompt tokens/s
  = mean prompt / median TTFT). The TTFT holds the KV hand-off and the first decode step too: the
  figure is what the cluster gets from one prefill worker, not its bare forward speed. The warm-up
  and the median keep a cluster's first long prompts out of the figure: a probe of three prompts
  averaged right after the short warm-up read one prefill worker at 357 prompt tokens/s (TTFT
  5.1 s) on an idle host where the same worker then served the trace's prompts in 1.3-1.7 s, so
  its "1.4x" load overloaded nothing.
- **decode**: decode-heavy requests run together at 1 and at ``rows`` rows per decode worker; the
  TPOT p50 of each gives a step time affine in rows, ``step(b) = per_row * (fixed_rows + b)``. One
  decode worker sustains ``b / (answer * step(b))`` req/s (Little's law: ``b`` rows each held for
  ``answer`` steps) at the most rows ``b`` that keep ``step(b)`` within the TPOT SLO and fit its KV
  pool (``kv_pool_tokens / (prompt + answer)``).

A phase's rate is then ``load x`` that capacity: ``--prefill-load 1.4`` overloads one prefill
worker by 40 % and leaves two at 70 % each. The probe's figures are noisy on a shared host (a few
requests); they set the load's scale, the trace itself is the measurement.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import asdict, dataclass

from bench.serve.client import ClientConfig, RequestResult
from bench.serve.runner import closed_loop
from bench.serve.workload import LengthCounter, PromptShape, RequestSpec, make_requests
from benchmarks.bursty_trace import DECODE, PREFILL, PhaseKind

# Prefill-heavy prompts sent (one at a time) before the timed ones and dropped: a cluster's first
# long prompts pay what the trace's do not (see the module docstring).
PREFILL_WARM_PROMPTS = 2

# The most rows' worth of per-row cost a step's fixed part may be when the probe's two step times
# are too close to fit (noise): the embedded model's projections measured about 10 on an idle host.
MAX_FIXED_ROWS = 10.0


@dataclass(frozen=True)
class StepFit:
    """A decode step affine in its rows: ``per_row_s * (fixed_rows + rows)`` seconds."""

    per_row_s: float
    fixed_rows: float

    def step_s(self, rows: float) -> float:
        return self.per_row_s * (self.fixed_rows + rows)


def fit_step(rows_a: float, step_a: float, rows_b: float, step_b: float) -> StepFit:
    """The affine step through (``rows_a``, ``step_a``) and (``rows_b``, ``step_b``), ``rows_b`` >
    ``rows_a`` >= 1, steps > 0. Noise that makes the larger batch no slower (or its fixed part over
    ``MAX_FIXED_ROWS``) is clamped: the fixed part is taken as ``MAX_FIXED_ROWS`` through the
    larger batch's step, so the capacity is never over-stated by a flat fit."""
    if not rows_b > rows_a >= 1 or not (step_a > 0 and step_b > 0):
        raise ValueError(f"need rows_b > rows_a >= 1 and positive steps, got {rows_a, step_a, rows_b, step_b}")
    per_row = (step_b - step_a) / (rows_b - rows_a)
    fixed = step_a / per_row - rows_a if per_row > 0 else float("inf")
    if fixed > MAX_FIXED_ROWS:
        return StepFit(step_b / (MAX_FIXED_ROWS + rows_b), MAX_FIXED_ROWS)
    return StepFit(per_row, max(fixed, 0.0))


@dataclass(frozen=True)
class DecodeCapacity:
    """One decode worker on the decode-heavy requests: its step fit, the rows the TPOT SLO and its
    KV pool allow, and the req/s it sustains at the lower of the two."""

    fit: StepFit
    slo_rows: float
    kv_rows: float
    rows: float
    rate: float


def decode_capacity(fit: StepFit, slo_tpot_s: float, answer_len: int, request_tokens: int, kv_pool_tokens: int):
    """``DecodeCapacity`` of one worker (module docstring); ValueError when one row already misses
    the TPOT SLO or its KV pool does not hold one request."""
    slo_rows = slo_tpot_s / fit.per_row_s - fit.fixed_rows
    kv_rows = kv_pool_tokens / request_tokens
    rows = min(slo_rows, kv_rows)
    if rows < 1:
        raise ValueError(
            f"one decode worker cannot hold one request within the TPOT SLO and its KV pool "
            f"(step at 1 row {fit.step_s(1) * 1000:.1f} ms, SLO rows {slo_rows:.1f}, KV rows {kv_rows:.1f})"
        )
    return DecodeCapacity(fit, slo_rows, kv_rows, rows, rows / (answer_len * fit.step_s(rows)))


@dataclass(frozen=True)
class PrefillCapacity:
    """One prefill worker on the prefill-heavy prompts: the mean prompt, the median TTFT of a prompt
    alone, its prompt tokens/s, the req/s it sustains and every timed prompt's TTFT."""

    prompt_tokens: float
    ttft_s: float
    tokens_per_s: float
    rate: float
    ttfts_s: tuple[float, ...] = ()


def prefill_capacity(prompt_lens: list[int], ttfts_s: list[float]) -> PrefillCapacity:
    """``PrefillCapacity`` from prompts served one at a time (their lengths and TTFTs). The median
    TTFT, not the mean: one slow prompt among a few (a host busy for a moment) moves it by one
    rank, not by its excess over the count."""
    if not ttfts_s or len(prompt_lens) != len(ttfts_s) or min(ttfts_s) <= 0:
        raise ValueError("need one positive TTFT per prompt")
    prompt, ttft = statistics.fmean(prompt_lens), statistics.median(ttfts_s)
    return PrefillCapacity(prompt, ttft, prompt / ttft, 1.0 / ttft, tuple(round(t, 3) for t in ttfts_s))


@dataclass(frozen=True)
class Calibration:
    """The measured capacities (None: that phase's rate was given explicitly) and the cluster probed."""

    probed_on: str
    prefill: PrefillCapacity | None
    decode: DecodeCapacity | None

    def to_dict(self) -> dict:
        return asdict(self)


def calibrated_kinds(
    kinds: dict[str, PhaseKind], cal: Calibration, prefill_load: float, decode_load: float
) -> dict[str, PhaseKind]:
    """``kinds`` with each measured phase's rate set to its load x one worker's capacity (a phase
    whose capacity was not measured keeps its explicit rate)."""
    out = dict(kinds)
    for name, cap, load in ((PREFILL, cal.prefill, prefill_load), (DECODE, cal.decode, decode_load)):
        if cap is not None:
            k = kinds[name]
            out[name] = PhaseKind(k.name, k.input_range, k.output_len, round(load * cap.rate, 4))
    return out


def describe(cal: Calibration, kinds: dict[str, PhaseKind], prefill_load: float, decode_load: float) -> str:
    """The capacities and the rates they set, in a few lines for the table's header."""
    lines = []
    p, d = cal.prefill, cal.decode
    if p is None:
        lines.append(f"prefill-heavy: {kinds[PREFILL].rate:g} req/s (given)")
    else:
        lines.append(
            f"prefill-heavy: {kinds[PREFILL].rate:g} req/s = {prefill_load:g} x one prefill worker "
            f"({p.tokens_per_s:.0f} prompt tok/s, {p.rate:.3f} req/s of {p.prompt_tokens:.0f}-token prompts, "
            f"TTFT alone {p.ttft_s * 1000:.0f} ms, median of {', '.join(f'{t * 1000:.0f}' for t in p.ttfts_s)}; "
            f"probed on {cal.probed_on})"
        )
    if d is None:
        lines.append(f"decode-heavy: {kinds[DECODE].rate:g} req/s (given)")
    else:
        lines.append(
            f"decode-heavy: {kinds[DECODE].rate:g} req/s = {decode_load:g} x one decode worker "
            f"({d.rate:.3f} req/s at {d.rows:.1f} rows: step {d.fit.per_row_s * 1000:.2f} ms/row x "
            f"({d.fit.fixed_rows:.1f} + rows); rows within the TPOT SLO {d.slo_rows:.1f}, in the KV pool "
            f"{d.kv_rows:.1f}; probed on {cal.probed_on})"
        )
    return "\n".join(lines)


def _probe_requests(kind: PhaseKind, n: int, output_len: int, counter: LengthCounter, seed: int) -> list[RequestSpec]:
    """``n`` fresh prompts of ``kind``'s shape (a seed apart from the trace's: no prefix hits)."""
    shape = PromptShape(n, kind.input_range[0], kind.input_range[1], output_len, kind=f"probe {kind.name}")
    return make_requests(shape, counter, random.Random(seed).randrange(2**31), start_index=0)


def _ok(results: list[RequestResult], what: str) -> list[RequestResult]:
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"calibration {what} failed: {bad[0]}")
    return results


def probe(
    cfg: ClientConfig,
    kinds: dict[str, PhaseKind],
    split: tuple[int, int],
    probe_prefill: bool,
    probe_decode: bool,
    *,
    slo_tpot_s: float,
    kv_pool_tokens: int,
    counter: LengthCounter,
    seed: int,
    prompts: int = 4,
    rows: int = 8,
    warmup: list[RequestSpec] = (),
) -> tuple[PrefillCapacity | None, DecodeCapacity | None]:
    """Measure the capacities on a running cluster of ``split`` (prefill, decode workers), after
    ``warmup`` (a cold cluster's first requests are slower) and, for the prefill probe,
    ``PREFILL_WARM_PROMPTS`` untimed prompts of its own length range; the router spreads the
    decode probe's rows evenly over its decode workers."""
    pre = dec = None
    if probe_prefill or probe_decode:
        _ok(asyncio.run(closed_loop(cfg, list(warmup), 1, progress=False)).results, "warm-up")
    if probe_prefill:
        specs = _probe_requests(kinds[PREFILL], PREFILL_WARM_PROMPTS + prompts, 2, counter, seed + 1)
        res = _ok(asyncio.run(closed_loop(cfg, specs, 1, progress=False)).results, "prefill probe")
        timed = slice(PREFILL_WARM_PROMPTS, None)
        pre = prefill_capacity([s.prompt_len for s in specs[timed]], [r.ttft_s for r in res[timed]])
    if probe_decode:
        kind, steps = kinds[DECODE], []
        for i, per_worker in enumerate((1, rows)):
            n = per_worker * split[1]
            specs = _probe_requests(kind, n, kind.output_len, counter, seed + 2 + i)
            res = _ok(asyncio.run(closed_loop(cfg, specs, n, progress=False)).results, "decode probe")
            steps.append(statistics.median(r.tpot_s for r in res))
        fit = fit_step(1, steps[0], rows, steps[1])
        request_tokens = kind.input_range[1] + kind.output_len
        dec = decode_capacity(fit, slo_tpot_s, kind.output_len, request_tokens, kv_pool_tokens)
    return pre, dec
