"""Telemetry without a cluster: the deploy files (dashboards, Prometheus config, alert rules) are valid and
tested, route reasons make low-cardinality labels, and the timeline store and waterfall behave.

Whether the services export every metric these files name is tests/cluster/test_observability.py's job (it scrapes
a running cluster); so is everything about traces.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.models import dashboard, prometheus

from services.frontend.timeline import RecentTimelines
from services.launcher import add_arguments as launcher_arguments
from services.telemetry import metrics
from services.telemetry.waterfall import read_request_log, render_html
from tests.support.otlp import trace_receiver
from tests.support.paths import REPO

GRAFANA = REPO / "deploy" / "grafana"
PROMETHEUS = REPO / "deploy" / "prometheus"
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
METRIC_NAME = re.compile(r"\brackserve_[a-z0-9_]+")

promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool missing: apt-get install prometheus"
)


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(GRAFANA.glob("*.json"))}


def dashboard_exprs() -> list[str]:
    return [t["expr"] for d in dashboards().values() for p in d["panels"] for t in p.get("targets", [])]


def rule_exprs() -> list[str]:
    groups = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def metric_names(exprs: list[str]) -> set[str]:
    """Every rackserve_ series a set of expressions reads (recording rules, `rackserve:…`, are not metrics)."""
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)}


def promql(expr: str) -> Any:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return promql_parser.parse(expr)


@promtool
@pytest.mark.cluster
def test_prometheus_config_and_rules_pass_promtool_and_every_alert_unit_test_passes() -> None:
    for args in (
        ["check", "config", "prometheus.static.yml"],
        ["check", "rules", "rules.yml"],
        ["test", "rules", "rules_test.yml"],
    ):
        run = subprocess.run(["promtool", *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"promtool {' '.join(args)}:\n{run.stdout}\n{run.stderr}"


def launcher_defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher_arguments(parser)
    return parser.parse_args([])


def test_static_prometheus_config_is_the_kubernetes_one_discovering_through_the_frontend() -> None:
    """Outside Kubernetes the targets come from the frontend of `rackserve up` (its default port), which lists
    what discovery holds (tests/cluster/test_observability.py runs a real Prometheus on it)."""
    k8s = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    static = yaml.safe_load((PROMETHEUS / "prometheus.static.yml").read_text())
    assert k8s["global"] == static["global"] and k8s["rule_files"] == static["rule_files"] == ["rules.yml"]
    assert k8s["scrape_configs"][0]["kubernetes_sd_configs"] == [{"role": "pod"}]
    [discovery] = static["scrape_configs"][0]["http_sd_configs"]
    assert discovery["url"] == f"http://127.0.0.1:{launcher_defaults().port}/metrics/targets"


def test_every_alert_the_issue_asks_for_exists_and_every_rule_expression_parses() -> None:
    groups = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"]
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    assert set(alerts) >= {
        "RackserveHighErrorRate",
        "RackserveTTFTSLOFastBurn",
        "RackserveNoHealthyDecodeWorkers",
        "RackserveKvTransferFailures",
        "RackserveKvCacheNearFull",
    }
    assert all(r["annotations"]["summary"] and r["labels"]["severity"] for r in alerts.values())
    for expr in rule_exprs():
        promql(expr)  # raises on a syntax error


def test_dashboards_are_the_generator_output_and_every_panel_query_parses(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("dashboards", GRAFANA / "dashboards.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    generator.main(str(tmp_path))
    for path in GRAFANA.glob("*.json"):
        assert (tmp_path / path.name).read_text() == path.read_text(), f"{path.name} was edited by hand"
    boards = dashboards()
    assert set(boards) == {"rackserve-overview.json", "rackserve-diagnostics.json"}
    plugins.register_default_plugins()  # so Prometheus targets parse as prometheus.Dataquery
    for name, raw in boards.items():
        board = dashboard.Dashboard.from_json(raw)  # Grafana's own schema (grafana-foundation-sdk)
        assert board.uid and board.title and board.schema_version >= 36, name
        panels = [p for p in board.panels or [] if not isinstance(p, dashboard.RowPanel)]
        ids = [p.id_val for p in board.panels or []]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in panels:
            grid = panel.grid_pos
            assert grid is not None and grid.x + grid.w <= 24 and grid.h > 0, (name, panel.title)
            assert panel.targets, (name, panel.title)
            for target in panel.targets:
                assert isinstance(target, prometheus.Dataquery), (name, panel.title)
                promql(target.expr)
    titles = [p["title"] for b in boards.values() for p in b["panels"]]
    for needle in ("Time to first token", "Inter-token", "phase", "KV usage", "hit rate", "GB/s", "Routing",
                   "Healthy workers", "Migrations"):  # fmt: skip
        assert any(needle.lower() in t.lower() for t in titles), needle
    diagnostics = [p["title"] for p in boards["rackserve-diagnostics.json"]["panels"] if p["type"] != "row"]
    assert diagnostics == [
        "TTFT high while prefill is idle?",
        "ITL worse with concurrency?",
        "Disaggregated throughput below aggregated?",
    ]


def test_dashboards_and_rules_name_only_metrics_the_telemetry_module_defines() -> None:
    from prometheus_client import REGISTRY

    defined = set()
    for collector in list(REGISTRY._collector_to_names):  # type: ignore[attr-defined]
        defined.update(REGISTRY._collector_to_names[collector])  # type: ignore[attr-defined]
    # the engine's gauges are read at scrape time, so this process's registry does not list them
    engine_gauges = {metrics.REQUESTS_RUNNING, metrics.REQUESTS_WAITING, metrics.KV_USAGE_RATIO,
                     metrics.KV_FREE_BLOCKS, metrics.BATCH_SIZE, metrics.PREEMPTIONS + "_total",
                     metrics.KV_TIER_CAPACITY_BYTES, metrics.KV_TIER_USED_BYTES, metrics.KV_TIER_BLOCKS,
                     metrics.KV_TIER_HITS + "_total", metrics.KV_TIER_MISSES + "_total",
                     metrics.KV_TIER_RESTORES_OVERLAPPED + "_total", metrics.ENGINE_MEMORY_BYTES}  # fmt: skip
    missing = metric_names(dashboard_exprs() + rule_exprs()) - defined - engine_gauges
    assert not missing, (
        f"named in deploy/ but not defined in services/telemetry/metrics.py: {sorted(missing)}"
    )


def test_route_reasons_become_labels_without_numbers() -> None:
    a = metrics.reason_label("disagg: auto, prompt 300 >= 256 tokens; round_robin")
    b = metrics.reason_label("disagg: auto, prompt 4096 >= 256 tokens; round_robin")
    assert a == b == "disagg: auto, prompt N >= N tokens; round_robin"
    assert metrics.reason_label("") == "none"


def _record(i: int, client_id: str | None = None, key: str = "anonymous") -> dict[str, Any]:
    return {
        "request_id": f"r{i:04d}",
        "client_request_id": client_id,
        "api_key_name": key,
        "status": 200,
        "phase": "done",
        "start_unix_s": 1000.0 + i,
        "duration_s": 0.5,
        "ttft_s": 0.1,
        "phases": [
            {"phase": "queued", "start_s": 0.0, "end_s": 0.01, "duration_s": 0.01},
            {"phase": "prefilling", "start_s": 0.01, "end_s": 0.1, "duration_s": 0.09},
            {"phase": "decoding", "start_s": 0.1, "end_s": 0.5, "duration_s": 0.4},
        ],
    }


def test_timeline_store_keeps_only_the_last_n_and_finds_them_by_any_id() -> None:
    store = RecentTimelines(capacity=3)
    for i in range(5):
        store.add(_record(i, client_id=f"client-{i}"))
    assert len(store) == 3
    assert store.get("r0001") is None and store.get("client-1") is None  # evicted, with its client id
    assert (
        store.get("r0004") is store.get("chatcmpl-r0004") is store.get("cmpl-r0004") is store.get("client-4")
    )
    assert store.get("r0004") is not None


def test_a_timeline_is_read_only_by_the_key_that_sent_the_request() -> None:
    store = RecentTimelines(capacity=4)
    store.add(_record(1, client_id="job-7", key="team-a"))
    store.add(_record(2, client_id="job-7", key="team-b"))  # the same x-request-id from another key
    store.add(_record(3, key="team-b"))
    # each key finds its own request by the shared client id, and by our ids and response ids
    assert store.get("job-7", owner="team-a")["request_id"] == "r0001"
    assert store.get("job-7", owner="team-b")["request_id"] == "r0002"
    assert store.get("chatcmpl-r0003", owner="team-b")["request_id"] == "r0003"
    # to any other key (or an open API's caller) the request does not exist
    for rid in ("r0001", "cmpl-r0001"):
        assert store.get(rid, owner="team-b") is None and store.get(rid) is None
    assert store.get("r0003", owner="team-a") is None and store.get("job-7") is None
    # a client id that happens to be another key's request id still finds the caller's own request
    store.add(_record(4, client_id="r0003", key="team-a"))
    assert store.get("r0003", owner="team-a")["request_id"] == "r0004"
    assert store.get("r0003", owner="team-b")["request_id"] == "r0003"
    # evicting a request forgets its client id for its key only
    store.add(_record(5, key="team-a"))
    assert store.get("job-7", owner="team-a") is None
    assert store.get("job-7", owner="team-b")["request_id"] == "r0002"
    # a key that reuses a client id finds its newest request, even once the older one is evicted
    store.add(_record(6, client_id="job-9", key="team-a"))
    store.add(_record(7, client_id="job-9", key="team-a"))
    for i in (8, 9, 10):
        store.add(_record(i, key="team-a"))  # r0006 is evicted now, r0007 is still kept
    assert store.get("r0006", owner="team-a") is None
    assert store.get("job-9", owner="team-a")["request_id"] == "r0007"


def test_waterfall_draws_one_bar_per_phase_on_a_shared_axis() -> None:
    lines = [
        "2026-01-01 INFO rackserve.requests: " + json.dumps(_record(1)),
        "not json",
        json.dumps(_record(2)),
    ]
    records = read_request_log(lines)
    assert [r["request_id"] for r in records] == ["r0001", "r0002"]
    page = render_html(records)
    assert page.count('class="phase ') == 6 and "r0001" in page and "r0002" in page
    with pytest.raises(ValueError, match="no request timelines"):
        render_html([])


# A request that migrated once (prefill worker lost, resumed elsewhere), observed by the frontend's
# end-of-request hook in a process of its own (tracing is process-wide), exporting to a real receiver.
MIGRATED_REQUEST = r"""
import sys, time
from services.frontend.request_state import Migration, Phase, RequestState
from services.frontend.timeline import RequestObserver
from services.rpc import pb
from services.telemetry import tracing

tracing.configure("frontend", "test", sys.argv[1], batch_delay_ms=50)
state = RequestState("req-migrated", [1, 2, 3], pb.SamplingParams(seed=1), traceparent=sys.argv[2],
                     deadline_s=time.monotonic() + 60)
migration = Migration("decode_failed", "UNAVAILABLE: decode worker crashed", "decode-a", "decode", 3, time.time())
for phase in (Phase.ROUTED, Phase.PREFILLING, Phase.DECODING, Phase.MIGRATING, Phase.ROUTED, Phase.DECODING):
    time.sleep(0.01)
    state.advance(phase)
    if phase is Phase.MIGRATING:
        state.migration_log.append(migration)
migration.path, migration.to_worker_id, migration.outcome = "re-transfer", "decode-b", "resumed"
migration.end_unix_s = time.time()
state.emitted = []
state.finish("stop")
observer = RequestObserver(history=10)
observer.finished("chat_completions", state, 200)
print(observer.timelines.get("req-migrated")["phases"])
tracing.shutdown()
"""


def _spans_of(script: str, request_id: str, traceparent: str) -> tuple[str, list[dict[str, Any]]]:
    """Run `script` (a frontend's end of one request) in a process of its own, exporting to a receiver here:
    its stdout and the spans the receiver got for `request_id`."""
    with trace_receiver() as (receiver, endpoint):
        run = subprocess.run(
            [sys.executable, "-c", script, endpoint, traceparent],
            cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        return run.stdout, receiver.of_request(request_id)


@pytest.mark.cluster
def test_a_migrated_request_gets_a_migration_span_with_its_cause_and_path() -> None:
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    stdout, spans = _spans_of(MIGRATED_REQUEST, "req-migrated", f"00-{trace_id}-{span_id}-01")
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"request", "queue", "decode", "migration"}
    assert [s["name"] for s in spans].count("decode") == 2
    request = by_name["request"]
    assert (request["trace_id"], request["span_id"]) == (trace_id, span_id)  # the id the workers were sent
    assert all(s["parent_span_id"] == span_id for s in spans if s["name"] != "request")
    attributes = by_name["migration"]["attributes"]
    assert attributes["rackserve.migration.cause"] == "decode_failed"
    assert attributes["rackserve.migration.path"] == "re-transfer"
    assert "decode-b" in attributes["rackserve.migration.record"]
    assert "'migrating'" in stdout


# A request sent without a traceparent, ended inside a span that an HTTP layer made current (FastAPI's native
# tracing, an ASGI instrumentation): its request span must start the trace whose id the workers were sent.
UNPARENTED_REQUEST = r"""
import sys, time
from services.frontend.request_state import Phase, RequestState
from services.frontend.timeline import RequestObserver
from services.rpc import pb
from services.telemetry import tracing

tracing.configure("frontend", "test", sys.argv[1], batch_delay_ms=50)
state = RequestState("req-unparented", [1, 2, 3], pb.SamplingParams(seed=1), traceparent=sys.argv[2],
                     deadline_s=time.monotonic() + 60)
for phase in (Phase.ROUTED, Phase.PREFILLING, Phase.DECODING):
    state.advance(phase)
state.emitted = []
state.finish("stop")
with tracing.tracer().start_as_current_span("POST /v1/chat/completions"):
    RequestObserver(history=10).finished("chat_completions", state, 200)
tracing.shutdown()
"""


@pytest.mark.cluster
def test_a_request_without_a_client_traceparent_starts_the_trace_the_workers_were_sent() -> None:
    trace_id, span_id = "5b8aa5a2d2c872e8321cf37308d69df2", "051581bf3cb55c13"
    _, spans = _spans_of(UNPARENTED_REQUEST, "req-unparented", f"00-{trace_id}-{span_id}-01")
    request = next(s for s in spans if s["name"] == "request")
    # not a child of the HTTP span around it, in that span's own trace
    assert (request["trace_id"], request["span_id"], request["parent_span_id"]) == (trace_id, span_id, "")
    assert {s["trace_id"] for s in spans} == {trace_id}
