"""Shared fixtures: the embedded model loaded once per session, tiny random models, HF references,
launched servers; and the test tiers.

Tiers (markers registered in pyproject.toml): ``unit`` runs in this process (no child process, no
launched server); ``process`` launches real processes (``pdserve launch`` via ``LaunchedServer``,
worker subprocesses, multiprocessing children, netns hosts, docker); ``slow`` takes long on CPU
(model-equality runs against transformers, soak-like loops). A test file marks its tier with
``pytestmark``; a test that carries neither ``unit`` nor ``process`` is marked ``unit`` here.
``make test-fast`` runs ``-m "unit and not slow"``; ``make test`` runs every tier.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU; must be set before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from bench.harness.subprocess_server import LaunchedServer, free_base_port
from configs.engine import EngineConfig
from configs.scheduler import SchedulerConfig
from engine.config import ModelConfig


def pytest_collection_modifyitems(config, items):
    """Every test gets a tier: ``unit`` if it is not marked ``process``. A test that uses a
    launched-server fixture must say ``process``; no test may be both."""
    for item in items:
        process = item.get_closest_marker("process") is not None
        if not process and {"launched_server", "launched_server_per_test", "pd_server"} & set(
            getattr(item, "fixturenames", ())
        ):
            raise pytest.UsageError(f"{item.nodeid} launches a server: mark it (or its module) pytest.mark.process")
        if not process and item.get_closest_marker("unit") is None:
            item.add_marker(pytest.mark.unit)
        if process and item.get_closest_marker("unit") is not None:
            raise pytest.UsageError(f"{item.nodeid} is marked both unit and process")


@pytest.fixture(scope="session")
def embedded():
    """(config, weights, tokenizer, path) of the embedded SmolLM2-135M GGUF."""
    from engine.loader import load_model_weights
    from engine.model_paths import resolve_model_path
    from engine.tokenizer import Tokenizer

    path = resolve_model_path("default")
    cfg, weights = load_model_weights(path)
    return cfg, weights, Tokenizer.from_path(path), path


@pytest.fixture(scope="session")
def hf_embedded(embedded):
    """transformers' own load of the same GGUF (the reference implementation)."""
    from transformers import AutoModelForCausalLM

    path = embedded[3]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer alone (no weights), loaded once per session."""
    from engine.model_paths import resolve_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_path(resolve_model_path("default"))


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        arch="llama",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_ids=(96,),
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random HF-named weights, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    w = {
        "model.embed_tokens.weight": r(cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": 1 + r(cfg.hidden_size),
        "lm_head.weight": r(cfg.vocab_size, cfg.hidden_size),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w.update(
            {
                p + "self_attn.q_proj.weight": r(q, cfg.hidden_size),
                p + "self_attn.k_proj.weight": r(kv, cfg.hidden_size),
                p + "self_attn.v_proj.weight": r(kv, cfg.hidden_size),
                p + "self_attn.o_proj.weight": r(cfg.hidden_size, q),
                p + "mlp.gate_proj.weight": r(cfg.intermediate_size, cfg.hidden_size),
                p + "mlp.up_proj.weight": r(cfg.intermediate_size, cfg.hidden_size),
                p + "mlp.down_proj.weight": r(cfg.hidden_size, cfg.intermediate_size),
                p + "input_layernorm.weight": 1 + r(cfg.hidden_size),
                p + "post_attention_layernorm.weight": 1 + r(cfg.hidden_size),
            }
        )
    return w


def hf_tiny(cfg: ModelConfig, weights: dict[str, torch.Tensor]):
    """transformers LlamaForCausalLM with the same random weights (reference for tiny models)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
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
        bos_token_id=0,
        eos_token_id=cfg.eos_token_ids[0],
    )
    model = LlamaForCausalLM(hf_cfg).eval()
    model.load_state_dict(weights, strict=True)
    return model


@pytest.fixture(scope="session")
def tiny():
    cfg = tiny_config()
    weights = tiny_weights(cfg)
    return cfg, weights, hf_tiny(cfg, weights)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by a full (no cache) recompute each step: the plainest reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def engine_cfg(**kw) -> EngineConfig:
    kw.setdefault("kv_pool_tokens", 4096)
    return EngineConfig(**kw)


def sched_cfg(**kw) -> SchedulerConfig:
    return SchedulerConfig(**kw)


@pytest.fixture(scope="session")
def tiny_folder(tiny, tmp_path_factory):
    """The tiny random model saved as an HF folder (config.json + safetensors), for worker processes."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny[2].save_pretrained(folder, safe_serialization=True)
    return folder


# ---- launched servers ---------------------------------------------------------------------------
class ServerFactory:
    """``factory(mode, *flags, base_port=None, env=None, startup_timeout_s=240.0)``: start
    ``pdserve launch --mode MODE --port 0 --base-port PORT *flags`` (PORT: a free one unless given)
    and return the ready ``LaunchedServer``. Every server it started is stopped by ``close()``
    (the fixture's teardown), also when its start failed; ``stop(srv)`` stops one earlier.
    """

    def __init__(self) -> None:
        self.running: list[LaunchedServer] = []

    def __call__(
        self,
        mode: str,
        *flags: str,
        base_port: int | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
    ) -> LaunchedServer:
        port = free_base_port(8) if base_port is None else base_port
        srv = LaunchedServer(
            ["--mode", mode, "--port", "0", "--base-port", str(port), *flags],
            env=env,
            startup_timeout_s=startup_timeout_s,
        )
        self.running.append(srv)
        srv.start()
        return srv

    def stop(self, srv: LaunchedServer) -> None:
        self.running.remove(srv)
        srv.stop()

    def close(self) -> None:
        while self.running:
            self.running.pop().stop()


@pytest.fixture(scope="module")
def launched_server() -> Iterator[ServerFactory]:
    """Module-scoped ``ServerFactory``: servers live until the module's last test is done."""
    factory = ServerFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def launched_server_per_test() -> Iterator[ServerFactory]:
    """Function-scoped ``ServerFactory``: servers are stopped when the test ends."""
    factory = ServerFactory()
    try:
        yield factory
    finally:
        factory.close()


# The shared default PD launch (``pd_server``): its heartbeat (for ``wait_idle``) and flags.
PD_SERVER_HEARTBEAT_S = 0.2
PD_SERVER_FLAGS = (
    "--kv-pool-tokens",
    "1024",
    "--health-interval-s",
    str(PD_SERVER_HEARTBEAT_S),
    "--worker-timeout-s",
    "30",
    "--log-level",
    "INFO",
)


@pytest.fixture(scope="session")
def pd_server() -> Iterator[LaunchedServer]:
    """One default PD launch (router, prefill-0 and decode-0 on a free base port, ``PD_SERVER_FLAGS``)
    shared by every test that only needs what a default launch does (its ephemeral cluster key,
    placement argv, core lending, phase metrics): started on first use, stopped when the session
    ends. ``OMP_NUM_THREADS`` is not passed on, so the launcher picks thread shares and core lending
    itself. Its users run one at a time; each measures deltas of what it reads (others' requests
    land on it too), sends nothing that outlives it, and leaves every worker running."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    srv = LaunchedServer(
        ["--mode", "pd", "--port", "0", "--base-port", str(free_base_port(2)), *PD_SERVER_FLAGS], env=env
    )
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def strip_eos(ids: list[int], eos_token_ids) -> list[int]:
    """API ``token_ids`` without the EOS that ended the generation: the API returns and counts it,
    as vLLM does, while engine references (``LLM.generate_ids``, transformers minus EOS) leave it out."""
    return list(ids[:-1]) if ids and ids[-1] in eos_token_ids else list(ids)
