"""Checks a transfer's completion manifest against what the decode worker asked for."""

from __future__ import annotations

from pydantic import ValidationError

from cache.page_allocator import ceil_div
from decode_worker.jobs import DecodeJob
from transfer.wire.protocol import TransferManifest


def parse_manifest(raw: bytes) -> TransferManifest | None:
    try:
        return TransferManifest.model_validate_json(raw)
    except ValidationError:
        return None


def manifest_error(m: TransferManifest, job: DecodeJob, page_size: int) -> str | None:
    """None when ``m`` is exactly the transfer ``job`` expects; else what differs."""
    if not m.verify():
        return "manifest checksum mismatch"
    first, last = job.decode_prefix_len // page_size, ceil_div(job.n_tokens, page_size)
    swa = job.req.kv.swa_pages or []
    wanted = {j for j in range(first, min(last, len(swa))) if swa[j] >= 0}
    for name, got, want in (
        ("rid", m.rid, job.req.rid),
        ("room", m.room, job.room),
        ("generation", m.generation, job.generation),
        ("n_tokens", m.n_tokens, job.n_tokens),
        ("n_pages", m.n_pages, last - first),
        ("swa_pages", m.swa_pages + len(m.swa_missing), len(wanted)),
    ):
        if got != want:
            return f"manifest {name} is {got!r}, expected {want!r}"
    if not set(m.swa_missing) <= wanted:
        return f"manifest swa_missing {m.swa_missing} names pages that were not asked for"
    return None
