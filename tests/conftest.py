"""Shared fixtures: the embedded model loaded once per session, tiny random models, HF references,
launched servers; and the test tiers.

Layout: the tests mirror the packages (``tests/router``, ``tests/worker``, ``tests/launch``,
``tests/discovery``, ``tests/decode_worker``, ``tests/prefill_worker``, ``tests/cache``,
``tests/engine``, ``tests/transfer``, ``tests/bench``); ``tests/e2e`` holds what spans the system
(PD in one process, across processes, over HTTP, across network namespaces); ``tests/project``
checks the repository as a whole (module boundaries, undefined names, deployment files);
``tests/chaos``, ``tests/clients`` and ``tests/deploy`` are tiers of their own (``make test-chaos``,
``make test-clients``, ``make test-deploy``). Helpers shared across directories are modules of
``tests/support``; fixtures shared by several directories live here, those of one directory in
its own conftest.py.

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

# The exact mode for every process the tests launch: ``--dtype auto`` runs the embedded (quantized)
# model in bfloat16 on a CPU with native bf16, and the tests compare greedy tokens with transformers
# in float32. Launched servers and workers read ``PDSERVE_DTYPE`` (configs/schema.py env_overrides);
# in-process configs pin it in tests/support (engine_cfg, pd_cfg). A test of ``auto`` itself clears it.
os.environ["PDSERVE_DTYPE"] = "float32"

import pytest  # noqa: E402

from bench.harness.subprocess_server import LaunchedServer, free_base_port
from tests.support.models import hf_from_gguf, hf_greedy, hf_tiny, tiny_config, tiny_weights
from tests.support.pd import pd_prompts
from tests.support.servers import PD_SERVER_FLAGS, ServerFactory
from tests.support.slow_report import report as report_if_slow
from tests.support.swa import swa_tiny


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A phase slower than ``PDSERVE_SLOW_PHASE_S`` is named on the terminal as it ends
    (tests/support/slow_report.py)."""
    outcome = yield
    report_if_slow(item.config, outcome.get_result())


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
    # each lookup of the loader's mapping dequantizes anew: the session's engines share one read
    return cfg, dict(weights), Tokenizer.from_path(path), path


@pytest.fixture(scope="session")
def hf_embedded(embedded):
    """transformers' own load of the same GGUF (the reference implementation)."""
    from transformers import AutoModelForCausalLM

    return hf_from_gguf(AutoModelForCausalLM, embedded[3])


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded model's tokenizer alone (no weights), loaded once per session."""
    from engine.model_paths import resolve_model_path
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_path(resolve_model_path("default"))


@pytest.fixture(scope="session")
def tiny():
    cfg = tiny_config()
    weights = tiny_weights(cfg)
    return cfg, weights, hf_tiny(cfg, weights)


@pytest.fixture(scope="module")
def pd_refs(tiny):
    """``pd_prompts(6)`` and transformers' greedy 16 tokens for each (the in-process PD tests' reference)."""
    ps = pd_prompts(6)
    return ps, [hf_greedy(tiny[2], p, 16) for p in ps]


@pytest.fixture(scope="module")
def swa_model():
    """(config, weights, transformers Ministral) of the tiny sliding-window hybrid (tests/support/swa.py)."""
    return swa_tiny()


@pytest.fixture(scope="session")
def tiny_folder(tiny, tmp_path_factory):
    """The tiny random model saved as an HF folder (config.json + safetensors), for worker processes."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny[2].save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def launched_server() -> Iterator[ServerFactory]:
    """Module-scoped ``ServerFactory``: servers live until the module's last test is done. For a launch
    that several of the module's tests share (through a module fixture); a test that launches a cluster
    for itself takes ``launched_server_per_test``, or the module's launches add up in memory."""
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
