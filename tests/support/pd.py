"""The in-process PD tests' shared settings (``PDHarness``, loopback transport, tiny model): the
configuration of a worker, the random prompts, greedy sampling. The transformers references of
``pd_prompts(6)`` are the ``pd_refs`` fixture (tests/conftest.py)."""

from __future__ import annotations

import random

from configs.schema import PdserveConfig
from transfer.wire.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


def pd_cfg(pool=4096, page=4, host_gb=0.01, **sched) -> PdserveConfig:
    """A PD worker's configuration: ``pool`` KV tokens in pages of ``page``, ``host_gb`` of host pool,
    in the exact float32 mode."""
    return PdserveConfig.model_validate(
        {
            "engine": {"kv_pool_tokens": pool, "page_size": page, "dtype": "float32"},
            "scheduler": sched,
            "cluster": {"mode": "pd", "host_kv_pool_gb": host_gb, "transfer_backend": "loopback"},
        }
    )


def pd_prompts(n, lo=5, hi=30, seed=0):
    """``n`` random prompts of ``lo``..``hi`` tokens below the tiny model's EOS (96)."""
    rng = random.Random(seed)
    return [[rng.randrange(0, 96) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
