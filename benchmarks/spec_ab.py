"""Speculative decoding (n-gram) on vs off in one process: decode tok/s, input-grounded or chat.

``python -m benchmarks.spec_ab [--workload repeat|chat] [--rounds 3] [--max-tokens 160]
[--num-speculative-tokens 4] [--ngram-min 2] [--ngram-max 4] [--dtype float32] [--concurrency 1]
[--spec-max-batch-tokens 10]`` loads the model once and runs ``--concurrency`` greedy requests of one prompt
at a time through the colocated scheduler with and without ``--speculative-method ngram``
alternately (off, on, off, on, ...: a shared machine's drift hits both alike): the model repeats a passage it was
given (``repeat``, the default) or writes a story (``chat``: little of the answer is in its context, so few drafts
are accepted). Per run: decode tok/s (output tokens after the first over the time from the first token to the
last), CPU ms per token (``time.process_time``, the figure least moved by other processes on a shared machine),
the decode steps, and for the speculative runs the draft tokens verified and accepted. The outputs of both must
be equal, token for token (the run stops otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.llm import LLM
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from engine.tokenizer import Tokenizer
from transfer.wire.protocol import GenerateRequest
from transfer.wire.sampling_params import SamplingParams

PASSAGE = (
    "The harbour office opens at seven. Ships longer than forty metres must call the pilot station on channel "
    "twelve at least one hour before arrival, give their draught, cargo and estimated time at the outer buoy, and "
    "wait there until a pilot boards. Smaller vessels may enter on their own between sunrise and sunset, keeping "
    "to the starboard side of the channel at no more than six knots. Fuel is sold at the north quay from eight to "
    "five; fresh water is free at every berth. Report any oil on the water to the harbour master at once."
)

WORKLOADS = {
    "repeat": f"{PASSAGE}\n\nRepeat the passage above verbatim.",  # input-grounded: the answer quotes the prompt
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",  # open-ended
}


def decode_once(llm: LLM, prompt: list[int], max_tokens: int, concurrency: int = 1) -> tuple[list[int], float, float]:
    """(output ids of the requests one after the other, decode seconds and CPU seconds of this process:
    first token to last) of ``concurrency`` greedy requests of ``prompt`` at once."""
    sched = llm.scheduler
    rids = [f"r{time.monotonic_ns()}-{i}" for i in range(concurrency)]
    for rid in rids:
        sched.add(
            b"", GenerateRequest(rid=rid, params=SamplingParams(max_new_tokens=max_tokens, temperature=0)), prompt
        )
    ids: dict[str, list[int]] = {rid: [] for rid in rids}
    first, last, cpu0, cpu1 = None, None, 0.0, 0.0
    while sched.has_work:
        for d in sched.step().outbox.deltas:
            now, cpu = time.perf_counter(), time.process_time()
            if first is None:
                first, cpu0 = now, cpu
            last, cpu1 = now, cpu
            ids[d.rid] += d.token_ids
    return [t for rid in rids for t in ids[rid]], last - first, cpu1 - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="repeat")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1, help="requests of the prompt decoding at once")
    ap.add_argument("--spec-max-batch-tokens", type=int, default=None)
    a = ap.parse_args()
    ecfg = EngineConfig(model=a.model, dtype=a.dtype, device="cpu")
    path = resolve_model_path(a.model)
    loaded = (*load_for_engine(path, ecfg), Tokenizer.from_path(path))
    spec = dict(speculative_method="ngram", num_speculative_tokens=a.num_speculative_tokens)
    spec |= dict(spec_max_batch_tokens=a.spec_max_batch_tokens)
    llms = {
        "off": LLM(ecfg, SchedulerConfig(), loaded),
        "on": LLM(ecfg, SchedulerConfig(**spec, ngram_min=a.ngram_min, ngram_max=a.ngram_max), loaded),
    }
    prompt = llms["off"].encode_prompt(WORKLOADS[a.workload], chat=True)
    decode_once(llms["off"], prompt, 8), decode_once(llms["on"], prompt, 8)  # warm up both
    rates: dict[str, list[float]] = {"off": [], "on": []}
    outputs = {}
    for _ in range(a.rounds):
        for name, llm in llms.items():
            steps0 = llm.scheduler.stats.decode_steps
            ids, secs, cpu = decode_once(llm, prompt, a.max_tokens, a.concurrency)
            outputs.setdefault(name, ids)
            assert ids == outputs["off"], "speculative output differs from plain decoding"
            rates[name].append((len(ids) - a.concurrency) / secs)
            print(
                json.dumps(
                    {
                        "mode": name,
                        "tokens": len(ids),
                        "decode_tok_s": round(rates[name][-1], 1),
                        "cpu_ms_per_token": round(1000 * cpu / (len(ids) - a.concurrency), 1),
                        "decode_steps": llm.scheduler.stats.decode_steps - steps0,
                    }
                ),
                flush=True,
            )
    s = llms["on"].scheduler.spec
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        json.dumps(
            {
                "median_decode_tok_s": {k: round(v, 1) for k, v in med.items()},
                "speedup": round(med["on"] / med["off"], 2),
                "draft_tokens": s.draft_tokens,
                "accepted_tokens": s.accepted_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
