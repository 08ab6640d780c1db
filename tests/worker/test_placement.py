"""CPU placement of a local launch: each worker its own cores, the router the rest; explicit
lists; refusals that name the flag."""

from __future__ import annotations

import pytest

from server.worker.placement import Placement, parse_cpu_list, plan_placement


def test_two_workers_on_two_cores_get_one_each_and_the_router_shares():
    p = plan_placement(["prefill-0", "decode-0"], "auto", [0, 1])
    assert p == Placement({"prefill-0": (0,), "decode-0": (1,)}, ())
    assert "router -> shares" in p.describe()


def test_spare_core_goes_to_the_router():
    p = plan_placement(["prefill-0", "decode-0"], "auto", [0, 1, 2, 3])
    assert p.workers == {"prefill-0": (0, 1), "decode-0": (2,)} and p.router == (3,)
    assert plan_placement(["p", "d"], "auto", list(range(16))).workers == {
        "p": tuple(range(8)),
        "d": tuple(range(8, 15)),
    }


@pytest.fixture(autouse=True)
def _no_omp_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_unpinned_workers_share_the_cores_threads(monkeypatch):
    import torch

    from server.worker.placement import apply_cpus

    assert plan_placement(["p0", "p1", "d0", "d1"], "off", [0, 1]).threads == 1
    assert plan_placement(["p0", "d0"], "off", list(range(8))).threads == 4
    assert plan_placement(["p0", "d0", "d1"], "off", list(range(8))).threads == 2
    assert "torch threads per worker: 1" in plan_placement(["a", "b"], "off", [0, 1]).describe()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own setting wins
    assert plan_placement(["p0", "d0"], "off", [0, 1]) == Placement()
    before = torch.get_num_threads()
    try:
        apply_cpus((), 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_nothing_pinned_when_it_cannot_help():
    assert plan_placement(["colocated-0"], "auto", [0, 1]) == Placement()
    assert plan_placement(["a", "b", "c"], "auto", [0, 1]) == Placement(threads=1)
    assert plan_placement(["a", "b"], "off", [0, 1]) == Placement(threads=1)
    assert "not pinned" in Placement().describe()


def test_explicit_lists():
    p = plan_placement(["prefill-0", "decode-0"], "prefill-0=0-2,decode-0=3+5", list(range(8)))
    assert p.workers == {"prefill-0": (0, 1, 2), "decode-0": (3, 5)} and p.router == (4, 6, 7)
    assert parse_cpu_list("3+1-2") == (1, 2, 3)


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("decode-9=1", "ID one of prefill-0, decode-0"),
        ("prefill-0=7", "asks for cpus 7"),
        ("prefill-0=x", "not a cpu list"),
        ("prefill-0=3-1", "not a cpu list"),
    ],
)
def test_bad_specs_are_refused_with_the_flag(spec, needle):
    with pytest.raises(ValueError, match="--worker-cpus") as e:
        plan_placement(["prefill-0", "decode-0"], spec, [0, 1])
    assert needle in str(e.value)


@pytest.mark.process
def test_launch_pins_each_worker_to_its_cores(launched_server_per_test):
    import os

    srv = launched_server_per_test("pd", "--kv-pool-tokens", "512", "--worker-cpus", "prefill-0=0,decode-0=1")
    by_role = {}
    for pid in srv.worker_pids():
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        by_role[argv[argv.index(b"--role") + 1].decode()] = os.sched_getaffinity(pid)
    assert by_role == {"prefill": {0}, "decode": {1}}
    assert "placement: prefill-0 -> cpus 0, decode-0 -> cpus 1" in srv.log()


@pytest.mark.process
def test_launch_gives_unpinned_workers_their_thread_share(pd_server):
    """Default placement (off) on this host: nothing pinned, but each of the 2 workers is told to run
    torch with cores // 2 threads, and the launcher says so. (The session's default PD launch, which
    gets no OMP_NUM_THREADS.)"""
    import os

    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    pids = pd_server.worker_pids()
    assert len(pids) == 2
    for pid in pids:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        assert argv[argv.index(b"--threads") + 1].decode() == share
    assert f"torch threads per worker: {share}" in pd_server.log()


@pytest.mark.process
def test_launch_with_a_bad_cpu_list_fails_at_once_naming_the_flag():
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.launch.cli",
            "launch",
            "--mode",
            "pd",
            "--port",
            "0",
            "--worker-cpus",
            "decode-0=99",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "--worker-cpus: decode-0 asks for cpus 99" in r.stderr
