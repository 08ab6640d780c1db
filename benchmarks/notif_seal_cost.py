"""What the KV notification seal (``transfer.notif_seal``, HMAC-SHA256 keyed from the cluster key)
costs per transfer, next to the CRC seal every manifest already has (``TransferManifest.sealed``
and ``verify``, which stay) and to parsing the manifest (what the decode side does anyway).

Manifests as a prefill worker sends them: a plain one, and one with first-token top logprobs and
``--prompt-logprobs`` prompt logprobs (the largest notification). Each figure: the best and the
median of ``--repeat`` rounds of ``--n`` calls, in microseconds per call; seal + open together is
what one transfer pays (the sender seals, the receiver opens).

``python -m benchmarks.notif_seal_cost [--repeat 15] [--n 2000]``
"""

from __future__ import annotations

import argparse
import statistics
import time

from transfer.cluster_key import ClusterKey
from transfer.notif_seal import NotifSeal
from transfer.wire.base import PromptLogprobs
from transfer.wire.protocol import TransferManifest


def manifests(prompt_logprobs: int) -> dict[str, TransferManifest]:
    """The measured manifests (unsealed; the CRC is part of what is measured)."""
    plain = TransferManifest(
        rid="cmpl-0123456789abcdef", room=(3 << 40) | 12345, generation=0, n_tokens=1024, n_pages=64, first_token=1234
    )
    top = [(i, -0.5 - i) for i in range(5)]
    lp: PromptLogprobs | None = ([None] + [(-1.25, top, 2)] * (prompt_logprobs - 1)) if prompt_logprobs else None
    rich = plain.model_copy(update={"first_logprob": -0.1, "first_top_logprobs": top, "prompt_logprobs": lp})
    return {"plain manifest": plain, f"with logprobs ({prompt_logprobs} prompt tokens)": rich}


def per_call_us(fn, n: int, repeat: int) -> tuple[float, float]:
    """(best, median) microseconds per call of ``fn`` over ``repeat`` rounds of ``n`` calls."""
    rounds = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return min(rounds), statistics.median(rounds)


def measure(n: int, repeat: int, prompt_logprobs: int) -> list[tuple[str, int, str, float, float]]:
    """Rows (manifest, bytes, step, best us, median us)."""
    seal = NotifSeal.for_key(ClusterKey.generate())
    rows = []
    for name, m in manifests(prompt_logprobs).items():
        crc_sealed = m.sealed()
        raw = crc_sealed.model_dump_json().encode()
        sealed = seal.seal("prefill-0", raw)
        assert seal.open("prefill-0", sealed) == raw
        steps = {
            "CRC seal (sender, today)": m.sealed,
            "CRC verify (receiver, today)": crc_sealed.verify,
            "parse JSON (receiver, today)": lambda raw=raw: TransferManifest.model_validate_json(raw),
            "HMAC seal (sender)": lambda raw=raw: seal.seal("prefill-0", raw),
            "HMAC open (receiver)": lambda sealed=sealed: seal.open("prefill-0", sealed),
        }
        for step, fn in steps.items():
            rows.append((name, len(raw), step, *per_call_us(fn, n, repeat)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.notif_seal_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--n", type=int, default=2000, help="calls per round")
    p.add_argument("--prompt-logprobs", type=int, default=256, help="prompt tokens with logprobs in the large one")
    a = p.parse_args(argv)
    if min(a.repeat, a.n) < 1 or a.prompt_logprobs < 0:
        p.error("--repeat and --n must be at least 1, --prompt-logprobs at least 0")
    print(f"{'manifest':34} {'bytes':>7} {'step':30} {'best us':>9} {'median us':>10}")
    for name, size, step, best, med in measure(a.n, a.repeat, a.prompt_logprobs):
        print(f"{name:34} {size:>7} {step:30} {best:>9.2f} {med:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
