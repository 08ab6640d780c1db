"""The cost of one verify step against one decode step of the same batch, engine level, in one process.

``python -m benchmarks.spec_step [--rows 8] [--drafting 0,1,4,8] [--k 4] [--context 300] [--reps 30]
[--dtype auto]`` loads the model (``--dtype auto``: what a server picks here, bfloat16 on a CPU with
AVX512-BF16), starts ``--rows`` requests on a chat prompt and decodes them to about ``--context`` tokens of
context each, then times forwards of that batch (``ModelRunner.forward``, nothing advanced: the same
positions are rewritten each time), round robin so that a shared machine's drift hits every variant alike:

- ``decode``: the plain step, one token per row (the C decode stack where the model takes it);
- ``ragged D``: ``D`` of the rows carry ``--k`` drafts as small extend rows ``[last, d1 .. dK]`` (a MIXED
  step, EXTEND when every row drafts): the per-layer Python extend path;
- ``flat D``: the same tokens as one-token decode rows, each drafted position a row of its own at its
  position (a DECODE step: the decode stack takes it up to its row limit).

It also times the sampling of a step: one ``Sampler.sample`` over the rows (``decode``) against the plain
rows' call plus ``K + 1`` calls over the drafting rows (``accept``'s calls). Prints the median ms of each
and its ratio to ``decode``; ratios measured side by side are what to read on a shared machine.

``--curve 8,16,..,96 [--dtypes bfloat16,float32] [--clock wall|cpu]`` times instead the step cost curve the
draft rule's cost model is fitted to (``engine.spec.pays``): for each dtype a batch of ``--rows`` requests, and
for each T a DECODE step of T one-token rows (``--rows`` plain rows plus ``T - rows`` drafted positions spread
over the requests as ``verify_rows`` lays them out), every dtype's model in this one process and all steps
round robin (``--clock cpu``: CPU time, for one torch thread on a shared machine). Prints each step's median
and best ms, the marginal ms per token from the step before, and the line ``ms = a + b T`` fitted over each
prefix of the curve (``F = a / b``: the fixed cost in token units).

``--bound [--rows 8] [--curve 8,12,16,24,32,40,48,64] [--bound-k 8] [--curve-ms 8:14.7,..] [--acceptance
0.9,..] [--prefill-share F] [--rule-config JSON]`` prints in one run the best decode speedup any per-row draft
length can reach at ``--rows`` rows and the end-to-end bound it gives (``engine.spec.bound``), from: the step
cost curve at ``--dtype`` (measured here in ``--clock`` time, or given as ``T:ms`` pairs); the per-position
acceptance of the ``grounded`` workload of ``pdserve bench serve`` (``--rows`` of its prompts at once, greedy,
``ignore_eos``, every row drafting ``--bound-k`` tokens each step with the cost rule off, and its coverage:
the share of row-steps with a draft at all; or given; each sitting's row-steps by why they had a draft or not,
``NgramSpeculator.coverage``); the share of a plain sitting that its prefills alone take (the same prompts
with one output token each, over the sitting with all; or given). Beside it, what the rule did in a sitting of
the same prompts (the default one, or with ``--rule-config``'s scheduler fields, e.g.
``'{"spec_max_batch_tokens": 40}'``): tokens and emitted tokens per full step, its speedup on the curve there
and over all the decode steps of the sitting (``sitting_speedup_on_curve``: the tail of few rows included,
``bound.sitting_ms``), and the decode time it measured. Every sitting's outputs must be equal (it stops
otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from bench.serve.workload import WORKLOADS, PromptShape, TokenCounter, make_requests
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.forward_batch import ForwardMode
from engine.llm import LLM
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from engine.model_runner import SeqChunk
from engine.request import Request
from engine.spec import bound
from engine.spec.verify import Coverage
from engine.tokenizer import Tokenizer
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def running_batch(llm: LLM, rows: int, context: int) -> list[Request]:
    """``rows`` running requests of about ``context`` tokens each (decoded there by the scheduler)."""
    sched = llm.scheduler
    prompt = llm.encode_prompt(PROMPT, chat=True)
    # a short max_tokens: the admission reservation of a long one keeps some of the rows waiting
    params = SamplingParams(max_new_tokens=max(1, context - len(prompt)) + 64, temperature=0, ignore_eos=True)
    for i in range(rows):
        sched.add(b"", GenerateRequest(rid=f"s{i}", params=params), prompt)
    for _ in range(max(1, context - len(prompt))):
        sched.step()
    reqs = list(sched.running.reqs)
    assert len(reqs) == rows and not sched.waiting, f"{len(reqs)} of {rows} rows running"
    return reqs


def variants(reqs: list[Request], k: int, drafting: list[int]) -> dict[str, tuple[ForwardMode, list[SeqChunk], int]]:
    """name -> (mode, seqs, num_decode) of each step to time; drafts are the row's last k outputs."""

    def plain(r: Request) -> SeqChunk:
        return SeqChunk([r.output_ids[-1]], r.kv_len, r.kv.pages)

    def draft(r: Request) -> list[int]:
        return r.output_ids[-k:]

    out = {"decode": (ForwardMode.DECODE, [plain(r) for r in reqs], 0)}
    for d in drafting:
        if d == 0:
            continue
        ver, dec = reqs[:d], reqs[d:]
        ragged = [plain(r) for r in dec]
        ragged += [SeqChunk([r.output_ids[-1], *draft(r)], r.kv_len, r.kv.pages, None, k) for r in ver]
        mode = ForwardMode.MIXED if dec else ForwardMode.EXTEND
        out[f"ragged {d}"] = (mode, ragged, len(dec))
        flat = [plain(r) for r in dec]
        flat += [
            SeqChunk([t], r.kv_len + j, r.kv.pages) for r in ver for j, t in enumerate([r.output_ids[-1], *draft(r)])
        ]
        out[f"flat {d}"] = (ForwardMode.DECODE, flat, 0)
    return out


def spread(rows: int, tokens: int) -> list[int]:
    """Drafted positions per row of a ``tokens``-token step of ``rows`` rows: ``tokens - rows`` spread
    evenly, the first rows taking one more."""
    extra = max(0, tokens - rows)
    return [extra // rows + (i < extra % rows) for i in range(rows)]


def curve_step(reqs: list[Request], tokens: int) -> list[SeqChunk]:
    """A DECODE step of ``tokens`` one-token rows over ``reqs``: each request's last token at ``kv_len``
    and its drafted positions after it, as ``verify_rows`` builds them (drafts: its last outputs)."""
    seqs = []
    for r, e in zip(reqs, spread(len(reqs), tokens)):
        toks = [r.output_ids[-1], *(r.output_ids[-e:] if e else [])]
        seqs += [SeqChunk([t], r.kv_len + j, r.kv.pages) for j, t in enumerate(toks)]
    return seqs


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(a, b)`` of ``ms = a + b T`` over ``points`` of (T, ms)."""
    n = len(points)
    mt, mm = sum(t for t, _ in points) / n, sum(m for _, m in points) / n
    b = sum((t - mt) * (m - mm) for t, m in points) / sum((t - mt) ** 2 for t, _ in points)
    return mm - b * mt, b


def curve(a: argparse.Namespace) -> None:
    """The step cost curve of ``--curve`` for every ``--dtypes`` in one process (see the module doc)."""
    sizes = [int(x) for x in a.curve.split(",")]
    runs = {}
    for dtype in a.dtypes.split(","):
        ecfg = EngineConfig(model=a.model, dtype=dtype, device="cpu")
        path = resolve_model_path(a.model)
        llm = LLM(ecfg, SchedulerConfig(), (*load_for_engine(path, ecfg), Tokenizer.from_path(path)))
        reqs = running_batch(llm, a.rows, a.context)
        most = max(spread(a.rows, max(sizes)))
        for r in reqs:  # pages for the drafted positions (written each rep, never advanced into)
            assert llm.scheduler.kv.ensure_pages(r.kv, r.kv_len + 1 + most)
        stack = llm.runner.model.stack
        steps = {t: curve_step(reqs, t) for t in sizes}
        runs[dtype] = (llm, steps, dict(context=reqs[0].kv_len, decode_stack_rows=stack.max_rows if stack else 0))
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    times: dict[tuple[str, int], list[float]] = {(d, t): [] for d in runs for t in sizes}
    for _ in range(a.reps + 2):  # the first two rounds warm up
        for dtype, (llm, steps, _) in runs.items():
            for t, seqs in steps.items():
                start = clock()
                llm.runner.forward(ForwardMode.DECODE, seqs, 0)
                times[dtype, t].append(clock() - start)
    for dtype, (_, _, info) in runs.items():
        ms = [(t, 1000 * statistics.median(times[dtype, t][2:])) for t in sizes]
        head = {"dtype": dtype, "rows": a.rows, "threads": torch.get_num_threads(), "clock": a.clock}
        print(json.dumps(head | info))
        for i, (t, m) in enumerate(ms):
            row = {"dtype": dtype, "tokens": t, "median_ms": round(m, 2)}
            row["best_ms"] = round(1000 * min(times[dtype, t][2:]), 2)
            if i:
                row["marginal_ms_per_token"] = round((m - ms[i - 1][1]) / (t - ms[i - 1][0]), 3)
                lo, slope = fit(ms[: i + 1])
                row |= {"fit_to_here_ms_per_token": round(slope, 3), "fit_to_here_F": round(lo / slope, 1)}
            print(json.dumps(row), flush=True)


def time_curve(llm: LLM, reqs: list[Request], sizes: list[int], reps: int, clock: str) -> list[tuple[int, float]]:
    """Median ms of a DECODE step of each of ``sizes`` tokens over ``reqs`` (``curve_step``), round robin."""
    most = max(spread(len(reqs), max(sizes)))
    for r in reqs:  # pages for the drafted positions (written each rep, never advanced into)
        assert llm.scheduler.kv.ensure_pages(r.kv, r.kv_len + 1 + most)
    steps = {t: curve_step(reqs, t) for t in sizes}
    tick = time.process_time if clock == "cpu" else time.perf_counter
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in range(reps + 2):  # the first two rounds warm up
        for t, seqs in steps.items():
            start = tick()
            llm.runner.forward(ForwardMode.DECODE, seqs, 0)
            times[t].append(tick() - start)
    return [(t, 1000 * statistics.median(times[t][2:])) for t in sizes]


def grounded_prompts(llm: LLM, n: int, seed: int = 0) -> list[list[int]]:
    """The first ``n`` prompts of ``pdserve bench serve --workload grounded --tokenizer default`` (a passage
    and the instruction to repeat it; completions endpoint: no chat template)."""
    w = WORKLOADS["grounded"]
    shape = PromptShape(n, *w.input_range, w.output_range[0], instruction=w.instruction)
    return [llm.encode_prompt(r.prompt) for r in make_requests(shape, TokenCounter(llm.tokenizer), seed)]


def sit(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """All ``prompts`` at once, greedy, ``ignore_eos``, to the end: wall ``seconds`` and ``cpu`` seconds of this
    process, ``first_s`` and ``first_cpu`` (until every request has a token), ``ids`` (outputs in prompt order)
    and ``steps``: (rows, tokens, emitted) of each step after ``first_s`` (tokens: rows plus drafts verified)."""
    sched, spec = llm.scheduler, llm.scheduler.spec
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0, ignore_eos=True)
    rids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        sched.add(b"", GenerateRequest(rid=rid, params=params), p)
    ids: dict[str, list[int]] = {rid: [] for rid in rids}
    steps, first, first_cpu, start, cpu = [], None, None, time.perf_counter(), time.process_time()
    while sched.has_work:
        drafted = spec.draft_tokens if spec else 0
        deltas = sched.step().outbox.deltas
        drafted = (spec.draft_tokens if spec else 0) - drafted
        rows = len({d.rid for d in deltas})
        if first is not None and rows:
            steps.append((rows, rows + drafted, sum(len(d.token_ids) for d in deltas)))
        for d in deltas:
            ids[d.rid] += d.token_ids
        if first is None and all(ids.values()):
            first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
    out = dict(seconds=time.perf_counter() - start, cpu=time.process_time() - cpu, first_s=first, first_cpu=first_cpu)
    return out | dict(ids=[ids[r] for r in rids], steps=steps)


def profile(spec) -> list[float]:
    """Per-position acceptance of ``spec``'s verifies (positions never reached: 0)."""
    return [h / t if t else 0.0 for t, h in zip(spec.position_trials, spec.position_hits)]


def row_steps(cov: Coverage) -> dict:
    """``cov``'s row-step counts by reason and each one's share of them all."""
    counts = dataclasses.asdict(cov)
    total = max(1, sum(counts.values()))
    return {k: [n, round(n / total, 3)] for k, n in counts.items()}


def pairs(text: str) -> list[tuple[int, float]]:
    """``"8:14.7,16:19.3"`` -> ``[(8, 14.7), (16, 19.3)]``."""
    return [(int(t), float(m)) for t, m in (p.split(":") for p in text.split(","))]


def bound_run(a: argparse.Namespace) -> None:
    """``--bound``: the best decode and end-to-end speedup at ``--rows`` (see the module doc), one run."""
    ecfg = EngineConfig(model=a.model, dtype=a.dtype, device="cpu")
    path = resolve_model_path(a.model)
    loaded = (*load_for_engine(path, ecfg), Tokenizer.from_path(path))
    plain = LLM(ecfg, SchedulerConfig(), loaded)
    head = {"dtype": str(plain.runner.dtype).removeprefix("torch."), "threads": torch.get_num_threads()}
    if a.curve_ms:
        points = pairs(a.curve_ms)
    else:
        curve_llm = LLM(ecfg, SchedulerConfig(), loaded)
        sizes = [int(x) for x in (a.curve or "8,12,16,24,32,40,48,64").split(",")]
        points = time_curve(curve_llm, running_batch(curve_llm, a.rows, a.context), sizes, a.reps, a.clock)
        del curve_llm
    curve = bound.StepCurve(tuple(points))
    print(json.dumps(head | {"rows": a.rows, "clock": a.clock, "curve_ms": [[t, round(m, 2)] for t, m in points]}))
    prompts, out_len = grounded_prompts(plain, a.rows), WORKLOADS["grounded"].output_range[0]
    warm = grounded_prompts(plain, a.rows, seed=1)  # other passages: nothing of them is cached for the sittings

    def fresh(**spec) -> LLM:
        llm = LLM(ecfg, SchedulerConfig(**spec), loaded)
        sit(llm, warm, 8)
        return llm

    base = sit(fresh(), prompts, out_len)
    first = {"wall": base["first_s"] / base["seconds"], "cpu": base["first_cpu"] / base["cpu"]}
    print(json.dumps({"plain_sitting_s": round(base["seconds"], 2), "cpu_s": round(base["cpu"], 2)}))
    print(json.dumps({"share_until_every_first_token": {k: round(v, 3) for k, v in first.items()}}))
    share = a.prefill_share
    if share is None:  # a fresh cache: the prompts' prefill is computed, not found
        alone = sit(fresh(), prompts, 1)
        shares = {"wall": alone["seconds"] / base["seconds"], "cpu": alone["cpu"] / base["cpu"]}
        print(json.dumps({"prefill_alone_share": {k: round(v, 3) for k, v in shares.items()}}))
        share = shares["cpu" if a.clock == "cpu" else "wall"]
    ruler = fresh(speculative_method="ngram", **json.loads(a.rule_config))
    ruler.scheduler.spec.coverage = Coverage()  # the warm-up's row-steps are not the sitting's
    ruled = sit(ruler, prompts, out_len)
    assert ruled["ids"] == base["ids"], "speculative output differs from plain decoding"
    print(json.dumps({"rule_row_steps": row_steps(ruler.scheduler.spec.coverage)}))
    coverage = a.coverage
    if a.acceptance:
        acc = [float(x) for x in a.acceptance.split(",")]
    else:
        every = dict(spec_max_batch_tokens=4096, spec_step_fixed_tokens=float("inf"))
        drafting = fresh(speculative_method="ngram", num_speculative_tokens=a.bound_k, **every)
        drafting.scheduler.spec.coverage = Coverage()
        assert sit(drafting, prompts, out_len)["ids"] == base["ids"], "speculative output differs from plain decoding"
        print(json.dumps({"drafter_row_steps": row_steps(drafting.scheduler.spec.coverage)}))
        acc = profile(drafting.scheduler.spec)
        rows_steps = a.rows * (out_len - 1) - drafting.scheduler.spec.accepted_tokens  # each emits 1 + accepted
        coverage = drafting.scheduler.spec.position_trials[0] / rows_steps
    report(curve, a.rows, acc, share, base, ruled, coverage)


def report(
    curve: bound.StepCurve, rows: int, acc: list[float], share: float, base: dict, ruled: dict, coverage: float
) -> None:
    """Print the bound, the rule's choices against it and the end-to-end figures (JSON lines)."""
    top, every = bound.best(curve, rows, acc, coverage), bound.best(curve, rows, acc)
    figures = {"acceptance_per_position": [round(x, 3) for x in acc], "draft_coverage": round(coverage, 3)}
    print(json.dumps(figures | {"prefill_share": round(share, 3)}))
    full = [(t, e) for r, t, e in ruled["steps"] if r == rows]
    plain_ms = curve.cost(rows) / rows
    rule = {"steps": len(full)}
    if full:
        tokens, emitted = sum(t for t, _ in full), sum(e for _, e in full)
        ms = sum(curve.cost(t) for t, _ in full)
        rule |= {"tokens_per_step": round(tokens / len(full), 2), "emitted_per_step": round(emitted / len(full), 2)}
        rule["speedup_on_curve"] = round(emitted / ms * plain_ms, 3)
    whole = bound.sitting_ms(curve, [t for _, t, _ in base["steps"]])
    rule["sitting_steps"] = [len(base["steps"]), len(ruled["steps"])]
    rule["sitting_speedup_on_curve"] = round(whole / bound.sitting_ms(curve, [t for _, t, _ in ruled["steps"]]), 3)
    decode = (base["seconds"] - base["first_s"]) / (ruled["seconds"] - ruled["first_s"])
    rule |= {
        "measured_decode_speedup": round(decode, 3),
        "measured_end_to_end": round(base["seconds"] / ruled["seconds"], 3),
    }
    print(json.dumps({"rule_at_full_batch": rule}))
    best = {"drafts_per_row": list(top.drafts), "tokens": top.tokens, "emitted": round(top.emitted, 2)}
    best |= {"decode_speedup": round(top.speedup, 3), "oracle": round(bound.oracle(curve, rows, acc, coverage), 3)}
    best["decode_speedup_at_full_coverage"] = round(every.speedup, 3)
    best["curve_ceiling"] = round(bound.ceiling(curve, rows), 3)
    print(json.dumps({"best_per_row_choice": best}))
    e2e = {"end_to_end_bound": round(bound.end_to_end(top.speedup, share), 3)}
    e2e["oracle_end_to_end"] = round(bound.end_to_end(bound.oracle(curve, rows, acc, coverage), share), 3)
    e2e["end_to_end_at_full_coverage"] = round(bound.end_to_end(every.speedup, share), 3)
    e2e["decode_speedup_needed_for_1.3x"] = round(bound.decode_needed(1.3, share), 3)
    print(json.dumps(e2e), flush=True)


def time_sampling(llm: LLM, reqs: list[Request], k: int, drafting: list[int], reps: int) -> dict[str, float]:
    """Median ms of a plain step's sampling and of a step with ``d`` drafting rows (``accept``'s calls)."""
    sampler = llm.scheduler.executor.sampler
    V = llm.runner.model_config.vocab_size
    logits = torch.randn(len(reqs) * (k + 1), V)
    params, states = [r.params for r in reqs], [r.sampler_state for r in reqs]
    times: dict[str, list[float]] = {}
    for _ in range(reps):
        t = time.perf_counter()
        sampler.sample(logits[: len(reqs)], params, states)
        times.setdefault("sample decode", []).append(time.perf_counter() - t)
        for d in drafting:
            if d == 0:
                continue
            t = time.perf_counter()
            n = len(reqs) - d
            if n:
                sampler.sample(logits[:n], params[:n], states[:n])
            for _j in range(k + 1):
                sampler.sample(logits[:d], params[n:], states[n:])
            times.setdefault(f"sample {d}", []).append(time.perf_counter() - t)
    return {name: 1000 * statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--drafting", default="0,1,4,8", help="rows of the batch that carry drafts, per variant")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per drafting row")
    ap.add_argument("--context", type=int, default=300, help="tokens of context per row")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--curve", default="", help="step sizes in tokens: time the step cost curve instead")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the models of --curve, one per dtype")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="--curve: wall time, or this process's CPU time (with one torch thread, the figure a shared "
        "machine moves least)",
    )
    ap.add_argument("--bound", action="store_true", help="print the best speedup at --rows (module doc)")
    ap.add_argument("--bound-k", type=int, default=8, help="--bound: most draft tokens per row considered")
    ap.add_argument("--curve-ms", default="", help="--bound: the step cost curve as T:ms pairs (else measured)")
    ap.add_argument("--acceptance", default="", help="--bound: per-position acceptance a1,a2,.. (else measured)")
    ap.add_argument("--coverage", type=float, default=1.0, help="--bound with --acceptance: drafts per row-step")
    ap.add_argument("--rule-config", default="{}", help="--bound: the rule's other scheduler fields (JSON)")
    ap.add_argument("--prefill-share", type=float, default=None, help="--bound: prefill share (else measured)")
    a = ap.parse_args()
    if a.bound:
        return bound_run(a)
    if a.curve:
        return curve(a)
    ecfg = EngineConfig(model=a.model, dtype=a.dtype, device="cpu")
    path = resolve_model_path(a.model)
    llm = LLM(ecfg, SchedulerConfig(), (*load_for_engine(path, ecfg), Tokenizer.from_path(path)))
    drafting = [int(x) for x in a.drafting.split(",")]
    reqs = running_batch(llm, a.rows, a.context)
    for r in reqs:  # pages for the drafted positions (written each rep, never advanced into)
        assert llm.scheduler.kv.ensure_pages(r.kv, r.kv_len + 1 + a.k)
    steps = variants(reqs, a.k, drafting)
    runner = llm.runner
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(a.reps + 2):  # the first two rounds warm up
        for name, (mode, seqs, nd) in steps.items():
            t = time.perf_counter()
            runner.forward(mode, seqs, nd)
            times[name].append(time.perf_counter() - t)
    ms = {name: 1000 * statistics.median(v[2:]) for name, v in times.items()}
    ms |= time_sampling(llm, reqs, a.k, drafting, a.reps)
    base = {"forward": ms["decode"], "sample": ms["sample decode"]}
    print(
        json.dumps(
            {
                "dtype": str(runner.dtype).removeprefix("torch."),
                "threads": torch.get_num_threads(),
                "rows": a.rows,
                "k": a.k,
                "context": reqs[0].kv_len,
                "decode_stack": runner.model.stack is not None,
            }
        )
    )
    for name, v in ms.items():
        ref = base["sample" if name.startswith("sample") else "forward"]
        print(json.dumps({"step": name, "median_ms": round(v, 2), "vs_decode": round(v / ref, 2)}), flush=True)


if __name__ == "__main__":
    main()
