"""Offline engine: load a model once, generate for a batch of prompts in one process."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.config import ModelConfig
from engine.loader import load_for_engine
from engine.model_paths import resolve_model_path
from engine.model_runner import ModelRunner
from engine.scheduler.base import RequestRejected
from engine.scheduler.colocated import ColocatedScheduler
from engine.tokenizer import Tokenizer
from transfer.wire.protocol import GenerateRequest, TokenDelta
from transfer.wire.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    logprobs: list[float | None] | None = None
    stop_token_id: int | None = None  # the EOS / stop_token_ids id that ended it (not in token_ids)


class LLM:
    """Model + tokenizer + colocated scheduler. ``generate`` runs prompts as one batch."""

    def __init__(
        self,
        engine: EngineConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        loaded: tuple[ModelConfig, dict, Tokenizer] | None = None,
    ) -> None:
        """``loaded`` = (config, weights, tokenizer) already in memory (tests reuse one load)."""
        self.engine_cfg = engine or EngineConfig()
        self.sched_cfg = scheduler or SchedulerConfig()
        torch.manual_seed(self.engine_cfg.seed)
        if loaded is None:
            path = resolve_model_path(self.engine_cfg.model)
            loaded = (*load_for_engine(path, self.engine_cfg), Tokenizer.from_path(path))
        self.model_config, weights, self.tokenizer = loaded
        self.runner = ModelRunner(self.engine_cfg, self.model_config, weights)
        eos = tuple(self.model_config.eos_token_ids) or tuple(self.tokenizer.eos_token_ids)
        self.scheduler = ColocatedScheduler(self.runner, self.sched_cfg, eos)

    def encode_prompt(self, text: str, chat: bool = False) -> list[int]:
        if chat:  # the template writes the BOS itself
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return self.tokenizer.encode(text, add_special_tokens=not chat)

    def generate_ids(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Generate for token-id prompts; each result's ``token_ids`` excludes the stop token."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results = []
        for p, sp, out in zip(prompts, plist, run_batch(self.scheduler, prompts, plist)):
            results.append(
                GenerationResult(
                    p,
                    out.token_ids,
                    self.tokenizer.decode(out.token_ids),
                    out.finish_reason,
                    out.error,
                    out.logprobs if sp.logprobs is not None else None,
                    out.stop_token_id,
                )
            )
        return results

    def generate(self, prompts: list[str], params: SamplingParams, chat: bool = False) -> list[GenerationResult]:
        return self.generate_ids([self.encode_prompt(p, chat) for p in prompts], params)


def run_batch(scheduler, prompts: list[list[int]], params: list[SamplingParams]) -> list[TokenDelta]:
    """Submit every prompt, step ``scheduler`` until idle, return one merged delta per prompt.

    A prompt the scheduler refuses up front comes back as an "abort" delta with the reason.
    """
    merged: dict[str, TokenDelta] = {}
    rids = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        rid = f"batch-{id(scheduler)}-{i}"
        rids.append(rid)
        merged[rid] = TokenDelta(rid=rid)
        try:
            scheduler.add(b"", GenerateRequest(rid=rid, params=sp), p)
        except RequestRejected as e:
            merged[rid] = TokenDelta.failed(rid, str(e), 400)
    while scheduler.has_work:
        for d in scheduler.step().outbox.deltas:
            m = merged[d.rid]
            m.token_ids += d.token_ids
            m.logprobs += d.logprobs
            m.top_logprobs += d.top_logprobs
            m.cached_tokens = max(m.cached_tokens, d.cached_tokens)
            m.prompt_logprobs = d.prompt_logprobs if d.prompt_logprobs is not None else m.prompt_logprobs
            if d.finish_reason:
                m.finish_reason, m.error, m.error_status = d.finish_reason, d.error, d.error_status
                m.stop_token_id = d.stop_token_id
    return [merged[r] for r in rids]
