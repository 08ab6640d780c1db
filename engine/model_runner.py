"""Owns the model, its KV pool and page allocator; turns request slices into forward passes."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from cache.kv_pool import KVPool
from cache.page_allocator import PageAllocator, ceil_div
from configs.engine import EngineConfig
from engine.attention import make_backend
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.gemma3 import Gemma3Model
from engine.model import LlamaModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class SeqChunk:
    """One request's share of a forward step.

    ``token_ids`` are the new tokens (positions ``prefix_len ..``); ``pages`` cover at least
    ``prefix_len + len(token_ids)`` tokens and hold the prefix's KV already.
    """

    token_ids: list[int]
    prefix_len: int
    pages: list[int]


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[spec]


def _attention_scale(mc: ModelConfig) -> float:
    """Softmax scale: ``query_pre_attn_scalar ** -0.5`` for Gemma 3, ``head_dim ** -0.5`` otherwise."""
    return getattr(mc, "query_pre_attn_scalar", mc.head_dim) ** -0.5


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    """Model + KV pool + allocator for one worker. Not thread-safe; one scheduler drives it."""

    def __init__(self, cfg: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.model_config = model_config
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.page_size = cfg.page_size
        self.max_model_len = min(cfg.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        model_cls = Gemma3Model if model_config.arch == "gemma3" else LlamaModel
        self.model = model_cls(model_config, self.device, self.dtype)
        self.model.load_weights(weights)
        num_pages = self._pool_pages()
        self.pool = KVPool(num_pages, model_config.num_layers, self.page_size, model_config.num_kv_heads,
                           model_config.head_dim, self.dtype, self.device)
        self.allocator = PageAllocator(num_pages)
        windows = [model_config.sliding_window if t == "sliding_attention" else None
                   for t in model_config.layer_types]
        self.backend = make_backend(cfg.attention_backend, self.pool, model_config.num_heads,
                                    _attention_scale(model_config), windows)
        log.info("KV pool: %d pages x %d tokens (%.1f MiB)", num_pages, self.page_size,
                 self.pool.buffer.numel() * self.pool.buffer.element_size() / 2**20)

    def _pool_pages(self) -> int:
        mc = self.model_config
        if self.cfg.kv_pool_tokens is not None:
            return ceil_div(self.cfg.kv_pool_tokens, self.page_size)
        per_page = mc.num_layers * 2 * self.page_size * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize
        fraction = self.cfg.kv_pool_fraction or (0.8 if self.device.type == "cuda" else 0.05)
        return max(1, int(_free_memory_bytes(self.device) * fraction) // per_page)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_slots

    def build_batch(self, mode: ForwardMode, seqs: list[SeqChunk]) -> ForwardBatch:
        P = self.page_size
        ext = [len(s.token_ids) for s in seqs]
        seq_lens = [s.prefix_len + e for s, e in zip(seqs, ext)]
        max_pages = max(ceil_div(n, P) for n in seq_lens)
        table = np.zeros((len(seqs), max_pages), dtype=np.int64)
        ids, pos, slots = [], [], []
        for i, s in enumerate(seqs):
            n_pages = ceil_div(seq_lens[i], P)
            if len(s.pages) < n_pages:
                raise ValueError(f"request needs {n_pages} pages for {seq_lens[i]} tokens, has {len(s.pages)}")
            table[i, :n_pages] = s.pages[:n_pages]
            p = np.arange(s.prefix_len, seq_lens[i])
            ids.extend(s.token_ids)
            pos.append(p)
            slots.append(table[i, p // P] * P + p % P)
        dev = self.device
        as_t = lambda a: torch.as_tensor(a, dtype=torch.int64).to(dev)  # noqa: E731
        return ForwardBatch(
            mode=mode, input_ids=as_t(ids), positions=as_t(np.concatenate(pos)),
            out_slots=as_t(np.concatenate(slots)), seq_lens=as_t(seq_lens), extend_lens=as_t(ext),
            block_table=as_t(table), seq_lens_cpu=seq_lens, extend_lens_cpu=ext, page_size=P,
        )

    def forward(self, mode: ForwardMode, seqs: list[SeqChunk]) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(seqs), vocab]`` of each last new token."""
        return self.model(self.build_batch(mode, seqs), self.backend)
