"""The ``api_key`` setting: one or several API keys, each with a share of the router's capacity.

Syntax (flag ``--api-key``, env ``PDSERVE_API_KEY``, preset ``server.api_key``): a comma-separated
list of ``KEY`` or ``KEY:SHARE``, e.g. ``alice-secret:3,bob-secret`` (bob's share defaults to 1).
A share is a positive number; under overload the router's admission stage gives each key
forwarding slots in proportion to its share (``server.router.admission``). A single key without a
share is the old form and means what it meant. Keys may not be empty or contain ``,``; a ``:``
inside a key is fine as long as what follows the last ``:`` is not a number.

Each key gets a public name ``key-<i>`` (its position in the list) for metrics and logs, so the
secret itself is never exported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ApiKey:
    """One configured key: the secret, its public name and its share (> 0)."""

    secret: str
    name: str
    share: float


def _share(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value


def parse_api_keys(spec: str | None) -> tuple[ApiKey, ...]:
    """The keys of an ``api_key`` setting (empty for None / ""). Raises ``ValueError`` saying what to
    change for an empty key, a share <= 0 or not finite, or the same key twice."""
    if not spec:
        return ()
    keys: list[ApiKey] = []
    for i, item in enumerate(spec.split(",")):
        item = item.strip()
        secret, share = item, 1.0
        head, sep, tail = item.rpartition(":")
        if sep and (value := _share(tail)) is not None:
            secret, share = head, value
            if not (0 < share < float("inf")):
                raise ValueError(
                    f"api_key entry {i}: share must be a positive number, got {tail!r} "
                    f"(syntax KEY[:SHARE],KEY[:SHARE]...)"
                )
        if not secret:
            raise ValueError(f"api_key entry {i} has an empty key (syntax KEY[:SHARE],KEY[:SHARE]...)")
        if any(k.secret == secret for k in keys):
            raise ValueError(f"api_key entry {i} repeats the key of an earlier entry; give each key once")
        keys.append(ApiKey(secret, f"key-{i}", share))
    return tuple(keys)
