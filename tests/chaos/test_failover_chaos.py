"""Chaos row for failover: a launched 1 prefill + 2 decode cluster (the tiny model, real processes,
KV over NIXL on loopback) under a mixed streamed load (greedy, seeded temperature, ``json_schema``,
``n=2``, ``logprobs``, stop strings) loses a decode worker to ``kill -9`` at a seeded moment (a
seeded share of all tokens streamed, ``PDSERVE_CHAOS_SEED``). Every request must end whole: no
error, and text, token ids, finish reason, logprobs and usage those of the fault-free run of the
same bodies; the failovers were counted as continued; once the killed worker is back, no KV page,
host pool byte or in-flight entry is left on any worker."""

from __future__ import annotations

import asyncio

import pytest

from tests.chaos.chaos_cluster import Cluster
from tests.chaos.failover_support import ARGS, assert_failed_over, fault_free, killed_load
from tests.chaos.tiny_model import save_tiny_model

pytestmark = [pytest.mark.process, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(save_tiny_model(tmp_path_factory.mktemp("failover-model")), prefill=1, decode=2, args=ARGS)
    c.start()
    yield c
    c.stop()


def test_kill9_of_a_decode_worker_under_mixed_streams_loses_nothing(cluster):
    ref = fault_free(cluster.url, cluster.wait_recovered)
    kill_tokens, total = ref.kill_tokens(salt=0)
    got, victim = asyncio.run(killed_load(cluster, ref.bodies, kill_tokens))
    m = cluster.wait_recovered()  # the launcher restarted the victim; every worker idle again
    assert_failed_over(f"decode kill -9: {victim} at {kill_tokens}/{total} tokens", ref, got, m, (victim,))
