"""PD across real processes: prefill and decode workers (``server.worker.main``) talking typed
ZMQ messages, KV over UCX through either data plane (NIXL or ucxx: the tests run over both). A
small driver plays the router. Tiny random model saved as an HF folder, so every output is checked
against transformers. The workers hold a cluster key (``PDSERVE_CLUSTER_SECRET_KEY``, as
``pdserve launch`` hands it over): every socket, the decode -> prefill KV handshake included,
is CURVE, and the driver presents the same key."""

from __future__ import annotations

import time

import pytest

from tests.support.models import hf_greedy
from tests.support.pd_processes import SLOW_DECODE, PDPair, prompts, until_eos, wait_idle
from transfer.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.process


PRESSURE = SamplingParams(max_new_tokens=16, temperature=0)


def run_pressure_workload(pair: PDPair, tiny) -> list[list[int]]:
    """4 x (20 + 16) tokens against a 96-token decode pool; asserts outputs equal transformers."""
    ps = prompts(4, 20, 20, seed=21)
    for i, p in enumerate(ps):
        pair.submit(f"r{i}", p, PRESSURE)
    out = pair.collect([f"r{i}" for i in range(4)])
    assert [out[f"r{i}"]["tokens"] for i in range(4)] == [until_eos(hf_greedy(tiny[2], p, 16)) for p in ps]
    return ps


BACKENDS = pytest.mark.parametrize("backend", ["nixl", "ucxx"])


@BACKENDS
def test_pd_processes_offload_and_resume(tiny, tiny_folder, backend):
    pair = PDPair(
        tiny_folder, decode_pool=96, host_gb=0.01, init_new_token_ratio=0.1, backend=backend, decode_sched=SLOW_DECODE
    )
    try:
        ps = run_pressure_workload(pair, tiny)
        params = PRESSURE
        d, p = wait_idle(pair, "d0"), wait_idle(pair, "p0")
        assert d.counters["retractions"] > 0 and d.counters["retract_resumed"] > 0
        assert d.gauges["kv_pages_used"] == 0 and d.gauges["host_kv_pool_bytes_used"] == 0
        assert p.counters["kv_transfer_bytes"] > 0 and p.gauges["kv_pages_used"] == 0

        # decode asks for a room the prefill worker never heard of: fails fast, pages come back
        pair.submit("orphan", ps[0], params, to_prefill=False)
        res = pair.collect(["orphan"], timeout=10)["orphan"]
        assert res["finish"] == "abort" and "no such request" in res["error"]

        # a dead prefill worker fails the decode side's waiting request within the lease; the pages
        # it was asked to write stay fenced (a late write could still land) for transfer_fence_s
        pair.procs["p0"].kill()
        t0 = time.monotonic()
        pair.submit("late", ps[1], params, to_prefill=False)
        res = pair.collect(["late"], timeout=15)["late"]
        assert res["finish"] == "abort" and "did not answer" in res["error"]
        assert time.monotonic() - t0 < 10
        assert pair.stats("d0").gauges["kv_pages_used"] > 0
        assert wait_idle(pair, "d0").gauges["kv_pages_used"] == 0
    finally:
        pair.close()


@BACKENDS
def test_pd_processes_recompute_fallback(tiny, tiny_folder, backend):
    pair = PDPair(
        tiny_folder, decode_pool=96, host_gb=0.0, init_new_token_ratio=0.1, backend=backend, decode_sched=SLOW_DECODE
    )
    try:
        run_pressure_workload(pair, tiny)
        d = wait_idle(pair, "d0")
        assert d.counters["retract_recomputed"] > 0 and d.counters["retract_offloaded"] == 0
        assert d.gauges["kv_pages_used"] == 0
    finally:
        pair.close()


def test_handshake_mismatch_is_refused_with_both_values(tiny_folder):
    pair = PDPair(tiny_folder, decode_pool=512, host_gb=0.0, decode_page_size=8)
    try:
        pair.submit("m", prompts(1, 10, 10, seed=1)[0], SamplingParams(max_new_tokens=4, temperature=0))
        res = pair.collect(["m"], timeout=15)["m"]
        assert res["finish"] == "abort"
        assert "page_size: decode has 8, prefill has 4" in res["error"]
    finally:
        pair.close()


@pytest.mark.parametrize("prefill_backend,decode_backend", [("nixl", "ucxx"), ("ucxx", "nixl")])
def test_handshake_refuses_a_peer_on_the_other_data_plane(tiny_folder, prefill_backend, decode_backend):
    pair = PDPair(tiny_folder, decode_pool=512, host_gb=0.0, backend=prefill_backend, decode_backend=decode_backend)
    try:
        pair.submit("t", prompts(1, 10, 10, seed=2)[0], SamplingParams(max_new_tokens=4, temperature=0))
        res = pair.collect(["t"], timeout=15)["t"]
        assert res["finish"] == "abort"
        assert f"transport mismatch: decode uses {decode_backend}, prefill uses {prefill_backend}" in res["error"]
        assert wait_idle(pair, "d0").gauges["kv_pages_used"] == 0
    finally:
        pair.close()
