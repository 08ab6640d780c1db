"""An open-loop Poisson load run as its own process (so its busy event loop does not delay the
clock of the client whose latency a test measures): greedy streamed completions of mixed lengths
under one API key at ``rate`` requests/s for ``duration`` seconds. Checks each outcome like
``overload_load.check_outcomes`` (exit status 1 and the reason on stderr otherwise) and prints a
JSON object ``{"statuses": {status: count}, "sent_per_s": float}``.

Usage (from the repository root): ``python -m tests.chaos.heavy_load URL API_KEY RATE DURATION_S SEED``."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections import Counter

from tests.chaos.overload_load import check_outcomes, client, poisson


async def run(url: str, key: str, rate: float, duration: float, seed: int) -> dict:
    async with client(url) as c:
        shots = await asyncio.gather(*await poisson(c, rate, duration, random.Random(seed), key=key))
    check_outcomes(shots)
    return {"statuses": dict(Counter(s.status for s in shots)), "sent_per_s": len(shots) / duration}


if __name__ == "__main__":
    url, key, rate, duration, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    print(json.dumps(asyncio.run(run(url, key, rate, duration, seed))))
