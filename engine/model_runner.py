"""Owns the model, its KV pool and page allocator; turns request slices into forward passes."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from cache.kv_manager import KVManager
from cache.kv_pools import SWA, KVPools
from cache.page_allocator import PageAllocator, ceil_div
from cache.swa_window import SWAWindow
from configs.engine import EngineConfig
from engine.attention import make_backend
from engine.config import ModelConfig
from engine.dtype_choice import choose_dtype, resolve_dtype  # noqa: F401 (resolve_dtype re-exported)
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.gemma3 import Gemma3Config, Gemma3Model
from engine.grammar import GrammarCompiler
from engine.model import LlamaModel
from engine.model_paths import resolve_model_path
from engine.sampling import SamplerState
from engine.tokenizer import Tokenizer
from transfer.wire.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class SeqChunk:
    """One request's share of a forward step.

    ``token_ids`` are the new tokens (positions ``prefix_len ..``); ``pages`` cover at least
    ``prefix_len + len(token_ids)`` tokens and hold the prefix's KV already. ``swa_pages``: the
    SWA-pool entries by logical page (sliding-window hybrids), resident over the step's windows.
    ``logit_rows``: the logits of the first ``logit_rows`` new tokens are wanted too (prompt logprobs).
    """

    token_ids: list[int]
    prefix_len: int
    pages: list[int]
    swa_pages: list[int] | None = None
    logit_rows: int = 0


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def _attention_scale(mc: ModelConfig) -> float:
    """Softmax scale: ``query_pre_attn_scalar ** -0.5`` for Gemma 3, ``head_dim ** -0.5`` otherwise."""
    return getattr(mc, "query_pre_attn_scalar", mc.head_dim) ** -0.5


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_device_serves(model_config: ModelConfig, device: torch.device) -> None:
    """Refuse (``ValueError``) a model the device's attention kernels cannot compute: attention sinks
    (gpt-oss) run on the CPU torch paths only, the Triton kernels have none."""
    if getattr(model_config, "attention_sinks", False) and device.type != "cpu":
        raise ValueError(
            f"model type {model_config.arch!r} (attention sinks) is served on CPU only: pdserve's {device.type} "
            "attention kernels do not compute sinks; use --device cpu"
        )


class ModelRunner:
    """Model + KV pool + allocator for one worker. Not thread-safe; one scheduler drives it."""

    def __init__(self, cfg: EngineConfig, model_config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        self.model_config = model_config
        self.device = resolve_device(cfg.device)
        self.dtype, why = choose_dtype(cfg.dtype, self.device, model_config.stored_dtype)
        log.info("dtype: %s (%s)", str(self.dtype).removeprefix("torch."), why)
        if cfg.weight_dtype == "int8" and (self.device.type != "cpu" or self.dtype != torch.bfloat16):
            raise ValueError(
                f"--weight-dtype int8 runs on CPUs with AVX512-BF16 (this worker runs {self.device.type} "
                f"in {str(self.dtype).removeprefix('torch.')}): drop --weight-dtype int8"
            )
        _check_device_serves(model_config, self.device)
        self.page_size = cfg.page_size
        self.max_model_len = min(
            cfg.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        model_cls = Gemma3Model if isinstance(model_config, Gemma3Config) else LlamaModel
        self.model = model_cls(model_config, self.device, self.dtype, int8=cfg.weight_dtype == "int8")
        self.model.load_weights(weights)
        full_pages, swa_pages = self._pool_pages()
        self.pools = KVPools(
            full_pages,
            swa_pages,
            model_config.layer_types,
            self.page_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            self.dtype,
            self.device,
        )
        self.pool = self.pools.full
        self.allocator = PageAllocator(full_pages)
        self.swa_allocator = PageAllocator(swa_pages) if self.pools.swa is not None else None
        self.window = SWAWindow(model_config.sliding_window, self.page_size) if self.swa_allocator else None
        windows = [model_config.sliding_window if t == "sliding_attention" else None for t in model_config.layer_types]
        self.backend = make_backend(
            cfg.attention_backend,
            self.pools,
            model_config.num_heads,
            _attention_scale(model_config),
            windows,
            softcap=getattr(model_config, "attn_logit_softcapping", None),
        )
        log.info("attention backend: %s", type(self.backend).__name__)
        self.grammar = GrammarCompiler(
            lambda: Tokenizer.from_path(resolve_model_path(cfg.model)).backend_json(),
            model_config.vocab_size,
            model_config.eos_token_ids,
        )
        log.info(
            "KV pool: %d pages x %d tokens%s (%.1f MiB)",
            full_pages,
            self.page_size,
            f" + SWA pool {swa_pages} pages (window {model_config.sliding_window})" if self.window else "",
            self.pools.nbytes / 2**20,
        )

    def _pool_pages(self) -> tuple[int, int]:
        """(full pages, SWA pages); the SWA pool exists for sliding layers unless sized 0."""
        mc, P, cfg = self.model_config, self.page_size, self.cfg
        n_swa = sum(t == "sliding_attention" for t in mc.layer_types) if cfg.swa_pool_tokens != 0 else 0
        token_bytes = 2 * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize
        full_b, swa_b = (mc.num_layers - n_swa) * token_bytes, n_swa * token_bytes
        if cfg.kv_pool_tokens is not None:
            full_tokens = cfg.kv_pool_tokens
        else:
            fraction = cfg.kv_pool_fraction or (0.8 if self.device.type == "cuda" else 0.05)
            budget = int(_free_memory_bytes(self.device) * fraction)
            if n_swa and cfg.swa_pool_tokens:
                budget -= cfg.swa_pool_tokens * swa_b
            full_tokens = budget // (full_b + (0 if cfg.swa_pool_tokens else cfg.swa_pool_ratio * swa_b) or 1)
        full_pages = max(1, ceil_div(int(full_tokens), P))
        if not n_swa:
            return full_pages, 0
        swa_pages = (cfg.swa_pool_tokens or int(cfg.swa_pool_ratio * full_pages * P)) // P
        need = SWAWindow(mc.sliding_window, P).max_pages()
        if swa_pages < need:
            raise ValueError(
                f"the SWA pool ({swa_pages} pages of {P} tokens) cannot hold one request's sliding window "
                f"({need} pages): raise --swa-pool-ratio or --swa-pool-tokens (0 keeps every layer in "
                f"the full pool)"
            )
        return full_pages, swa_pages

    def warm_up_threads(self, counts) -> None:
        """Build the model's CPU matmul kernels for each torch thread count in ``counts`` too (the
        load warmed up the current one; core lending switches between counts), then restore it."""
        if self.device.type != "cpu":
            return
        current = torch.get_num_threads()
        try:
            for n in counts:
                if n != current:
                    torch.set_num_threads(n)
                    self.model.warm_up()
        finally:
            torch.set_num_threads(current)

    def matmul_seconds(self, threads: int, rows: int, repeats: int = 5) -> float:
        """Best of ``repeats`` timings of one pass of the model's layer matmuls on ``rows`` rows (the
        bulk of a step of that many tokens) at ``threads`` torch threads; the count is restored.
        Core lending asks it whether a worker's steps gain from more cores on this machine."""
        from engine.cpu_linear import linear

        current, best = torch.get_num_threads(), float("inf")
        pairs = self.model.linear_weights()
        inputs = {w.shape[1]: torch.zeros(rows, w.shape[1], dtype=self.dtype, device=self.device) for w, _ in pairs}
        try:
            torch.set_num_threads(threads)
            with torch.inference_mode():
                for attempt in range(repeats + 1):  # the first pass warms caches and thread pools
                    start = time.perf_counter()
                    for w, b in pairs:
                        linear(inputs[w.shape[1]], w, b)
                    if attempt:
                        best = min(best, time.perf_counter() - start)
        finally:
            torch.set_num_threads(current)
        return best

    def matmul_fingerprint(self) -> str:
        """A hash of what ``matmul_seconds`` times: each layer matmul's weight shape, dtype and packed
        form, the activation dtype and the device (the key a remembered timing is stored under)."""
        from engine.probe_memo import digest

        shapes = [
            [list(w.shape), str(getattr(w, "dtype", "")), type(w).__name__, b is not None]
            for w, b in self.model.linear_weights()
        ]
        return digest({"matmuls": shapes, "dtype": str(self.dtype), "device": self.device.type})

    def kv_descriptor(self) -> dict:
        """What a peer must share with this runner to exchange KV (the handshake compares every
        key): the pools' layout (``KVPools.layout_descriptor``) plus the matmul weights that computed
        the KV ("int8" or the dtype): a decode worker continuing int8-computed KV with bfloat16
        weights would produce neither model's tokens, silently."""
        return {
            **self.pools.layout_descriptor(),
            "weights": "int8" if self.cfg.weight_dtype == "int8" else str(self.dtype).removeprefix("torch."),
        }

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_slots

    def make_kv_manager(self, enable_radix_cache: bool) -> KVManager:
        """The scheduler's KV manager over this runner's pools (and SWA pool, if any)."""
        return KVManager(self.allocator, self.page_size, enable_radix_cache, self.swa_allocator, self.window)

    def sampler_state(self, params: SamplingParams, prompt_ids: list[int]) -> SamplerState:
        """A request's fresh ``SamplerState``, with its grammar matcher when ``params.structured``
        (``ValueError`` for a constraint the grammar engine refuses)."""
        state = SamplerState.new(params, self.model_config.vocab_size, prompt_ids)
        if params.structured is not None:
            state.matcher = self.grammar.matcher(params.structured)
        return state

    def build_batch(self, mode: ForwardMode, seqs: list[SeqChunk], num_decode: int = 0) -> ForwardBatch:
        """The step's ``ForwardBatch``; MIXED: the first ``num_decode`` seqs are one-token decode rows."""
        P = self.page_size
        if mode is ForwardMode.MIXED and not (
            0 < num_decode < len(seqs) and all(len(s.token_ids) == 1 for s in seqs[:num_decode])
        ):
            raise ValueError(f"a mixed step needs 1..{len(seqs) - 1} one-token decode rows first, got {num_decode}")
        ext = [len(s.token_ids) for s in seqs]
        seq_lens = [s.prefix_len + e for s, e in zip(seqs, ext)]
        table, slots = _block_table([s.pages for s in seqs], seqs, seq_lens, P, "full")
        ids = [t for s in seqs for t in s.token_ids]
        pos = np.concatenate([np.arange(s.prefix_len, n) for s, n in zip(seqs, seq_lens)])
        dev = self.device
        as_t = lambda a: torch.as_tensor(a, dtype=torch.int64).to(dev)  # noqa: E731
        batch = ForwardBatch(
            mode=mode,
            input_ids=as_t(ids),
            positions=as_t(pos),
            out_slots=as_t(slots),
            seq_lens=as_t(seq_lens),
            extend_lens=as_t(ext),
            block_table=as_t(table),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=ext,
            page_size=P,
            num_decode=num_decode if mode is ForwardMode.MIXED else 0,
        )
        if any(s.logit_rows for s in seqs):
            starts = np.cumsum([0, *ext[:-1]])
            batch.extra_logit_rows = as_t(np.concatenate([st + np.arange(s.logit_rows) for st, s in zip(starts, seqs)]))
        if self.window is not None:
            swa_table, swa_slots = _block_table([s.swa_pages for s in seqs], seqs, seq_lens, P, SWA)
            batch.swa_block_table, batch.swa_out_slots = as_t(swa_table), as_t(swa_slots)
        return batch

    def forward(self, mode: ForwardMode, seqs: list[SeqChunk], num_decode: int = 0) -> torch.Tensor:
        """Run one step; return float32 logits ``[len(seqs) + sum(logit_rows), vocab]``: each last new
        token's, then the ``logit_rows`` of each seq in order (``num_decode``: MIXED mode's leading
        decode rows, ``build_batch``)."""
        return self.model(self.build_batch(mode, seqs, num_decode), self.backend)


def _block_table(rows: list, seqs: list[SeqChunk], seq_lens: list[int], P: int, pool: str):
    """``(table [B, max_pages], out_slots [T])`` of one pool; entries without a page read 0."""
    table = np.zeros((len(seqs), max(ceil_div(n, P) for n in seq_lens)), dtype=np.int64)
    slots = []
    for i, (s, row) in enumerate(zip(seqs, rows)):
        n_pages = ceil_div(seq_lens[i], P)
        if row is None or len(row) < n_pages:
            have = 0 if row is None else len(row)
            raise ValueError(f"request needs {n_pages} {pool} pages for {seq_lens[i]} tokens, has {have}")
        table[i, :n_pages] = np.maximum(np.asarray(row[:n_pages], dtype=np.int64), 0)
        p = np.arange(s.prefix_len, seq_lens[i])
        if pool == SWA and min((row[j] for j in set((p // P).tolist())), default=0) < 0:
            raise ValueError(f"SWA pages of positions {s.prefix_len}..{seq_lens[i]} are not resident")
        slots.append(table[i, p // P] * P + p % P)
    return table, np.concatenate(slots)
