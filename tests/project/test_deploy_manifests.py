"""Deployment files, checked offline: the Kubernetes manifests validate against the API schemas
(``kubernetes-validate``, strict), and they and ``docker/compose.yaml`` agree with the CLI they
run: every command line parses with the real ``pdserve`` parser, the routers' ``--worker`` list
or ``--discovery`` targets name exactly the workers that exist, the mounted preset is the shipped
one and loads, and every router and worker gets the cluster key (a Kubernetes Secret from kustomize's secretGenerator, a
compose secret) from a file that git ignores."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from configs.schema import load_config
from server.discovery.target import parse_targets
from server.launch.args import build_parser
from transfer.cluster_key import ClusterKey, parse_key_text, write_key_file

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
PRESET = ROOT / "configs" / "presets" / "pd-cluster.yaml"


def k8s_docs() -> list[dict]:
    docs = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in k8s_docs() if d["kind"] == kind}


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_k8s_manifests_validate_strictly(version):
    docs = k8s_docs()
    assert {d["kind"] for d in docs} == {"ConfigMap", "Service", "StatefulSet", "Deployment"}
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)


def test_k8s_validation_rejects_a_broken_manifest():
    sts = copy.deepcopy(by_kind("StatefulSet")["decode"])
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["commnd"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, kubernetes_validate.latest_version(), strict=True)
    sts = copy.deepcopy(by_kind("StatefulSet")["decode"])
    sts["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, kubernetes_validate.latest_version(), strict=True)


def test_k8s_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


def test_k8s_configmap_is_the_shipped_preset_and_loads():
    data = by_kind("ConfigMap")["pdserve-preset"]["data"]["pdserve.yaml"]
    assert data == PRESET.read_text()
    cfg = load_config(PRESET, environ={})
    assert cfg.cluster.mode == "pd" and cfg.server.host == "0.0.0.0"


def parse(args: list[str]):
    return build_parser().parse_args(args)


def test_k8s_router_discovers_the_statefulset_pods_through_their_headless_services():
    """The router's --discovery names each StatefulSet's headless Service, the role it runs and the
    port its pods listen on (so ``kubectl scale`` alone changes the workers); no fixed --worker list."""
    sts = by_kind("StatefulSet")
    expected = {
        (
            role,
            sts[role]["spec"]["serviceName"],
            sts[role]["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"],
        )
        for role in ("prefill", "decode")
    }
    router = by_kind("Deployment")["pdserve-router"]["spec"]["template"]["spec"]["containers"][0]
    args = parse(router["args"])
    assert args.command == "router" and args.config == "/etc/pdserve/pdserve.yaml" and args.worker == []
    assert {(t.role, t.name, t.port) for t in parse_targets(args.discovery)} == expected
    for role in ("prefill", "decode"):  # drained within the grace period
        pod = sts[role]["spec"]["template"]["spec"]
        drain = parse([a.replace("$(POD_NAME)", "x") for a in pod["containers"][0]["args"]]).drain_timeout_s
        assert 0 < drain < pod["terminationGracePeriodSeconds"]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health?require=any"
    services = by_kind("Service")
    assert services["pdserve"]["spec"]["selector"] == router_labels()
    for role in ("prefill", "decode"):
        assert services[role]["spec"]["clusterIP"] == "None"  # per-pod DNS names


def router_labels() -> dict:
    return by_kind("Deployment")["pdserve-router"]["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_k8s_worker_pods_run_their_role_and_probe_their_socket(role):
    spec = by_kind("StatefulSet")[role]["spec"]["template"]["spec"]
    c = spec["containers"][0]
    args = parse([a.replace("$(POD_NAME)", f"{role}-0") for a in c["args"]])
    assert (args.command, args.role, args.worker_id) == ("worker", role, f"{role}-0")
    assert {e["name"] for e in c["env"]} >= {"POD_NAME", "UCX_TLS"}
    port = int(args.control_addr.rsplit(":", 1)[1])
    assert c["ports"][0]["containerPort"] == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == ["pdserve", "probe", f"tcp://127.0.0.1:{port}"]
    assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]
    mount = c["volumeMounts"][0]["mountPath"]
    assert args.config.startswith(mount) and spec["volumes"][0]["configMap"]["name"] == "pdserve-preset"


def pod_specs() -> dict[str, dict]:
    pods = {**by_kind("StatefulSet"), **by_kind("Deployment")}
    return {name: d["spec"]["template"]["spec"] for name, d in pods.items()}


def git_ignores(path: Path) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0


def test_k8s_every_pod_gets_the_cluster_key_secret():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (gen,) = k["secretGenerator"]
    assert gen["files"] == ["cluster.key"] and git_ignores(K8S / "cluster.key")
    for name, spec in pod_specs().items():
        vol = next(v for v in spec["volumes"] if "secret" in v)
        assert vol["secret"]["secretName"] == gen["name"], name
        assert vol["secret"]["defaultMode"] & 0o007 == 0, name  # not world-readable
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"], name  # readable by the pod
        (c,) = spec["containers"]
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == vol["name"])
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PDSERVE_CLUSTER_KEY"] == f"{mount}/cluster.key", name


@pytest.mark.process
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_k8s_kustomize_renders_the_secret_every_pod_mounts(tmp_path):
    render = tmp_path / "k8s"
    shutil.copytree(K8S, render)
    key = ClusterKey.generate()
    write_key_file(render / "cluster.key", key)
    r = subprocess.run(["kubectl", "kustomize", str(render)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    kubernetes_validate.validate(secret, kubernetes_validate.latest_version(), strict=True)
    import base64

    assert parse_key_text(base64.b64decode(secret["data"]["cluster.key"]).decode(), "secret") == key
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    assert len(pods) == 3
    for spec in pods:  # kustomize renamed the Secret (content hash) and every reference with it
        assert secret["metadata"]["name"] in {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}


# ---- docker/compose.yaml -------------------------------------------------------------------------
COMPOSE = ROOT / "docker" / "compose.yaml"


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_routers_find_every_worker_service_through_dns():
    """Two routers, each resolving exactly the worker services (role, service name, control port)
    through compose's DNS; the workers name themselves (no --worker-id: replicas differ by hostname);
    each router publishes its own loopback port."""
    services = compose()["services"]
    routers = {n: parse(s["command"]) for n, s in services.items() if parse(s["command"]).command == "router"}
    workers = {n: parse(s["command"]) for n, s in services.items() if n not in routers}
    assert sorted(routers) == ["router", "router-b"] and sorted(workers) == ["decode", "prefill"]
    for name, a in workers.items():
        assert a.command == "worker" and a.worker_id is None and a.role == name
    expected = {(a.role, n, int(a.control_addr.rsplit(":", 1)[1])) for n, a in workers.items()}
    ports = set()
    for name, a in routers.items():
        assert a.worker == [] and {(t.role, t.name, t.port) for t in parse_targets(a.discovery)} == expected, name
        assert services[name]["depends_on"] == {n: {"condition": "service_healthy"} for n in workers}
        (published,) = services[name]["ports"]
        assert published.startswith("127.0.0.1:") and published.endswith(":8000")
        ports.add(published)
    assert len(ports) == 2, "each router needs its own host port"
    for s in services.values():
        assert s["healthcheck"]["test"] == ["CMD", "pdserve", "probe"] and s["restart"] == "unless-stopped"
        assert s["mem_limit"] and "models:/models" in s["volumes"]
        preset = next(v for v in s["volumes"] if v.endswith(":/etc/pdserve/pdserve.yaml:ro"))
        assert (COMPOSE.parent / preset.split(":")[0]).resolve() == PRESET


def test_compose_every_service_gets_the_cluster_key_secret():
    c = compose()
    (name,) = c["secrets"]
    default = c["secrets"][name]["file"].split(":-", 1)[1].rstrip("}")
    assert git_ignores(COMPOSE.parent / default)
    for service, s in c["services"].items():
        assert s["secrets"] == [name], service
        assert s["environment"]["PDSERVE_CLUSTER_KEY"] == f"/run/secrets/{name}", service


@pytest.mark.process
@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_file_is_valid_for_docker_compose():
    r = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
