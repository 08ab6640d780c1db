"""The bursty goodput benchmark's nodes: ``--node-cpus X`` launches every configuration with each
worker a node of X cores (``pdserve launch --node-cpus``); without it the launch is unchanged."""

from __future__ import annotations

import pytest

from benchmarks.role_goodput import parse_args, server_flags
from server.launch.args import build_parser

pytestmark = pytest.mark.unit

SLOS = ["--slo-ttft-ms", "3000", "--slo-tpot-ms", "150"]


@pytest.mark.parametrize("config", ["1p2d", "2p1d", "planner"])
def test_every_configuration_runs_on_nodes_of_the_given_cores(config):
    flags = server_flags(config, parse_args([*SLOS, "--node-cpus", "0.66"]))
    assert flags[flags.index("--node-cpus") + 1] == "0.66"
    assert "--node-cpus" not in server_flags(config, parse_args(SLOS))
    parsed = build_parser().parse_args(["launch", "--mode", "pd", *flags])  # a flag pdserve launch takes
    assert parsed.node_cpus == 0.66
