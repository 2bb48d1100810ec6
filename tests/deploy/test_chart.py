"""The Helm chart, rendered by a real helm and validated against Kubernetes' own schemas, offline.

Each profile in charts/rackserve/ci passes `helm lint --strict` and renders to objects that pass
`kubernetes-validate --strict`; the tests then read the rendered objects a user depends on — ports, probes,
resources, env — and feed the workers' rendered env to the real argument parsers, so a value name that drifts
from its CLI flag fails here.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.decode.server import add_arguments as decode_arguments
from services.frontend.app import FrontendConfig
from services.frontend.server import add_arguments as frontend_arguments
from services.planner.server import add_arguments as planner_arguments
from services.prefill.server import add_arguments as prefill_arguments
from services.router.server import add_arguments as router_arguments
from tests.support.paths import REPO

pytestmark = pytest.mark.cluster  # starts helm

ROOT = REPO
CHART = ROOT / "charts" / "rackserve"
BIN = Path(sys.executable).parent
HELM = BIN / "helm"
GPU_PROFILE = CHART / "ci" / "gpu-rdma-multirack-values.yaml"
PARSERS = {
    "frontend": frontend_arguments,
    "router": router_arguments,
    "prefill": prefill_arguments,
    "decode": decode_arguments,
    "planner": planner_arguments,
}
PLANNER_PROFILE = CHART / "ci" / "planner-kubernetes-values.yaml"


@pytest.fixture(autouse=True)
def _helm_installed() -> None:
    if not HELM.exists():  # a missing tool is a broken setup, not a reason to pass
        pytest.fail(f"{HELM} missing: run `python scripts/get_helm.py` (make setup does)")


def helm(*args: str, chart: Path = CHART) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args, str(chart)], capture_output=True, text=True, timeout=120)


@functools.cache
def render_text(*args: str) -> str:
    out = subprocess.run(
        [str(HELM), "template", "rs", str(CHART), "--namespace", "llm", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def render(*args: str, chart: Path = CHART) -> list[dict[str, Any]]:
    if chart == CHART:
        text = render_text(*args)
    else:
        out = subprocess.run(
            [str(HELM), "template", "rs", str(chart), "--namespace", "llm", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        text = out.stdout
    return [d for d in yaml.safe_load_all(text) if d]


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {[(o['kind'], o['metadata']['name']) for o in objs]}"
    return matches[0]


def container(obj: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    containers = obj["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if name is None or c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


PROFILES = sorted(p.name for p in (CHART / "ci").glob("*.yaml"))


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_passes_helm_lint_strict(profile: str) -> None:
    out = helm("lint", "--strict", "-f", str(CHART / "ci" / profile))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_renders_objects_kubernetes_accepts_strictly(profile: str) -> None:
    manifest = render_text("-f", str(CHART / "ci" / profile))
    out = subprocess.run(
        [str(BIN / "kubernetes-validate"), "--strict", "-"],
        input=manifest,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(manifest) if d}
    # every built-in kind was checked (CRDs like ServiceMonitor have no schema in the wheel: warned, not passed)
    passed = out.stdout + out.stderr
    for kind in kinds - {"ServiceMonitor", "PodMonitor", "PrometheusRule"}:
        assert f"passed for resource {kind.lower()}/" in passed, kind


def test_defaults_serve_openai_on_the_frontend_service_and_run_two_routers() -> None:
    objs = render()
    svc = find(objs, "Service", "rs-rackserve-frontend")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    fe = find(objs, "Deployment", "rs-rackserve-frontend")
    c = container(fe)
    assert c["ports"][0] == {"name": "http", "containerPort": 8000, "protocol": "TCP"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    env = env_of(c)
    assert env["RACKSERVE_HOST"] == "0.0.0.0" and env["RACKSERVE_PORT"] == "8000"
    assert env["RACKSERVE_ETCD"] == "http://rs-rackserve-etcd-0.rs-rackserve-etcd-headless.llm.svc:2379"
    assert find(objs, "Deployment", "rs-rackserve-router")["spec"]["replicas"] >= 2
    assert find(objs, "StatefulSet", "rs-rackserve-etcd")["spec"]["replicas"] == 1
    # the frontend reaches routers and workers through etcd, so no Service exposes them
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "Service"} == {
        "rs-rackserve-frontend",
        "rs-rackserve-etcd-headless",
    }


@pytest.mark.parametrize("role", ["router", "prefill", "decode"])
def test_grpc_services_register_their_pod_ip_and_are_probed_over_grpc_health(role: str) -> None:
    objs = render()
    dep = find(objs, "Deployment", f"rs-rackserve-{role}")
    c = container(dep, role)
    env = env_of(c)
    assert env["RACKSERVE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["RACKSERVE_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["RACKSERVE_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["RACKSERVE_PORT"] == "50051" and env["RACKSERVE_HEALTH_PORT"] == "50052"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50052}, probe
    # the kubelet waits out a whole drain: grace = --drain-grace-s + margin, and liveness outlasts the drain
    spec = dep["spec"]["template"]["spec"]
    assert env["RACKSERVE_DRAIN_GRACE_S"] == "30"
    assert spec["terminationGracePeriodSeconds"] == 30 + 15
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > 30
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
    assert spec["automountServiceAccountToken"] is False


def test_a_rolled_frontend_is_given_the_time_to_finish_its_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """On SIGTERM the frontend lets each request in flight run to its deadline (--request-timeout-s) plus a stalled
    client's grace, then exits; the kubelet SIGKILLs it at terminationGracePeriodSeconds, cutting every stream still
    running (the workers' drainGraceSeconds plus the margin, 45 s by default, cut a 1,100-token CPU stream at 650)."""
    # a preStop sleep longer than terminationMarginSeconds: the grace must count the sleep, not the margin for it
    long_sleep = ("--set", "frontend.preStopSleepSeconds=30")
    for args in ((), ("--set", "frontend.flags.request-timeout-s=120"), ("-f", str(GPU_PROFILE)), long_sleep):
        dep = find(render(*args), "Deployment", "rs-rackserve-frontend")
        flags = _parse_with_env("frontend", env_of(container(dep, "frontend")), monkeypatch)
        drain_s = flags.request_timeout_s + FrontendConfig.stalled_client_grace_s
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > prestop_s(dep) + drain_s, (
            args
        )


def prestop_s(dep: dict[str, Any]) -> int:
    """How long the frontend's preStop hook sleeps before the kubelet sends it SIGTERM."""
    command = (
        container(dep, "frontend").get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    )
    return int(command[1]) if command and command[0] == "sleep" else 0


def test_a_deleted_frontend_serves_until_the_service_has_dropped_it() -> None:
    """A SIGTERMed frontend closes its port at once (connection refused 0.1 s later in a real run), while the
    Service's endpoints, kube-proxy and load balancers go on sending it requests for some seconds: a preStop sleep
    keeps it serving that long before the SIGTERM, within its grace; 0 turns it off."""
    dep = find(render(), "Deployment", "rs-rackserve-frontend")
    assert prestop_s(dep) >= 5
    dep = find(render("--set", "frontend.preStopSleepSeconds=0"), "Deployment", "rs-rackserve-frontend")
    assert "lifecycle" not in container(dep, "frontend")


def test_gpu_rdma_profile_requests_gpus_rdma_and_pins_memory() -> None:
    objs = render("-f", str(GPU_PROFILE))
    for role, replicas in (("prefill", 4), ("decode", 8)):
        dep = find(objs, "Deployment", f"rs-rackserve-{role}")
        assert dep["spec"]["replicas"] == replicas
        spec = dep["spec"]["template"]["spec"]
        c = container(dep, role)
        for side in ("requests", "limits"):
            assert c["resources"][side]["nvidia.com/gpu"] == 1
            assert c["resources"][side]["rdma/rdma_shared_device_a"] == 1
        assert c["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"], "drop": ["ALL"]}
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        env = env_of(c)
        assert env["RACKSERVE_QUANT"] == "nvfp4"
        assert env["RACKSERVE_KV_TIER2_BYTES"] == "68719476736"  # not 6.8719476736e+10
        assert env["RACKSERVE_MODEL"] == "/models/Llama-3.1-70B-Instruct-NVFP4"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
        assert env["RACKSERVE_TLS_SERVER_NAME"] == "rackserve.internal"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {
            "claimName": "llama-3.1-70b-instruct-nvfp4",
            "readOnly": True,
        }
        assert volumes["dshm"]["hostPath"]["path"] == "/dev/shm"
        assert volumes["tls"]["secret"]["secretName"] == "rackserve-internal-tls"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm" and mounts["model"] == "/models"
        assert spec["terminationGracePeriodSeconds"] == 60 + 15
    prefill = find(objs, "Deployment", "rs-rackserve-prefill")
    assert (
        env_of(container(prefill, "prefill"))["RACKSERVE_MAX_NUM_BATCHED_TOKENS"] == "16384"
    )  # pool override
    decode = find(objs, "Deployment", "rs-rackserve-decode")
    assert env_of(container(decode, "decode"))["RACKSERVE_MAX_NUM_BATCHED_TOKENS"] == "8192"
    etcd = find(objs, "StatefulSet", "rs-rackserve-etcd")
    initial = next(a for a in container(etcd)["args"] if a.startswith("--initial-cluster="))
    assert initial.count("=http://") == 3
    assert etcd["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "4Gi"
    assert find(objs, "PodDisruptionBudget", "rs-rackserve-etcd")["spec"]["maxUnavailable"] == 1
    fe = container(find(objs, "Deployment", "rs-rackserve-frontend"))
    assert env_of(fe)["RACKSERVE_API_KEY_FILE"] == "/etc/rackserve/api-keys/keys"
    assert "RACKSERVE_API_KEY" not in env_of(fe)
    kinds = {o["kind"] for o in objs}
    assert {"ServiceMonitor", "PodMonitor"} <= kinds


def test_topology_labels_reach_workers_from_the_node() -> None:
    objs = render("-f", str(GPU_PROFILE))
    dep = find(objs, "Deployment", "rs-rackserve-decode")
    spec = dep["spec"]["template"]["spec"]
    init = next(c for c in spec["initContainers"] if c["name"] == "topology")
    init_env = env_of(init)
    assert init_env["ZONE_LABEL"] == "topology.kubernetes.io/zone"
    assert init_env["RACK_LABEL"] == "topology.rackserve.io/rack"
    assert init_env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    # the init container's script writes RACKSERVE_ZONE/RACK; the service reads them through the shell it starts
    assert "RACKSERVE_{name}=" in init["args"][0]
    assert container(dep, "decode")["command"][-1].endswith("exec rackserve decode")
    # the API token only in the init container, read-only, short-lived
    assert spec["automountServiceAccountToken"] is False
    api = next(v for v in spec["volumes"] if v["name"] == "kube-api")
    assert api["projected"]["sources"][0]["serviceAccountToken"]["expirationSeconds"] == 600
    assert "kube-api" not in {m["name"] for m in container(dep, "decode")["volumeMounts"]}
    role = find(objs, "ClusterRole", "rs-rackserve-llm-node-topology")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    # static per-pool labels instead
    objs = render(
        "--set", "topology.fromNodeLabels=false", "--set", "decode.rack=r7", "--set", "decode.zone=z1"
    )
    c = container(find(objs, "Deployment", "rs-rackserve-decode"), "decode")
    assert env_of(c)["RACKSERVE_RACK"] == "r7" and env_of(c)["RACKSERVE_ZONE"] == "z1"
    assert c["args"] == ["decode"]
    assert not any(o["kind"] == "ClusterRole" for o in objs)


def _parse_with_env(role: str, env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    for name in [n for n in os.environ if n.startswith("RACKSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("RACKSERVE_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    PARSERS[role](parser)
    return parser.parse_args([])


@pytest.mark.parametrize("role", ["frontend", "router", "prefill", "decode", "planner"])
def test_rendered_env_parses_with_the_services_real_flags(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every RACKSERVE_* variable the chart sets is a flag of that service and holds a value the flag accepts."""
    objs = render("-f", str(GPU_PROFILE), "-f", str(PLANNER_PROFILE))
    c = container(find(objs, "Deployment", f"rs-rackserve-{role}"), role)
    env = env_of(c)
    parser = argparse.ArgumentParser()
    PARSERS[role](parser)
    known = {a.dest for a in parser._actions}
    for name in env:
        if (
            name.startswith("RACKSERVE_") and name != "RACKSERVE_METRICS_PORT"
        ):  # --metrics-port: observability
            assert name.removeprefix("RACKSERVE_").lower() in known, (
                f"{role}: {name} is no flag of the service"
            )
    args = _parse_with_env(role, env, monkeypatch)
    assert args.etcd.count("http://") == 3
    if role in ("prefill", "decode"):
        assert (
            args.quant == "nvfp4"
            and args.no_prefix_caching is False
            and args.kv_cache_bytes == 0
            and args.gpu_memory_utilization == 0.9  # planned on the GPU
        )
        assert args.device == "cuda", "a pool given GPUs must compute on them, not fall back to the CPU"
        assert args.kv_backends == ("nixl", "tcp", "shm") and args.health_port == 50052
        assert args.tls_ca_file == "/etc/rackserve/tls/ca.crt"
    if role == "frontend":
        assert args.rate_limit_rps == 20.0 and args.api_key_file == "/etc/rackserve/api-keys/keys"
    if role == "planner":
        assert args.scale_mode == "kubernetes" and args.max_workers == 6


EXTERNAL_ETCD = (
    "etcd.mode=external,etcd.external.endpoints[0]=https://etcd:2379,etcd.external.tlsSecret=etcd-client"
)


def test_an_etcd_that_requires_client_certificates_gets_the_secrets_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """etcd.external.tlsSecret's tls.crt and tls.key (values.yaml: for client-cert auth) reach every service as
    --etcd-cert-file and --etcd-key-file, files of the Secret's mount: without them an etcd run with
    --client-cert-auth refuses the handshake (BAD_CERTIFICATE) and no service registers."""
    objs = render("--set", f"{EXTERNAL_ETCD},etcd.external.clientCert=true,planner.enabled=true")
    for role in PARSERS:
        dep = find(objs, "Deployment", f"rs-rackserve-{role}")
        c = container(dep, role)
        mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "etcd-tls")
        volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "etcd-tls")
        assert volume["secret"]["secretName"] == "etcd-client"
        args = _parse_with_env(role, env_of(c), monkeypatch)
        assert (args.etcd_ca_file, args.etcd_cert_file, args.etcd_key_file) == (
            f"{mount}/ca.crt",
            f"{mount}/tls.crt",
            f"{mount}/tls.key",
        ), role
    # a Secret with ca.crt alone (etcd's server CA, no client certificate) stays the default
    c = container(find(render("--set", EXTERNAL_ETCD), "Deployment", "rs-rackserve-decode"), "decode")
    args = _parse_with_env("decode", env_of(c), monkeypatch)
    assert args.etcd_ca_file and not args.etcd_cert_file and not args.etcd_key_file


# where each pod serves /metrics: the env variable holding that port (the frontend and planner: their HTTP port)
METRICS_PORT_ENV = {
    "frontend": "RACKSERVE_PORT",
    "router": "RACKSERVE_METRICS_PORT",
    "prefill": "RACKSERVE_METRICS_PORT",
    "decode": "RACKSERVE_METRICS_PORT",
    "planner": "RACKSERVE_PORT",
}


@pytest.mark.parametrize("profile", PROFILES)
def test_every_pod_asks_to_be_scraped_on_the_port_that_serves_its_metrics(profile: str) -> None:
    """deploy/prometheus/prometheus.yml keeps only pods annotated prometheus.io/scrape, at prometheus.io/port."""
    objs = render("-f", str(CHART / "ci" / profile), "--set", "planner.enabled=true")
    for role, port_env in METRICS_PORT_ENV.items():
        dep = find(objs, "Deployment", f"rs-rackserve-{role}")
        template, c = dep["spec"]["template"], container(dep, role)
        notes = template["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") == "true", (role, notes)
        assert notes["prometheus.io/path"] == "/metrics"
        port = int(notes["prometheus.io/port"])
        assert str(port) == env_of(c)[port_env], (role, port)
        assert port in {p["containerPort"] for p in c["ports"]}, (role, c["ports"])
    # the planner dials a frontend's registered endpoint for its /metrics: the pod's IP, not its bare name
    fe_env = env_of(container(find(objs, "Deployment", "rs-rackserve-frontend"), "frontend"))
    assert fe_env["RACKSERVE_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_one_tracing_value_reaches_every_traced_service(monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render("--set", "tracing.otlpEndpoint=http://otel-collector.observability:4317")
    for role in ("frontend", "router", "prefill", "decode"):
        env = env_of(container(find(objs, "Deployment", f"rs-rackserve-{role}"), role))
        assert (
            _parse_with_env(role, env, monkeypatch).otlp_endpoint
            == "http://otel-collector.observability:4317"
        )
    assert all(
        "RACKSERVE_OTLP_ENDPOINT"
        not in env_of(container(find(render(), "Deployment", f"rs-rackserve-{r}"), r))
        for r in ("frontend", "decode")
    )


def test_scrape_annotations_can_be_turned_off_and_the_users_own_win() -> None:
    objs = render(
        "--set", "metrics.scrapeAnnotations=false", "--set", "router.podAnnotations.team=inference"
    )  # fmt: skip
    router = find(objs, "Deployment", "rs-rackserve-router")["spec"]["template"]["metadata"]
    assert router["annotations"] == {"team": "inference"}
    assert (
        "annotations" not in find(objs, "Deployment", "rs-rackserve-decode")["spec"]["template"]["metadata"]
    )
    objs = render("--set-string", "decode.podAnnotations.prometheus\\.io/scrape=false")
    notes = find(objs, "Deployment", "rs-rackserve-decode")["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "false" and notes["prometheus.io/port"] == "9090"


def test_the_operators_monitors_reach_every_service_that_serves_metrics() -> None:
    objs = render(
        "-f", str(GPU_PROFILE), "--set", "planner.enabled=true", "--set", "metrics.podMonitor.enabled=true"
    )  # fmt: skip
    monitor = find(objs, "PodMonitor", "rs-rackserve-services")["spec"]
    selected = next(
        e["values"]
        for e in monitor["selector"]["matchExpressions"]
        if e["key"] == "app.kubernetes.io/component"
    )
    endpoint_ports = {e["port"] for e in monitor["podMetricsEndpoints"]}
    for role in ("router", "prefill", "decode", "planner"):
        assert role in selected
        c = container(find(objs, "Deployment", f"rs-rackserve-{role}"), role)
        served_on = {
            p["name"] for p in c["ports"] if str(p["containerPort"]) == env_of(c)[METRICS_PORT_ENV[role]]
        }
        assert served_on & endpoint_ports, (role, c["ports"])
    # the frontend (a ServiceMonitor on its Service's http port) must be reachable from the monitoring namespace
    # on that port even where the profile admits only the ingress controller's clients
    policy = find(objs, "NetworkPolicy", "rs-rackserve-frontend")["spec"]["ingress"]
    on_http = [r for r in policy if {"port": 8000, "protocol": "TCP"} in r["ports"]]
    sources = [s for r in on_http for s in r.get("from", [])]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in sources
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}} in sources


def test_cpu_pools_keep_device_auto_and_an_explicit_device_wins() -> None:
    objs = render()
    for role in ("prefill", "decode"):
        env = env_of(container(find(objs, "Deployment", f"rs-rackserve-{role}"), role))
        assert env.get("RACKSERVE_DEVICE") == "auto"
    objs = render("-f", str(GPU_PROFILE), "--set", "decode.engine.device=cuda:1")
    env = env_of(container(find(objs, "Deployment", "rs-rackserve-decode"), "decode"))
    assert env["RACKSERVE_DEVICE"] == "cuda:1"


def test_the_kv_disk_tier_gets_a_volume_of_its_own_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default (no path, no volume); on, each worker's --kv-disk-path is a mount of its own: the pod's
    emptyDir sized from kv-disk-bytes, or a hostPath / PVC subdirectory named after the pod."""
    objs = render()
    for role in ("prefill", "decode"):
        dep = find(objs, "Deployment", f"rs-rackserve-{role}")
        assert "RACKSERVE_KV_DISK_PATH" not in env_of(container(dep, role))
        assert "kv-disk" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    objs = render("--set", "engine.kv-disk-bytes=10737418240")
    dep = find(objs, "Deployment", "rs-rackserve-decode")
    c = container(dep, "decode")
    env = env_of(c)
    assert env["RACKSERVE_KV_DISK_PATH"] == "/var/cache/rackserve/kv"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "kv-disk")
    assert mount["mountPath"] == "/var/cache/rackserve/kv" and "subPathExpr" not in mount
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "kv-disk")
    assert vol["emptyDir"]["sizeLimit"] == str(10737418240 * 11 // 10)
    args = _parse_with_env("decode", env, monkeypatch)
    assert args.kv_disk_path == "/var/cache/rackserve/kv" and args.kv_disk_bytes == 10737418240
    objs = render("-f", str(GPU_PROFILE))
    dep = find(objs, "Deployment", "rs-rackserve-prefill")
    c = container(dep, "prefill")
    mount = next(m for m in c["volumeMounts"] if m["name"] == "kv-disk")
    assert mount["subPathExpr"] == "$(POD_NAME)"
    assert env_of(c)["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "kv-disk")
    assert vol["hostPath"]["path"] == "/mnt/nvme/rackserve-kv"


def test_engine_values_carry_the_cli_flag_names() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for role in ("prefill", "decode"):
        parser = argparse.ArgumentParser()
        PARSERS[role](parser)
        flags = {s for a in parser._actions for s in a.option_strings}
        for key in [*values["engine"], *values[role]["flags"]]:
            assert f"--{key}" in flags, f"values {key!r} is not a flag of rackserve {role}"
    for role in ("frontend", "router"):
        parser = argparse.ArgumentParser()
        PARSERS[role](parser)
        flags = {s for a in parser._actions for s in a.option_strings}
        for key in values[role]["flags"]:
            assert f"--{key}" in flags, f"values {key!r} is not a flag of rackserve {role}"


@pytest.mark.parametrize(
    ("overrides", "complaint"),
    [
        (["--set", "engine.quant=fp4"], "/engine/quant"),
        (["--set", "decode.engine.nvfp4-gemm=w4a8"], "/decode/engine/nvfp4-gemm"),
        (["--set", "router.replicas=1"], "/router/replicas"),
        (["--set", "etcd.replicas=2"], "/etcd/replicas"),
        (["--set", "decode.flags.kv-backends=rdma"], "/decode/flags/kv-backends"),
        (["--set", "tls.enabled=true"], "/tls/secretName"),
        (["--set", "etcd.mode=external"], "/etcd/external/endpoints"),
        (
            [
                "--set",
                "etcd.mode=external,etcd.external.endpoints[0]=https://e:2379,etcd.external.clientCert=true",
            ],
            "/etcd/external/tlsSecret",
        ),
        (["--set", "prefil.replicas=2"], "prefil"),
        (["--set", "frontend.flags.api-key=sk-123"], "/frontend/flags/api-key"),
        (["--set", "model.source=s3"], "/model/source"),
        (["--set", "kvDisk.volume=pvc"], "/kvDisk/claimName"),
        (["--set", "kvDisk.volume=nfs"], "/kvDisk/volume"),
        (["--set", "engine.kv-disk-bytes=-1"], "/engine/kv-disk-bytes"),
        (["--set", "planner.replicas=0"], "/planner/replicas"),
        (["--set", "planner.flags.floor-except=Christmas"], "/planner/flags/floor-except"),
    ],
)
def test_bad_values_fail_lint_naming_the_value(overrides: list[str], complaint: str) -> None:
    out = subprocess.run(
        [str(HELM), "lint", "--strict", str(CHART), *overrides], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert complaint in out.stdout + out.stderr


def test_network_policies_admit_only_the_paths_requests_take() -> None:
    objs = render()
    instance = {"app.kubernetes.io/name": "rackserve", "app.kubernetes.io/instance": "rs"}
    frontend = {**instance, "app.kubernetes.io/component": "frontend"}
    router = {**instance, "app.kubernetes.io/component": "router"}
    worker = {**instance, "rackserve.io/worker": "true"}
    pol = find(objs, "NetworkPolicy", "rs-rackserve-router")["spec"]
    assert pol["podSelector"]["matchLabels"] == router
    grpc_rules = [r for r in pol["ingress"] if {"port": 50051, "protocol": "TCP"} in r.get("ports", [])]
    assert grpc_rules == [
        {"from": [{"podSelector": {"matchLabels": frontend}}], "ports": grpc_rules[0]["ports"]}
    ]
    pol = find(objs, "NetworkPolicy", "rs-rackserve-workers")["spec"]
    assert pol["podSelector"]["matchLabels"] == worker
    for rule in pol["ingress"]:
        sources = [s.get("podSelector", {}).get("matchLabels") for s in rule.get("from", [])]
        ports = [p["port"] for p in rule.get("ports", [])]
        if "ports" not in rule:  # all ports, the transfer listeners included: other workers only
            assert sources == [worker]
        elif 50051 in ports:
            assert sources == [frontend, router] and ports == [50051]
        elif 50052 in ports:
            assert ports == [50052]  # health answers SERVING or not; the kubelet probes it
        else:
            assert ports == [9090] and "namespaceSelector" in rule["from"][0]
    for kind_name in ("rs-rackserve-frontend", "rs-rackserve-etcd"):
        assert find(objs, "NetworkPolicy", kind_name)["spec"]["policyTypes"] == ["Ingress"]
    etcd = find(objs, "NetworkPolicy", "rs-rackserve-etcd")["spec"]["ingress"]
    assert etcd[0] == {
        "from": [{"podSelector": {"matchLabels": instance}}],
        "ports": [{"port": 2379, "protocol": "TCP"}],
    }


def test_every_tier_has_a_disruption_budget_and_its_own_service_account() -> None:
    objs = render()
    pdbs = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "PodDisruptionBudget"}
    assert pdbs["rs-rackserve-frontend"]["minAvailable"] == 1
    assert pdbs["rs-rackserve-router"]["minAvailable"] == 1
    assert pdbs["rs-rackserve-decode"]["maxUnavailable"] == 1
    assert pdbs["rs-rackserve-prefill"]["maxUnavailable"] == 1
    accounts = {o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"}
    for component in ("frontend", "router", "worker", "etcd"):
        assert f"rs-rackserve-{component}" in accounts
    for role in ("frontend", "router", "prefill", "decode"):
        dep = find(objs, "Deployment", f"rs-rackserve-{role}")
        expected = "rs-rackserve-worker" if role in ("prefill", "decode") else f"rs-rackserve-{role}"
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == expected


@pytest.fixture
def chart_copy(tmp_path: Path) -> Iterator[Path]:
    """The chart with real files/grafana and files/prometheus folders (the branch's deploy/ folders may be empty)."""
    dest = tmp_path / "rackserve"
    shutil.copytree(CHART, dest, symlinks=False, ignore=shutil.ignore_patterns("grafana", "prometheus"))
    (dest / "files" / "grafana").mkdir(parents=True)
    (dest / "files" / "prometheus").mkdir(parents=True)
    yield dest


def test_dashboards_and_alerts_render_from_files_and_nothing_without_them(chart_copy: Path) -> None:
    objs = render("--set", "prometheusRule.enabled=true", chart=chart_copy)
    assert not [o for o in objs if o["kind"] in ("ConfigMap", "PrometheusRule")]
    dashboard = {"title": "rackserve TTFT", "panels": [{"type": "timeseries", "title": 'p99 "TTFT"'}]}
    (chart_copy / "files" / "grafana" / "ttft.json").write_text(json.dumps(dashboard, indent=2))
    rules = {"groups": [{"name": "rackserve", "rules": [{"alert": "NoDecodeWorkers", "expr": "x == 0"}]}]}
    (chart_copy / "files" / "prometheus" / "rules.yml").write_text(yaml.safe_dump(rules))
    objs = render(
        "--set", "prometheusRule.enabled=true", "--set", "prometheusRule.labels.release=kps", chart=chart_copy
    )
    cm = find(objs, "ConfigMap", "rs-rackserve-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["ttft.json"]) == dashboard
    rule = find(objs, "PrometheusRule", "rs-rackserve-alerts")
    assert rule["spec"] == rules and rule["metadata"]["labels"]["release"] == "kps"


def test_chart_files_follow_the_symlinks_into_deploy() -> None:
    """charts/rackserve/files/{grafana,prometheus} are symlinks to deploy/: helm reads through them (no copy step),
    so the dashboards and rules live in one place."""
    for name in ("grafana", "prometheus"):
        link = CHART / "files" / name
        assert link.is_symlink() and link.resolve() == (ROOT / "deploy" / name).resolve()
    out = helm("template", "rs", "--set", "prometheusRule.enabled=true")
    assert out.returncode == 0, out.stderr
    have_dashboards = any((ROOT / "deploy" / "grafana").glob("*.json"))
    assert ("kind: ConfigMap" in out.stdout) == have_dashboards
    have_rules = (ROOT / "deploy" / "prometheus" / "rules.yml").exists()
    assert ("kind: PrometheusRule" in out.stdout) == have_rules
