"""Per-step batch description handed from the runner to the model and attention backends."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens on top of an optional cached prefix (prefill, chunked prefill)
    DECODE = "decode"  # exactly one new token per request
    MIXED = "mixed"  # the first ``num_decode`` requests decode one token, the rest extend


@dataclass
class ForwardBatch:
    """Everything a forward pass needs about where tokens live in the paged KV pool.

    Token layout: the new tokens of all requests are concatenated (request order), so
    ``input_ids``/``positions``/``out_slots`` have ``sum(extend_lens)`` entries.

    - ``seq_lens[i]``: total tokens of request i *after* this step (prefix + new).
    - ``extend_lens[i]``: new tokens of request i this step (1 in DECODE mode).
    - ``block_table[i, j]``: page id holding tokens ``[j*page_size, (j+1)*page_size)`` of
      request i; entries beyond the request's pages are arbitrary (never read).
    - ``out_slots``: flat slot (``page * page_size + offset``) where each new token's K/V goes.
    - ``swa_block_table`` / ``swa_out_slots``: the same for the SWA pool of a sliding-window
      hybrid (None without one); entries of pages that are not resident are 0 and never read
      (they lie outside every window of this step).
    - ``extra_logit_rows``: flat new-token indices whose logits are returned after the last-token
      rows (prompt logprobs), or None.
    - ``num_decode`` (MIXED mode): the first ``num_decode`` requests are decode rows (one new
      token each, their KV before it in the pool); the rest are extend rows. ``split`` cuts a MIXED
      batch into its DECODE and EXTEND parts, which the attention backends run by their own paths.
    All index tensors are int64 on the model's device; ``seq_lens_cpu``/``extend_lens_cpu`` are
    Python lists for host-side loops.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    block_table: torch.Tensor
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    page_size: int
    swa_block_table: torch.Tensor | None = None
    swa_out_slots: torch.Tensor | None = None
    num_decode: int = 0
    extra_logit_rows: torch.Tensor | None = None

    def pool_index(self, pool: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(block_table, out_slots)`` of ``pool`` ("full" or "swa")."""
        if pool == "swa":
            return self.swa_block_table, self.swa_out_slots
        return self.block_table, self.out_slots

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    def split(self) -> tuple[ForwardBatch, ForwardBatch]:
        """``(decode part, extend part)`` of a MIXED batch. Decode rows have one token each, so the
        first ``num_decode`` requests own exactly the first ``num_decode`` tokens: one cut serves
        the per-request and the per-token tensors."""
        assert self.mode is ForwardMode.MIXED and 0 < self.num_decode < self.batch_size

        def part(mode: ForwardMode, s: slice) -> ForwardBatch:
            return ForwardBatch(
                mode=mode,
                input_ids=self.input_ids[s],
                positions=self.positions[s],
                out_slots=self.out_slots[s],
                seq_lens=self.seq_lens[s],
                extend_lens=self.extend_lens[s],
                block_table=self.block_table[s],
                seq_lens_cpu=self.seq_lens_cpu[s],
                extend_lens_cpu=self.extend_lens_cpu[s],
                page_size=self.page_size,
                swa_block_table=None if self.swa_block_table is None else self.swa_block_table[s],
                swa_out_slots=None if self.swa_out_slots is None else self.swa_out_slots[s],
            )

        d = self.num_decode
        return part(ForwardMode.DECODE, slice(0, d)), part(ForwardMode.EXTEND, slice(d, None))

    def last_token_indices(self) -> torch.Tensor:
        """Index into the flat new-token axis of each request's last token (for sampling)."""
        return torch.cumsum(self.extend_lens, 0) - 1

    def logit_indices(self) -> torch.Tensor:
        """The tokens whose logits the model returns: each request's last token (batch order), then
        ``extra_logit_rows`` (prompt logprobs) when set."""
        last = self.last_token_indices()
        return last if self.extra_logit_rows is None else torch.cat([last, self.extra_logit_rows])
