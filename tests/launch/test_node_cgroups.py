"""Workers as nodes (``--node-cpus``): each worker process in its own CPU-quota cgroup, made with
the quota, joined by the child before exec, removed at stop; a root that cannot take a group is
refused with a message. A fake cgroup root in a tmp dir stands in for /sys/fs/cgroup/cpu."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from server.launch.node_cgroups import NodeGroupError, NodeGroups, node_threads
from server.launch.worker_procs import WorkerProcesses
from server.router.registry import WorkerSpec

pytestmark = pytest.mark.unit

SPECS = [WorkerSpec("prefill-0", "prefill", "tcp://127.0.0.1:1"), WorkerSpec("decode-0", "decode", "tcp://127.0.0.1:2")]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A fake cgroup v1 cpu root: the control file the groups check for."""
    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")
    return tmp_path


def groups(root: Path, cpus: float = 0.66) -> NodeGroups:
    # A fake root's directories hold plain files: removed as a tree (cgroupfs takes os.rmdir).
    return NodeGroups(cpus, root=root, prefix="pdserve-t", rmdir=shutil.rmtree)


def test_a_group_gets_the_quota_of_its_node_and_is_removed(root):
    g = groups(root)
    path = g.create("decode-0")
    assert path == root / "pdserve-t-decode-0"
    assert (path / "cpu.cfs_period_us").read_text() == "100000\n"
    assert (path / "cpu.cfs_quota_us").read_text() == "66000\n"  # 0.66 of a core per period
    assert g.procs_file("decode-0") == path / "cgroup.procs" and g.procs_file("prefill-0") is None
    assert groups(root, 2.0).quota_us() == 200_000
    g.remove_all()
    assert not path.exists() and g.groups == {}


def test_a_root_without_the_cpu_controller_or_not_writable_is_refused(tmp_path, root):
    with pytest.raises(NodeGroupError, match="no cgroup v1 cpu controller"):
        groups(tmp_path / "missing").create("decode-0")
    (root / "pdserve-t-decode-0").write_text("")  # the group's path taken: mkdir fails
    with pytest.raises(NodeGroupError, match="cannot make the CPU-quota cgroup"):
        groups(root).create("decode-0")


def test_each_worker_process_joins_its_group_and_the_groups_go_at_stop(root):
    g = groups(root)
    procs = WorkerProcesses(SPECS, lambda spec: [sys.executable, "-c", "import time; time.sleep(30)"], groups=g)
    try:
        for spec, p in procs.procs.values():
            assert g.procs_file(spec.worker_id).read_text() == f"{p.pid}\n"  # written by the child itself
        procs.procs["decode-0"][1].kill()
        procs.procs["decode-0"][1].wait()
        procs.new_exits()
        procs.restart(SPECS[1])  # a restarted worker joins its node again
        assert g.procs_file("decode-0").read_text() == f"{procs.procs['decode-0'][1].pid}\n"
    finally:
        procs.stop(grace_s=1.0)
    assert sorted(p.name for p in root.iterdir()) == ["cpu.cfs_quota_us"]


def test_a_group_that_cannot_be_made_starts_no_worker_and_leaves_no_group(root):
    (root / "pdserve-t-decode-0").write_text("")
    with pytest.raises(NodeGroupError):
        WorkerProcesses(SPECS, lambda spec: ["false"], groups=groups(root))
    assert not (root / "pdserve-t-prefill-0").exists()


def test_a_node_runs_one_torch_thread_per_whole_core():
    assert [node_threads(c) for c in (0.25, 0.66, 1.0, 1.4, 2.0, 3.2)] == [1, 1, 1, 1, 2, 3]
