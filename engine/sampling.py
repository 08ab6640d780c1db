"""Per-request sampler state and the batched sampler (parameters: ``transfer.wire.sampling_params``).

Pipeline applied by :meth:`Sampler.sample` to each row of last-position logits (all in float32):

1. logit adjustments (only rows that use them): ``logit_bias`` (OpenAI, added as is), then
   repetition (HF semantics, over prompt + generated ids), then frequency / presence (OpenAI
   semantics, over generated ids only); then structured output: tokens the request's grammar
   matcher does not allow next go to ``-inf`` (one masked fill over all constrained rows);
2. greedy rows (``temperature == 0``): ``argmax``;
3. other rows: temperature -> top-k -> top-p -> min-p -> one draw from the request's own
   generator (exponential race ``argmax(probs / Exp(1))``), so a seeded request's tokens depend
   only on its seed and its logits, never on the other requests in the batch. The generator is
   re-seeded for every token with ``token_seed(seed, index)``: the draw for output token ``k`` is a
   function of (seed, k) alone, so the stream is the same in colocated and PD mode (where the
   decode worker builds a fresh state after the prefill worker drew token 0), after an offload
   and after a recompute.

Log-probabilities follow vLLM's convention: they are taken from the *raw* model distribution
(``log_softmax`` of the unprocessed logits in float32), not from the penalised / tempered one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.grammar import allowed_masks
from transfer.wire.sampling_params import SamplingParams

__all__ = ["SamplerState", "SampleOutput", "Sampler", "token_seed"]

_MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``
    (splitmix64 of the pair: nearby seeds and indices give unrelated streams). Fits in 63 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplerState:
    """Mutable per-request sampler state; create with :meth:`new`, update with :meth:`append`.

    - ``seed``: ``params.seed``; ``generator``: a ``torch.Generator`` re-seeded before every draw
      with ``token_seed(seed, num_generated)``, or ``None`` for both (global RNG).
    - ``output_counts``: int32 tensor ``[vocab_size]`` of generated-token counts; allocated only
      when the request uses frequency/presence penalties, else ``None``.
    - ``seen_mask``: bool tensor ``[vocab_size]``, True for ids in the prompt or generated so
      far; allocated only when the request uses a repetition penalty, else ``None``.
    - ``num_generated``: tokens appended so far.

    The tensors live on ``device`` given to :meth:`new` and are moved (once) to the logits'
    device by :meth:`Sampler.sample` if they differ. The generator stays on its device; its
    random draws are copied to the logits' device, so results do not depend on placement.
    """

    vocab_size: int
    seed: int | None = None
    generator: torch.Generator | None = None
    output_counts: torch.Tensor | None = None
    seen_mask: torch.Tensor | None = None
    num_generated: int = 0
    matcher: Any = None  # engine.grammar.Matcher of a structured-output request, else None

    @classmethod
    def new(
        cls,
        params: SamplingParams,
        vocab_size: int,
        prompt_ids: Sequence[int] | torch.Tensor = (),
        device: torch.device | str | None = None,
    ) -> SamplerState:
        """Fresh state for a request with ``params`` over a vocabulary of ``vocab_size`` ids.

        ``prompt_ids`` seed the repetition-penalty set (ignored when that penalty is off).
        Raises ``ValueError`` if ``vocab_size < 1`` or a prompt id is outside ``[0, vocab_size)``.
        """
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
        counts = None
        if params.uses_count_penalties:
            counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        seen = None
        if params.uses_repetition_penalty:
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
            if ids.numel():
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= vocab_size:
                    raise ValueError(f"prompt ids must be in [0, {vocab_size}), got min {lo} max {hi}")
                seen[ids.to(device)] = True
        return cls(vocab_size=vocab_size, seed=params.seed, generator=generator, output_counts=counts, seen_mask=seen)

    def token_generator(self) -> torch.Generator | None:
        """The generator for the next draw, seeded for output token ``num_generated``."""
        if self.generator is not None:
            self.generator.manual_seed(token_seed(self.seed, self.num_generated))
        return self.generator

    def append(self, token_id: int) -> None:
        """Record one generated token (updates counts / seen set; raises ``ValueError`` if out of range)."""
        if not (0 <= token_id < self.vocab_size):
            raise ValueError(f"token_id must be in [0, {self.vocab_size}), got {token_id}")
        self.num_generated += 1
        if self.matcher is not None:
            self.matcher.consume(token_id)
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.seen_mask is not None:
            self.seen_mask[token_id] = True

    def _to(self, device: torch.device) -> None:
        if self.output_counts is not None and self.output_counts.device != device:
            self.output_counts = self.output_counts.to(device)
        if self.seen_mask is not None and self.seen_mask.device != device:
            self.seen_mask = self.seen_mask.to(device)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum (the first one on ties, NaN counted as the maximum): exactly
    ``x.argmax(-1)``. On CPU through ``max(-1)``, which torch vectorizes and ``argmax`` does not: over
    a decode step's batch of logits (``[rows, vocab]``) several times faster, most of all in bfloat16."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


def _add_logit_bias(x: torch.Tensor, row: int, logit_bias: tuple[tuple[int, float], ...]) -> None:
    """``x[row, id] += bias`` for each pair (ids sorted); ``ValueError`` for an id outside ``x``'s vocabulary."""
    ids, bias = zip(*logit_bias)
    if ids[-1] >= x.shape[1]:
        raise ValueError(f"row {row}: logit_bias token id {ids[-1]} outside the vocabulary of {x.shape[1]}")
    x[row, torch.tensor(ids, device=x.device)] += torch.tensor(bias, dtype=torch.float32, device=x.device)


@dataclass
class SampleOutput:
    """Result of one :meth:`Sampler.sample` call, one entry per request (batch order).

    - ``token_ids[i]``: the sampled token.
    - ``logprobs[i]``: its log-probability under the raw model distribution, or ``None`` when
      request i did not ask for logprobs.
    - ``top_logprobs[i]``: ``(token_id, logprob)`` pairs of the ``params.logprobs`` most likely
      tokens, sorted by decreasing logprob (``[]`` when ``logprobs == 0``), or ``None`` when not
      requested.
    """

    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


class Sampler:
    """Stateless batched sampler: one token per row of last-position logits.

    Per-request state (RNG, penalty bookkeeping) lives in :class:`SamplerState`; the caller
    must call ``state.append(token)`` with each returned token before the next step.
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        states: Sequence[SamplerState],
    ) -> SampleOutput:
        """Sample one token per row of ``logits`` (``[B, V]``, any float dtype, any device).

        ``params[i]`` and ``states[i]`` belong to row ``i``; both must have length ``B`` and
        states that track penalties must have ``vocab_size == V``. ``logits`` is not modified.
        Deterministic for greedy rows; a seeded row's draw depends only on its seed, its output
        index and its logits. Raises ``ValueError`` on shape mismatches.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be 2-D [batch, vocab], got shape {tuple(logits.shape)}")
        B = logits.shape[0]
        if len(params) != B or len(states) != B:
            raise ValueError(f"batch size mismatch: logits has {B} rows, {len(params)} params, {len(states)} states")
        if B == 0:
            return SampleOutput([], [], [])

        tokens_t = self._choose(logits, params, states)
        token_ids: list[int] = tokens_t.tolist()
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        chosen: list[float | None] = [None] * B
        tops: list[list[tuple[int, float]] | None] = [None] * B
        if lp_rows:
            self._fill_logprobs(logits, tokens_t, lp_rows, params, chosen, tops)
        return SampleOutput(token_ids=token_ids, logprobs=chosen, top_logprobs=tops)

    # ------------------------------------------------------------------ helpers

    def _choose(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], states: Sequence[SamplerState]
    ) -> torch.Tensor:
        """The ``[B]`` sampled token ids: logit bias and penalties, then the grammar masks of
        structured output, then argmax (greedy rows) or a draw. ``logits`` is not modified."""
        pen_rows = [i for i, p in enumerate(params) if p.uses_penalties]
        masks = [(i, m) for i, s in enumerate(states) if s.matcher is not None and (m := s.matcher.bitmask())]
        all_greedy = all(p.is_greedy for p in params)
        if all_greedy and not pen_rows and not masks:
            return row_argmax(logits)  # fast path: one argmax over the whole batch, in the logits' dtype
        x = logits.to(torch.float32, copy=bool(pen_rows or masks))
        if pen_rows:
            self._apply_penalties(x, pen_rows, params, states)
        if masks:  # structured output: one masked_fill over every constrained row
            idx = torch.tensor([i for i, _ in masks], device=x.device)
            allowed = allowed_masks([m for _, m in masks], x.shape[1]).to(x.device)
            x.index_copy_(0, idx, x.index_select(0, idx).masked_fill(~allowed, float("-inf")))
        return row_argmax(x) if all_greedy else self._sample_mixed(x, params, states)

    @staticmethod
    def _apply_penalties(
        x: torch.Tensor,
        rows: list[int],
        params: Sequence[SamplingParams],
        states: Sequence[SamplerState],
    ) -> None:
        """In place on the fp32 copy ``x``: logit bias, repetition, then frequency/presence penalties."""
        device = x.device
        V = x.shape[1]
        for i in rows:
            if params[i].logit_bias:
                _add_logit_bias(x, i, params[i].logit_bias)
        rep_rows = [i for i in rows if params[i].uses_repetition_penalty]
        cnt_rows = [i for i in rows if params[i].uses_count_penalties]
        for i in rows:
            st = states[i]
            if st.vocab_size != V:
                raise ValueError(f"row {i}: sampler state vocab_size {st.vocab_size} != logits vocab {V}")
            st._to(device)

        if rep_rows:
            idx = torch.tensor(rep_rows, device=device)
            sub = x.index_select(0, idx)
            seen = torch.stack([states[i].seen_mask for i in rep_rows])
            pen = torch.tensor(
                [params[i].repetition_penalty for i in rep_rows], dtype=torch.float32, device=device
            ).unsqueeze(1)
            penalised = torch.where(sub < 0, sub * pen, sub / pen)
            x.index_copy_(0, idx, torch.where(seen, penalised, sub))

        if cnt_rows:
            idx = torch.tensor(cnt_rows, device=device)
            sub = x.index_select(0, idx)
            counts = torch.stack([states[i].output_counts for i in cnt_rows]).to(torch.float32)
            freq = torch.tensor(
                [params[i].frequency_penalty for i in cnt_rows], dtype=torch.float32, device=device
            ).unsqueeze(1)
            pres = torch.tensor(
                [params[i].presence_penalty for i in cnt_rows], dtype=torch.float32, device=device
            ).unsqueeze(1)
            sub = sub - freq * counts - pres * (counts > 0).to(torch.float32)
            x.index_copy_(0, idx, sub)

    @staticmethod
    def _sample_mixed(
        x: torch.Tensor,
        params: Sequence[SamplingParams],
        states: Sequence[SamplerState],
    ) -> torch.Tensor:
        """Tokens for a batch with at least one non-greedy row; ``x`` is penalised fp32 logits."""
        B, _ = x.shape
        device = x.device
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        rand_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        rparams = [params[i] for i in rand_rows]

        if greedy_rows:
            rand_idx = torch.tensor(rand_rows, device=device)
            r = x.index_select(0, rand_idx)
        else:
            r = x
        temps = torch.tensor([p.temperature for p in rparams], dtype=torch.float32, device=device)
        r = r / temps.unsqueeze(1)

        r = Sampler._top_k_top_p(r, rparams)

        probs = r.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in rparams):
            mps = torch.tensor([p.min_p for p in rparams], dtype=torch.float32, device=device)
            thresh = probs.amax(dim=-1, keepdim=True) * mps.unsqueeze(1)
            probs = probs.masked_fill(probs < thresh, 0.0)
            # no renormalisation needed: the exponential race is scale-invariant per row

        rand_tokens = Sampler._exponential_race(probs, [states[i] for i in rand_rows])

        if not greedy_rows:
            return rand_tokens
        out = torch.empty(B, dtype=torch.long, device=device)
        g_idx = torch.tensor(greedy_rows, device=device)
        out.index_copy_(0, g_idx, row_argmax(x.index_select(0, g_idx)))
        out.index_copy_(0, rand_idx, rand_tokens)
        return out

    @staticmethod
    def _top_k_top_p(r: torch.Tensor, rparams: Sequence[SamplingParams]) -> torch.Tensor:
        """``r`` (tempered fp32 logits, row j for ``rparams[j]``) with each row's tokens outside
        its top-k and top-p sets at ``-inf``; ``r`` itself when no row restricts either."""
        V = r.shape[1]
        device = r.device
        ks_list = [V if p.top_k == -1 else min(p.top_k, V) for p in rparams]
        use_k = any(k < V for k in ks_list)
        use_p = any(p.top_p < 1.0 for p in rparams)
        if not (use_k or use_p):
            return r
        # Work on candidates sorted by decreasing logit. When every row has a top-k, only the
        # k_max best tokens can survive, so a (much cheaper) topk replaces the full sort.
        k_max = max(ks_list)
        if k_max < V:
            cand_logits, cand_idx = r.topk(k_max, dim=-1, sorted=True)
        else:
            cand_logits, cand_idx = r.sort(dim=-1, descending=True)
        width = cand_logits.shape[1]
        if use_k:
            ks = torch.tensor(ks_list, device=device)
            positions = torch.arange(width, device=device)
            cand_logits.masked_fill_(positions.unsqueeze(0) >= ks.unsqueeze(1), float("-inf"))
        if use_p:
            ps = torch.tensor([p.top_p for p in rparams], dtype=torch.float32, device=device)
            cprobs = cand_logits.softmax(dim=-1)
            mass_before = cprobs.cumsum(dim=-1) - cprobs
            drop = mass_before >= ps.unsqueeze(1)
            drop[:, 0] = False  # always keep the most likely token
            cand_logits.masked_fill_(drop, float("-inf"))
        return torch.full_like(r, float("-inf")).scatter_(1, cand_idx, cand_logits)

    @staticmethod
    def _exponential_race(probs: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
        """One token per row of ``probs`` (unnormalised probabilities), drawn with the generator of
        ``states[j]`` for row j, or torch's global RNG for states without one."""
        V = probs.shape[1]
        device = probs.device
        # Exponential race: argmax(p / E), E ~ Exp(1), equals a draw from p (normalised).
        noise = torch.empty_like(probs)
        seeded = [(j, st.token_generator()) for j, st in enumerate(states) if st.generator is not None]
        if len(seeded) < len(states):
            noise.exponential_()
        for j, g in seeded:
            if g.device == device:
                noise[j].exponential_(generator=g)
            else:
                noise[j] = torch.empty(V, dtype=torch.float32, device=g.device).exponential_(generator=g).to(device)
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return row_argmax(probs / noise)

    @staticmethod
    def _fill_logprobs(
        logits: torch.Tensor,
        tokens: torch.Tensor,
        rows: list[int],
        params: Sequence[SamplingParams],
        chosen: list[float | None],
        tops: list[list[tuple[int, float]] | None],
    ) -> None:
        """Fill ``chosen``/``tops`` for ``rows`` from log_softmax of the raw fp32 logits."""
        device = logits.device
        idx = torch.tensor(rows, device=device)
        lp = logits.index_select(0, idx).to(torch.float32).log_softmax(dim=-1)
        chosen_vals = lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1).tolist()
        n_max = max(params[i].logprobs for i in rows)
        if n_max > 0:
            top_vals, top_ids = lp.topk(min(n_max, lp.shape[1]), dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            chosen[i] = chosen_vals[j]
            n = params[i].logprobs
            tops[i] = list(zip(top_ids[j][:n], top_vals[j][:n])) if n > 0 else []
