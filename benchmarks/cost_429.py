"""Where a 429's router CPU time goes: the steps a refused ``/v1/completions`` request went through
before the fast 429 (JSON parse, pydantic validation, tokenization) against the check that now
answers it (``Admission.refuse_early`` over a full queue), per prompt length, in microseconds of
one thread (best of ``--repeat`` runs of ``--number`` calls each, so a busy machine inflates it
less). Under overload each of these runs on the router's one event loop, so their sum is also the
delay every other request's 429 waits behind.

``python -m benchmarks.cost_429 [--words 8 40 400] [--queue 32]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import timeit

from engine.model_paths import resolve_model_path
from engine.tokenizer import Tokenizer
from server.router.admission import Admission, AdmissionLimits, Demand, Refused
from server.router.http_util import parse_model, parse_object
from server.router.openai_schemas import CompletionRequest

FAR = 1e18
WORDS = "river stone light garden window".split()


def _full_admission(queue: int) -> tuple[Admission, asyncio.AbstractEventLoop, list[asyncio.Task]]:
    """An admission stage with one slot in use and ``queue`` requests queued (its bound)."""
    adm = Admission(AdmissionLimits(queue), lambda: 1)
    adm.try_grant(Demand("k", 0, 1, 10, FAR))
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(adm.admit(Demand("k", 0, 1, 10, FAR))) for _ in range(queue)]
    loop.run_until_complete(asyncio.sleep(0))
    assert adm.queued_requests == queue
    return adm, loop, tasks


def _best_us(fn, number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, nargs="+", default=[8, 40, 400], help="prompt lengths in words")
    ap.add_argument("--queue", type=int, default=32, help="max_queued_requests (the queue is full at it)")
    ap.add_argument("--number", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    tok = Tokenizer.from_path(resolve_model_path("default"))
    adm, loop, tasks = _full_admission(a.queue)

    def early() -> None:
        try:
            adm.refuse_early("k", 0, 64)
        except Refused:
            return
        raise AssertionError("a full queue must refuse")

    print(
        f"| prompt tokens | json.loads | pydantic | tokenize | refuse_early (queue {a.queue}) |\n|---|---|---|---|---|"
    )
    for words in a.words:
        prompt = " ".join(WORDS[i % len(WORDS)] for i in range(words))
        raw = json.dumps({"prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True}).encode()
        body = parse_object(raw)
        cells = [
            _best_us(f, a.number, a.repeat)
            for f in (
                lambda raw=raw: parse_object(raw),
                lambda body=body: parse_model(CompletionRequest, body),
                lambda prompt=prompt: tok.encode(prompt),
                early,
            )
        ]
        print(f"| {len(tok.encode(prompt))} | " + " | ".join(f"{c:.0f} us" for c in cells) + " |")
    for t in tasks:
        t.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.close()


if __name__ == "__main__":
    main()
