"""``pdserve bench two-routers`` end to end with the tiny model: etcd, a cluster key, one prefill and
two decode workers, two routers, phases A B A B of a few requests each. The JSON and the printed
tables carry every field, the counters moved by exactly what was sent (requests per router, requests
and tokens per decode worker), the routers claimed distinct room tags, and nothing the bench
started is left running."""

from __future__ import annotations

import json

import httpx
import pytest

from bench import cli
from tests.chaos.tiny_model import save_tiny_model
from tests.support.etcd_server import INSTALL_HINT, etcd_binary

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.skipif(etcd_binary() is None, reason=INSTALL_HINT)]

N, OUT = 8, 6


def test_bench_runs_a_b_a_b_and_reads_the_workers_counters(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "model")
    out = tmp_path / "two.json"
    rc = cli.main(
        [
            "two-routers",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--kv-pool-tokens",
            "4096",
            "--heartbeat-s",
            "0.2",
            "--server-args",
            "--page-size 16 --max-model-len 512",
            "--concurrency",
            "4",
            "--num-requests",
            str(N),
            "--input-len-range",
            "16,48",
            "--output-len",
            str(OUT),
            "--rounds",
            "2",
            "--warmup",
            "2",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    printed = captured.out
    assert rc == 0, f"{printed}\n--- stderr ---\n{captured.err[-4000:]}"
    d = json.loads(out.read_text())
    a, b = d["routers"]
    assert [p["phase"] for p in d["phases"]] == ["A1", "B1", "A2", "B2"]
    assert len(set(d["router_tags"])) == 2
    for p in d["phases"]:
        s, split = p["stats"], p["split"]
        assert (s["requests"], s["completed"], s["failed"], p["failures"]) == (N, N, 0, [])
        assert s["output_throughput"] > 0 and s["ttft"]["p99_ms"] >= s["ttft"]["p50_ms"] > 0 and s["tpot"]["p50_ms"] > 0
        want = {a: N, b: 0} if p["phase"][0] == "A" else {a: N // 2, b: N // 2}
        assert split["router_ok"] == want
        assert sorted(split["finished"]) == ["decode-0", "decode-1"]
        assert sum(split["finished"].values()) == N and sum(split["tokens"].values()) == N * OUT
        assert split["finished_spread"] is not None
        assert set(p["cpu_s"]) == {"router-a", "router-b", "prefill-0", "decode-0", "decode-1"}
        assert p["cpu_s"]["decode-0"] > 0 and p["cpu_s"]["router-a"] > 0  # both took part in every phase
    summary = d["summary"]
    assert set(summary["b_over_a"]) == {
        "tok/s",
        "req/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "routers CPU ms/tok",
        "workers CPU ms/tok",
    }
    assert all(v is not None and v > 0 for v in summary["b_over_a"].values())
    assert sum(summary["pooled_b"]["finished"].values()) == 2 * N
    for text in ("| phase | routers |", "| B / A |", "goal 'load spread within 20%'", "router-a 4 / router-b 4"):
        assert text in printed
    for url in d["routers"]:  # every process stopped: the routers no longer answer
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2, trust_env=False)
