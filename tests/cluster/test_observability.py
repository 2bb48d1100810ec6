"""Observability of a real disaggregated cluster: traces, timelines, the request log, /metrics, Prometheus.

One module-scoped cluster: a real etcd, a router in `--mode disagg`, a prefill and a decode worker (SmolLM2 in
float32), and the frontend process, each exporting spans over OTLP/gRPC to a real trace receiver in this
process (opentelemetry-proto's TraceService on a loopback gRPC server) and serving /metrics. The tests send
requests through the frontend like a client would and look at what an operator would: one connected trace per
request, the timeline endpoint, the request log and its waterfall, every metric the dashboards and alert
rules name, and a real Prometheus scraping the cluster.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.frontend.server import DEFAULT_MODEL_NAME
from tests.support.cluster import (
    WORKER_FLAGS,
    LocalCluster,
    Proc,
    local_cluster,
    start_process,
    wait_frontend_ready,
)
from tests.support.etcd import free_port
from tests.support.otlp import TraceReceiver, trace_receiver
from tests.support.paths import REPO
from tests.telemetry.test_telemetry import PROMETHEUS, dashboard_exprs, metric_names, rule_exprs

SPAN_WAIT_S = 30.0
PHASE_SPANS = {"request", "queue", "route", "prefill", "kv_transfer", "decode"}
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@dataclass
class Rig:
    cluster: LocalCluster
    url: str
    receiver: TraceReceiver
    request_log: Path
    log_dir: Path
    answers: dict[str, httpx.Response] = field(default_factory=dict)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    log_dir = tmp_path_factory.mktemp("observability")
    with trace_receiver() as (receiver, otlp_endpoint):
        yield from _cluster(log_dir, receiver, otlp_endpoint)


def _cluster(log_dir: Path, receiver: TraceReceiver, otlp_endpoint: str) -> Iterator[Rig]:
    telemetry = ["--otlp-endpoint", otlp_endpoint, "--otlp-batch-delay-ms", "200"]
    request_log = log_dir / "requests.jsonl"

    def start(etcd_url: str) -> list[Proc]:
        d = str(log_dir)
        return [
            start_process("services.router.server", "router-a", etcd_url, d, "--mode", "disagg", *telemetry),
            start_process("services.prefill.server", "prefill-a", etcd_url, d, *WORKER_FLAGS, *telemetry),
            start_process("services.decode.server", "decode-a", etcd_url, d, *WORKER_FLAGS, *telemetry),
            start_process(
                "services.frontend.server",
                "frontend-a",
                etcd_url,
                d,
                "--request-log",
                str(request_log),
                *telemetry,
            ),
        ]

    with local_cluster(str(log_dir), start, {"router": 1, "prefill": 1, "decode": 1, "frontend": 1}) as c:
        url = f"http://{c.endpoints['frontend-a']}"
        wait_frontend_ready(url, ("router", "prefill", "decode"), 60.0)
        yield Rig(c, url, receiver, request_log, log_dir)


def chat(
    rig: Rig, question: str, headers: dict[str, str] | None = None, max_tokens: int = 8
) -> httpx.Response:
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = httpx.post(f"{rig.url}/v1/chat/completions", json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def traced(rig: Rig) -> httpx.Response:
    """One disaggregated request that continues the client's own trace."""
    headers = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01", "x-request-id": "client-abc-1"}
    return chat(rig, "What is the capital of France?", headers)


def _spans_of(rig: Rig, request_id: str, names: set[str]) -> list[dict[str, Any]]:
    deadline = time.monotonic() + SPAN_WAIT_S
    while time.monotonic() < deadline:
        spans = rig.receiver.of_request(request_id)
        if names <= {s["name"] for s in spans}:
            return spans
        time.sleep(0.2)
    got = sorted({s["name"] for s in rig.receiver.of_request(request_id)})
    raise AssertionError(f"spans of {request_id}: got {got}, want {sorted(names)}")


def test_disaggregated_request_leaves_one_connected_trace_with_every_phase(
    rig: Rig, traced: httpx.Response
) -> None:
    request_id = traced.headers["x-rackserve-request-id"]
    spans = _spans_of(rig, request_id, PHASE_SPANS | {"queue_wait", "compute"})
    by_name = {s["name"]: s for s in spans}
    request = by_name["request"]
    # one trace, the client's: the request span hangs under the client's span, everything else under it
    assert {s["trace_id"] for s in spans} == {CLIENT_TRACE_ID}
    assert request["parent_span_id"] == CLIENT_SPAN_ID and request["service"] == "rackserve-frontend"
    for name, service in (("queue", "frontend"), ("route", "router"), ("prefill", "prefill"),
                          ("kv_transfer", "decode"), ("decode", "frontend")):  # fmt: skip
        span = by_name[name]
        assert span["parent_span_id"] == request["span_id"], name
        assert span["service"] == f"rackserve-{service}", name
        assert request["start_ns"] <= span["start_ns"] <= span["end_ns"] <= request["end_ns"] + 50_000_000, (
            name
        )
    for name in ("queue_wait", "compute"):
        assert by_name[name]["parent_span_id"] == by_name["prefill"]["span_id"]
    # the phases carry what an operator asks first
    route = by_name["route"]["attributes"]
    assert (
        route["rackserve.route.reason"].startswith("disagg") and route["rackserve.route.score.disagg"] == 1.0
    )
    prefill = by_name["prefill"]["attributes"]
    assert prefill["rackserve.prompt_tokens"] > 10 and prefill["rackserve.cached_tokens"] >= 0
    assert prefill["rackserve.queue_s"] >= 0 and prefill["rackserve.compute_s"] > 0
    transfer = by_name["kv_transfer"]["attributes"]
    assert transfer["rackserve.transfer_bytes"] > 0 and transfer["rackserve.transfer_backend"] in (
        "tcp",
        "shm",
        "nixl",
    )
    assert transfer["rackserve.transfer_s"] > 0 and transfer["rackserve.transfer_gb_per_s"] > 0
    usage = traced.json()["usage"]
    assert by_name["decode"]["attributes"]["rackserve.tokens"] == usage["completion_tokens"]
    assert request["attributes"]["rackserve.client_request_id"] == "client-abc-1"
    assert request["attributes"]["http.response.status_code"] == 200


def test_a_request_without_a_traceparent_leaves_one_trace_and_the_frontend_no_other(rig: Rig) -> None:
    answer = chat(rig, "Name a colour.")
    request_id = answer.headers["x-rackserve-request-id"]
    spans = _spans_of(rig, request_id, PHASE_SPANS)
    trace_id = httpx.get(f"{rig.url}/v1/requests/{request_id}/timeline", timeout=10).json()["trace_id"]
    # the frontend's spans and the workers' in the one trace the timeline names, the request span its root
    assert {s["trace_id"] for s in spans} == {trace_id}
    assert next(s for s in spans if s["name"] == "request")["parent_span_id"] == ""
    # and no trace of FastAPI's own beside it (FastAPI 0.16x traces every HTTP exchange, probes included)
    time.sleep(1.0)
    roots = {
        s["name"]
        for s in rig.receiver.spans
        if s["service"] == "rackserve-frontend" and not s["parent_span_id"]
    }
    assert roots == {"request"}


def test_timeline_endpoint_serves_phases_workers_bytes_and_reason(rig: Rig, traced: httpx.Response) -> None:
    request_id = traced.headers["x-rackserve-request-id"]
    r = httpx.get(f"{rig.url}/v1/requests/{request_id}/timeline", timeout=10)
    assert r.status_code == 200
    t = r.json()
    assert [p["phase"] for p in t["phases"]] == ["queued", "routed", "prefilling", "transferring", "decoding"]
    assert all(p["duration_s"] >= 0 for p in t["phases"])
    assert abs(sum(p["duration_s"] for p in t["phases"]) - t["duration_s"]) < 1e-3
    assert t["workers"] == {"prefill": "prefill-a", "decode": "decode-a"}
    assert t["route"]["reason"].startswith("disagg") and t["status"] == 200 and t["phase"] == "done"
    assert t["transfer"]["bytes"] > 0 and t["transfer"]["gb_per_s"] > 0
    assert (
        t["trace_id"] == CLIENT_TRACE_ID
        and t["completion_tokens"] == traced.json()["usage"]["completion_tokens"]
    )
    # the same record by the response id and by the client's own x-request-id
    assert httpx.get(f"{rig.url}/v1/requests/{traced.json()['id']}/timeline", timeout=10).json() == t
    assert httpx.get(f"{rig.url}/v1/requests/client-abc-1/timeline", timeout=10).json() == t

    missing = httpx.get(f"{rig.url}/v1/requests/no-such-request/timeline", timeout=10)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["type"] == "not_found_error" and error["code"] == "request_not_found"
    assert "no-such-request" in error["message"]


def test_request_log_has_one_line_per_request_without_the_prompt_and_draws_a_waterfall(
    rig: Rig, traced: httpx.Response
) -> None:
    request_id = traced.headers["x-rackserve-request-id"]
    lines = [json.loads(line) for line in rig.request_log.read_text().splitlines()]
    mine = [line for line in lines if line["request_id"] == request_id]
    assert len(mine) == 1
    assert "prompt_token_ids" not in mine[0] and "France" not in json.dumps(mine[0])
    assert mine[0]["transfer"]["bytes"] > 0

    out = rig.log_dir / "waterfall.html"
    run = subprocess.run(
        [sys.executable, "-m", "services.cli", "timeline", "--log", str(rig.request_log), "--last", "5",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    page = out.read_text()
    assert request_id in page and page.count('class="phase ') >= 5 and 'class="phase transferring"' in page


def scrape(endpoint: str) -> set[str]:
    """The series names an endpoint exports, including metrics declared without samples yet."""
    text = httpx.get(f"http://{endpoint}/metrics", timeout=10).text
    names: set[str] = set()
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_sum", "_count"],
        "gauge": [""],
        "summary": [""],
    }
    for family in text_string_to_metric_families(text):
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, [""]))
    return names


def test_every_service_exports_every_metric_the_dashboards_and_alerts_name(
    rig: Rig, traced: httpx.Response
) -> None:
    endpoints = {"frontend": rig.cluster.endpoints["frontend-a"]}
    for worker_id in ("router-a", "prefill-a", "decode-a"):
        info = rig.cluster.infos[worker_id]
        assert info.metrics_endpoint, f"{worker_id} registered no metrics endpoint"
        endpoints[info.role] = info.metrics_endpoint
    exported = {role: scrape(endpoint) for role, endpoint in endpoints.items()}
    everything = set().union(*exported.values())
    named = metric_names(dashboard_exprs() + rule_exprs())
    assert not named - everything, f"named but not exported: {sorted(named - everything)}"
    # each role exports its own numbers, with values from the request that just ran
    assert "rackserve_time_to_first_token_seconds_bucket" in exported["frontend"]
    assert "rackserve_router_decisions_total" in exported["router"]
    assert "rackserve_kv_transfer_bytes_bucket" in exported["decode"]
    assert (
        "rackserve_kv_usage_ratio" in exported["prefill"] and "rackserve_kv_usage_ratio" in exported["decode"]
    )
    decode_text = httpx.get(f"http://{endpoints['decode']}/metrics", timeout=10).text
    transfers = [
        s.value
        for f in text_string_to_metric_families(decode_text)
        for s in f.samples
        if s.name == "rackserve_kv_transfer_bytes_count"
    ]
    assert sum(transfers) >= 1


def test_real_prometheus_scrapes_the_cluster_and_answers_a_ttft_quantile(rig: Rig, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus missing: apt-get install prometheus")
    # the services are found as deploy/prometheus/prometheus.static.yml finds them: the frontend's HTTP service
    # discovery lists every registered /metrics, the workers' ephemeral metrics ports included
    want = {rig.cluster.endpoints["frontend-a"]: "frontend"}
    for worker_id in ("router-a", "prefill-a", "decode-a"):
        info = rig.cluster.infos[worker_id]
        want[info.metrics_endpoint] = info.role
    shutil.copy(PROMETHEUS / "rules.yml", tmp_path / "rules.yml")
    discovery = {"url": f"{rig.url}/metrics/targets", "refresh_interval": "1s"}
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "scrape_configs": [{"job_name": "rackserve", "http_sd_configs": [discovery]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    api = f"http://127.0.0.1:{port}/api/v1"
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
    try:
        up = _poll(lambda: _all_up(api, len(want)), "every target up")
        assert up
        active = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
        assert {t["labels"]["instance"]: t["labels"]["service"] for t in active} == want
        for i in range(3):  # after the first scrapes, so rate() sees the histogram grow
            chat(rig, f"Name a colour, number {i}.", max_tokens=4)
        query = (
            "histogram_quantile(0.5, sum by (le) (rate(rackserve_time_to_first_token_seconds_bucket[1m])))"
        )
        ttft = _poll(lambda: _scalar(api, query), "a TTFT quantile")
        assert 0 < ttft < 120
        rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
        unhealthy = [r["name"] for g in rules for r in g["rules"] if r["health"] == "err"]
        assert rules and not unhealthy, unhealthy
    except BaseException:
        print((tmp_path / "prometheus.log").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _all_up(api: str, n: int) -> bool | None:
    active = httpx.get(f"{api}/targets", timeout=5).json()["data"]["activeTargets"]
    return True if len(active) == n and all(t["health"] == "up" for t in active) else None


def _scalar(api: str, query: str) -> float | None:
    result = httpx.get(f"{api}/query", params={"query": query}, timeout=5).json()["data"]["result"]
    if not result:
        return None
    value = float(result[0]["value"][1])
    return value if math.isfinite(value) else None


def _poll(probe: Any, what: str, timeout_s: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value is not None:
                return value
        except (
            httpx.HTTPError,
            KeyError,
            ValueError,
        ) as e:  # ValueError: "Service Unavailable" while starting
            last = e
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never gave {what} (last error: {last})")
