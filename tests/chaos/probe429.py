"""A latency probe run as its own process beside a load (so the load generator's event loop does
not delay its clock): one small non-streamed completion every ``interval`` seconds for ``duration``
seconds; prints a JSON list of ``[HTTP status, seconds to the full response]``.

Usage (from the repository root): ``python -m tests.chaos.probe429 URL API_KEY DURATION_S INTERVAL_S``."""

from __future__ import annotations

import json
import sys
import time

import httpx


def main(url: str, key: str, duration: float, interval: float) -> None:
    out, end = [], time.monotonic() + duration
    body = {"prompt": "probe", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=url, timeout=300, trust_env=False, headers={"Authorization": f"Bearer {key}"}) as c:
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                status = c.post("/v1/completions", json=body).status_code
            except httpx.HTTPError:
                status = 0
            out.append([status, time.monotonic() - t0])
            time.sleep(interval)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
