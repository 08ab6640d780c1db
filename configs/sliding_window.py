"""Sliding-window settings: the ``--layer-types`` syntax and the SWA pool checks.

Pure Python (the router imports configs and never loads torch). The model side (which layers of a
checkpoint slide) lives in ``engine.swa_config``; this module only knows the flag syntax.
"""

from __future__ import annotations

FULL = "full_attention"
SLIDING = "sliding_attention"
ALTERNATE = "alternate"

# Accepted spellings of one layer's kind (transformers' names, short names, its legacy "attention").
_KINDS = {"full": FULL, FULL: FULL, "attention": FULL, "sliding": SLIDING, SLIDING: SLIDING}


def check_swa_pool_holds_window(swa_pool_tokens: int, window: int, page_size: int) -> None:
    """``ValueError`` unless the SWA pool holds one decoding request's window (with its margin)."""
    from cache.swa_window import SWAWindow

    need = SWAWindow(window, page_size).max_pages() * page_size
    if swa_pool_tokens < need:
        raise ValueError(
            f"--swa-pool-tokens ({swa_pool_tokens}) cannot hold one request's sliding window "
            f"(window {window} plus its page margin = {need} tokens at --page-size {page_size}): "
            f"raise --swa-pool-tokens to at least {need}, or set it to 0 to keep every layer in the "
            f"full pool"
        )


def check_layer_types_syntax(text: str) -> str:
    """Normalize a ``--layer-types`` value (``alternate`` or a comma list of sliding/full kinds).

    Returns the value stripped of blanks around items; raises ``ValueError`` naming ``--layer-types``
    and the accepted kinds for an empty item or an unknown kind. The length is checked against the
    model by :func:`parse_layer_types` once the model is known.
    """
    value = text.strip()
    if value == ALTERNATE:
        return value
    items = [item.strip() for item in value.split(",")]
    for i, item in enumerate(items):
        if item not in _KINDS:
            raise ValueError(
                f"--layer-types: entry {i} is {item!r}; use 'alternate' or a comma-separated list of "
                f"{', '.join(sorted(_KINDS))} (one per layer)"
            )
    return ",".join(items)


def parse_layer_types(text: str, num_layers: int) -> tuple[str, ...]:
    """Per-layer kinds (``full_attention`` / ``sliding_attention``) of a ``--layer-types`` value.

    ``alternate`` = sliding, full, sliding, full, ... (layer 0 slides). An explicit list must have
    exactly ``num_layers`` entries; otherwise ``ValueError`` naming ``--layer-types``.
    """
    value = check_layer_types_syntax(text)
    if value == ALTERNATE:
        return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))
    kinds = tuple(_KINDS[item] for item in value.split(","))
    if len(kinds) != num_layers:
        raise ValueError(
            f"--layer-types lists {len(kinds)} layers but the model has {num_layers}: give one "
            f"kind per layer, or 'alternate'"
        )
    return kinds


def validate_swa_pool(swa_pool_tokens: int, page_size: int) -> None:
    """Start-up check of the sliding-window KV pool size: a whole number of pages.

    Raises ``ValueError`` naming ``--swa-pool-tokens`` and ``--page-size`` when ``swa_pool_tokens``
    is not a positive multiple of ``page_size``.
    """
    if page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {page_size}")
    if swa_pool_tokens < page_size or swa_pool_tokens % page_size:
        up = -(-max(swa_pool_tokens, 1) // page_size) * page_size
        down = swa_pool_tokens // page_size * page_size
        hint = f"{down} or {up}" if down >= page_size else f"{up}"
        raise ValueError(
            f"--swa-pool-tokens ({swa_pool_tokens}) must be a positive multiple of --page-size "
            f"({page_size}): set --swa-pool-tokens to {hint}, or change --page-size"
        )
