"""The tiny sliding-window hybrid (4 layers, sliding/full alternating, window 8, page 4) and its
transformers reference (Ministral on the same weights), shared by the SWA tests of the engine, the
decode worker and PD: the ``swa_model`` fixture (tests/conftest.py) is ``swa_tiny()``. Prompts of
40+ tokens really drop SWA pages; ``hf_reference`` gives logprobs too, since an off-by-one window
often keeps the argmax."""

from __future__ import annotations

import torch

from engine.llm import LLM
from tests.support.models import engine_cfg, sched_cfg, tiny_config, tiny_weights

WINDOW, PAGE = 8, 4
TYPES = ("sliding_attention", "full_attention") * 2


def swa_tiny():
    """(config, weights, transformers Ministral) of the tiny sliding/full hybrid (window 8)."""
    from transformers import MinistralConfig, MinistralForCausalLM

    cfg = tiny_config(num_layers=4, arch="mistral", sliding_window=WINDOW, layer_types=TYPES)
    weights = tiny_weights(cfg, seed=3)
    hf_cfg = MinistralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=False,
        sliding_window=WINDOW,
        layer_types=list(TYPES),
        bos_token_id=0,
        eos_token_id=96,
    )
    hf = MinistralForCausalLM(hf_cfg).eval()
    hf.load_state_dict(weights, strict=True)
    return cfg, weights, hf


def hf_reference(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs by a full recompute each step."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            lps.append(float(logp.max()))
    return ids[len(prompt) :], lps


def swa_prompts(n: int, length: int, shared: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    head = torch.randint(1, 90, (shared,), generator=g).tolist()
    return [head + torch.randint(1, 90, (length - shared,), generator=g).tolist() for _ in range(n)]


def make_llm(swa_model, **sched) -> LLM:
    """A colocated ``LLM`` on ``swa_model`` with pages of ``PAGE``, ``pool`` full and ``swa`` SWA KV tokens."""
    cfg, weights, _ = swa_model
    eng = engine_cfg(page_size=PAGE, kv_pool_tokens=sched.pop("pool", 1024), swa_pool_tokens=sched.pop("swa", 256))
    return LLM(eng, sched_cfg(**sched), loaded=(cfg, weights, _NoTokenizer()))


class _NoTokenizer:
    eos_token_ids = (96,)

    def decode(self, ids):
        return ""


def decode_batch(pools, seq_lens, window):
    """A decode ForwardBatch over fresh pools: each request's SWA pages cover only its window
    (other entries 0, pointing at an SWA page that is not theirs)."""
    from engine.forward_batch import ForwardBatch, ForwardMode

    P, nxt, full_rows, swa_rows = PAGE, iter(range(1, 1000)), [], []
    full_next = iter(range(1000))
    for n in seq_lens:
        pages = -(-n // P)
        full_rows.append([next(full_next) for _ in range(pages)])
        first = max(0, n - window) // P
        swa_rows.append([0] * first + [next(nxt) for _ in range(pages - first)])
    width = max(len(r) for r in full_rows)
    pad = lambda rows: torch.tensor([r + [0] * (width - len(r)) for r in rows])  # noqa: E731
    full_t, swa_t = pad(full_rows), pad(swa_rows)
    last = [n - 1 for n in seq_lens]
    slots = lambda t: torch.tensor([int(t[i, p // P]) * P + p % P for i, p in enumerate(last)])  # noqa: E731
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=torch.zeros(len(seq_lens), dtype=torch.long),
        positions=torch.tensor(last),
        out_slots=slots(full_t),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.ones(len(seq_lens), dtype=torch.long),
        block_table=full_t,
        seq_lens_cpu=list(seq_lens),
        extend_lens_cpu=[1] * len(seq_lens),
        page_size=P,
        swa_block_table=swa_t,
        swa_out_slots=slots(swa_t),
    )
