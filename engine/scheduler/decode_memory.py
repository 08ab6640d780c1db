"""Decode memory pressure: ``check_decode_mem`` and victim selection for ``retract_decode``.

What to do with a victim (drop and recompute, or offload to host memory) is the caller's
business: ``retract_decode`` calls ``release_victim(req)`` for each one, immediately, so the
pages it frees count for the next check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cache.kv_budget import PageBudget
from cache.kv_manager import KVManager
from engine.request import Request

OOM_ABORT_MESSAGE = (
    "KV cache pool is too small for this request: out of memory even after retracting every "
    "other request in the decode batch (sequence length {seq_len} tokens, pool {capacity} tokens). "
    "Lower max_tokens or start the server with a larger --kv-pool-tokens."
)


def check_decode_mem(kv: KVManager, reqs: list[Request], steps: int = 1) -> bool:
    """True iff ``reqs`` can decode ``steps`` more tokens, after evicting the radix cache."""
    return kv.make_free(PageBudget(kv).decode_need(reqs, steps))


def fits_empty_pool(kv: KVManager, req: Request, steps: int = 1) -> bool:
    """True iff ``req`` could decode ``steps`` more tokens with the whole pool to itself."""
    return PageBudget(kv).fits_alone(req.kv_len + steps)


VICTIM_KEYS: dict[str, Callable[[Request], tuple[int, int]]] = {
    "most-output": lambda r: (-len(r.output_ids), len(r.prompt_ids)),
    "least-output": lambda r: (len(r.output_ids), -len(r.prompt_ids)),
}


def victim_order(reqs: list[Request], order: str = "most-output") -> list[Request]:
    """Retract order (first victim first). ``most-output``: most output tokens, then shortest input
    (the default; ``docs/design/retract.md``). ``least-output``: least output tokens, then longest input (what
    SGLang's ``retract_decode`` pops: the request with the least progress, freeing the most pages).
    Ties keep the running order (the sort is stable)."""
    if order not in VICTIM_KEYS:
        raise ValueError(f"unknown retract order {order!r}: use most-output or least-output")
    return sorted(reqs, key=VICTIM_KEYS[order])


@dataclass
class RetractResult:
    kept: list[Request]
    retracted: list[Request] = field(default_factory=list)
    aborted: Request | None = None


def retract_decode(
    kv: KVManager,
    running: list[Request],
    retract_steps: int,
    release_victim: Callable[[Request], None],
    force_one: bool = False,
    park_last: bool = False,
    retract_order: str = "most-output",
) -> RetractResult:
    """Retract until the rest have room for ``retract_steps`` steps each.

    With ``force_one`` (test knob) at least one request is retracted when two or more run. If a
    single request is left and it cannot even do the next step, it is released like the others
    when ``park_last`` (someone else holds pages that come back without this request's progress,
    e.g. KV transfers in flight) and it would fit the empty pool; otherwise it is returned as
    ``aborted`` (not released: the caller ends it with ``OOM_ABORT_MESSAGE`` and frees its KV).
    Victims are taken in ``victim_order(running, retract_order)``.
    """
    order = victim_order(running, retract_order)
    res = RetractResult(kept=order)
    first = force_one
    while first or not check_decode_mem(kv, order, retract_steps):
        if len(order) == 1:
            if first or check_decode_mem(kv, order, 1):
                break
            if not (park_last and fits_empty_pool(kv, order[0])):
                res.aborted = order.pop()
                break
        first = False
        victim = order.pop(0)
        release_victim(victim)
        res.retracted.append(victim)
    return res
