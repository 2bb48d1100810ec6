"""Generates deploy/grafana/*.json, rackserve's Grafana dashboards: `python deploy/grafana/dashboards.py`.

The JSON files are what Grafana (and the Helm chart) loads; this script is where they are edited. A test
regenerates them and fails if the committed files differ, parses every dashboard and every PromQL expression,
and checks that each metric named here is one a running cluster exports (services/telemetry/metrics.py).

Queries use metric labels only (role, backend, phase, …) plus Prometheus' `instance`, so they work with any
scrape config; `$__rate_interval` is Grafana's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
SERVER_ERRORS = 'status=~"5.."'
DISAGG = 'shape="disagg"'
HOST = 'tier="host"'  # KV tier 2


def q(expr: str, legend: str = "") -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend}


def rate(metric: str, by: str = "", labels: str = "") -> str:
    inner = f"rate({metric}{{{labels}}}[{RI}])" if labels else f"rate({metric}[{RI}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantile(p: float, hist: str, by: str = "", labels: str = "") -> str:
    sel = f"{hist}_bucket{{{labels}}}" if labels else f"{hist}_bucket"
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({p}, sum by ({group}) (rate({sel}[{RI}])))"


def percentiles(hist: str, labels: str = "") -> list[dict[str, Any]]:
    return [q(quantile(p, hist, labels=labels), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99)]


def mean(hist: str, by: str = "") -> str:
    return f"{rate(hist + '_sum', by)} / {rate(hist + '_count', by)}"


class Board:
    def __init__(self, uid: str, title: str, description: str) -> None:
        self.uid, self.title, self.description = uid, title, description
        self.panels: list[dict[str, Any]] = []
        self.y = 0
        self.x = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        if self.x:
            self.y, self.x = self.y + 8, 0
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def panel(
        self,
        title: str,
        targets: list[dict[str, Any]],
        unit: str = "short",
        w: int = 8,
        description: str = "",
        kind: str = "timeseries",
        stack: bool = False,
    ) -> None:
        if self.x + w > 24:
            self.y, self.x = self.y + 8, 0
        refs = "ABCDEFGHIJKLMNOP"
        custom: dict[str, Any] = {"drawStyle": "line", "fillOpacity": 10}
        if stack:
            custom.update({"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60})
        self.panels.append(
            {
                "type": kind,
                "id": self._id(),
                "title": title,
                "description": description,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": w, "x": self.x, "y": self.y},
                "fieldConfig": {
                    "defaults": {"unit": unit, "custom": custom if kind == "timeseries" else {}},
                    "overrides": [],
                },
                "options": {
                    "legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"},
                }
                if kind == "timeseries"
                else {},
                "targets": [{**t, "refId": refs[i], "datasource": DATASOURCE} for i, t in enumerate(targets)],
            }
        )
        self.x += w

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["rackserve", "llm-serving"],
            "timezone": "browser",
            "schemaVersion": 39,
            "version": 1,
            "editable": True,
            "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"},
            "templating": {
                "list": [
                    {
                        "name": "datasource",
                        "type": "datasource",
                        "query": "prometheus",
                        "label": "Prometheus",
                        "current": {},
                        "hide": 0,
                        "refresh": 1,
                        "options": [],
                    }
                ]
            },
            "annotations": {"list": []},
            "panels": self.panels,
        }


def overview() -> Board:
    b = Board(
        "rackserve-overview",
        "rackserve — overview",
        "Traffic, latency, phases, KV, transfer, routing, workers",
    )
    b.row("Traffic and errors")
    b.panel(
        "Requests/s by status",
        [q(rate("rackserve_frontend_requests_total", "status"), "{{status}}")],
        "reqps",
    )
    b.panel(
        "Error ratio (5xx)",
        [
            q(
                # `or vector(0)`: no 5xx yet is a ratio of 0, not no data
                f"({rate('rackserve_frontend_requests_total', labels=SERVER_ERRORS)} or vector(0)) / "
                f"{rate('rackserve_frontend_requests_total')}",
                "5xx ratio",
            )
        ],
        "percentunit",
    )
    b.panel(
        "Errors/s by type",
        [
            q(
                rate("rackserve_frontend_request_errors_total", "status, error_type"),
                "{{status}} {{error_type}}",
            )
        ],
        "reqps",
    )
    b.panel(
        "Tokens/s",
        [
            q(rate("rackserve_prompt_tokens_total"), "prompt"),
            q(rate("rackserve_generation_tokens_total"), "generated"),
            q(rate("rackserve_cached_prompt_tokens_total"), "prompt, cached"),
        ],
        "short",
        w=12,
    )
    b.panel(
        "Requests in flight",
        [q("sum by (endpoint) (rackserve_frontend_requests_in_flight)", "{{endpoint}}")],
        w=12,
    )
    b.row("Latency")
    b.panel("Time to first token", percentiles("rackserve_time_to_first_token_seconds"), "s")
    b.panel("Inter-token latency", percentiles("rackserve_inter_token_latency_seconds"), "s")
    b.panel("End-to-end latency", percentiles("rackserve_e2e_request_latency_seconds"), "s")
    b.row("Phase breakdown (queue / prefill / transfer / decode)")
    b.panel(
        "Mean seconds per request in each phase",
        [q(mean("rackserve_request_phase_seconds", "phase"), "{{phase}}")],
        "s",
        w=12,
        stack=True,
        description="From the coordinator's timeline: queued (to routed), prefilling, transferring, decoding",
    )
    b.panel(
        "Worker queue wait p90 by role",
        [q(quantile(0.9, "rackserve_queue_seconds", "role"), "{{role}}")],
        "s",
        w=12,
    )
    b.panel(
        "Prefill compute p90 by role",
        [q(quantile(0.9, "rackserve_prefill_seconds", "role"), "{{role}}")],
        "s",
        description="role=decode: aggregated requests prefilled on the decode worker",
    )
    b.panel(
        "KV transfer p90 by backend",
        [q(quantile(0.9, "rackserve_kv_transfer_seconds", "backend"), "{{backend}}")],
        "s",
    )
    b.panel("Decode step", percentiles("rackserve_engine_step_seconds", 'role="decode"'), "s")
    b.row("KV cache and prefix cache")
    b.panel(
        "KV usage by worker",
        [q("max by (instance, role) (rackserve_kv_usage_ratio)", "{{role}} {{instance}}")],
        "percentunit",
    )
    b.panel("Free KV blocks", [q("sum by (role) (rackserve_kv_free_blocks)", "{{role}}")])
    b.panel(
        "Prefix cache hit rate (tokens)",
        [
            q(
                f"{rate('rackserve_prefix_cache_hits_total', 'role')} / "
                f"{rate('rackserve_prefix_cache_queries_total', 'role')}",
                "{{role}}",
            )
        ],
        "percentunit",
    )
    b.panel(
        "KV tiers: bytes used / capacity",
        [
            q("sum by (role, tier) (rackserve_kv_tier_used_bytes)", "used {{role}} {{tier}}"),
            q("sum by (role, tier) (rackserve_kv_tier_capacity_bytes)", "capacity {{role}} {{tier}}"),
        ],
        "bytes",
        description="tier=primary: the paged KV pool; tier=host: tier 2, where evicted prefix blocks wait for a "
        "hit (--kv-tier2-bytes; absent when off); tier=disk: the local-disk tier below it (--kv-disk-bytes)",
    )
    b.panel(
        "Engine memory: weights, KV cache, GPU plan",
        [q("max by (role, part) (rackserve_engine_memory_bytes)", "{{role}} {{part}}")],
        "bytes",
        description="Per worker role, the largest: weights (NVFP4 packed) and the KV cache; on GPU workers also "
        "the start-up plan: device_total, before_engine (other processes), activation_peak (the profiled "
        "largest step), kv_in_transit (set aside for device-direct KV copies)",
    )
    b.panel(
        "Tier-2 hit rate (blocks) and restore p90",
        [
            q(
                f"{rate('rackserve_kv_tier_hits_total', 'role', HOST)} / "
                f"({rate('rackserve_kv_tier_hits_total', 'role', HOST)} + "
                f"{rate('rackserve_kv_tier_misses_total', 'role', HOST)})",
                "hit rate {{role}}",
            ),
            q(quantile(0.9, "rackserve_kv_tier_restore_seconds", "role"), "restore p90 {{role}} (s)"),
            q(
                f"{rate('rackserve_kv_tier_restores_overlapped_total', 'role')} / "
                f"{rate('rackserve_kv_tier_restore_seconds_count', 'role')}",
                "restores beside the step {{role}}",
            ),
        ],
        "short",
        description="Of the prompt blocks past the primary pool's prefix, the share tier 2 restored instead of "
        "recomputing; how long one request's restore took; and the share of restores written beside a step "
        "(the batch kept decoding) rather than before it",
    )
    b.panel(
        "Running / waiting requests",
        [
            q("sum by (role) (rackserve_requests_running)", "running {{role}}"),
            q("sum by (role) (rackserve_requests_waiting)", "waiting {{role}}"),
        ],
        w=12,
    )
    b.panel(
        "Batch size and preemptions",
        [
            q("avg by (role) (rackserve_batch_size)", "batch {{role}}"),
            q(rate("rackserve_preemptions_total", "role"), "preemptions/s {{role}}"),
        ],
        w=12,
    )
    b.row("KV transfer")
    b.panel(
        "Transfer bytes/s by backend",
        [q(rate("rackserve_kv_transfer_bytes_sum", "backend"), "{{backend}}")],
        "Bps",
    )
    b.panel(
        "Transfer bandwidth GB/s",
        [
            q("max by (backend) (rackserve_kv_transfer_bandwidth_gbps)", "last pull {{backend}}"),
            q(
                f"{rate('rackserve_kv_transfer_bytes_sum', 'backend')} / "
                f"{rate('rackserve_kv_transfer_seconds_sum', 'backend')} / 1e9",
                "average {{backend}}",
            ),
        ],
    )
    b.panel("Transfer failures/s", [q(rate("rackserve_kv_transfer_failures_total", "reason"), "{{reason}}")])
    b.panel(
        "Prefix pulls between workers",
        [
            q(rate("rackserve_peer_pulls_total", "role, outcome"), "pulls/s {{role}} {{outcome}}"),
            q(rate("rackserve_peer_pull_blocks_total", "role"), "pulled blocks/s {{role}}"),
            q(quantile(0.9, "rackserve_peer_pull_seconds", "role"), "pull p90 {{role}} (s)"),
        ],
        "short",
        description="Prefix blocks a worker copied from a peer's pool instead of recomputing them (a plan's "
        "PrefixPull), by outcome: pulled, local (already here), fallback_<cause> (recomputed)",
    )
    b.panel(
        "Pulled KV held outside the cache",
        [q("max by (memory) (rackserve_kv_pulled_resident_bytes)", "largest on a worker, {{memory}}")],
        "bytes",
        description="KV a worker pulled and has not yet written into its cache (waiting for blocks, or being "
        "written); device: device-direct pulls, bounded by --kv-device-pull-bytes. It returns to 0 as each "
        "import is written",
    )
    b.row("Routing")
    b.panel(
        "Routing decisions/s by reason",
        [q(rate("rackserve_router_decisions_total", "policy, shape, reason"), "{{shape}} {{reason}}")],
        w=12,
    )
    b.panel("Route() latency", percentiles("rackserve_route_seconds"), "s", w=12)
    b.row("Worker health and migrations")
    b.panel("Healthy workers by role", [q("max by (role) (rackserve_healthy_workers)", "{{role}}")])
    b.panel(
        "Migrations and retries",
        [
            q(
                f"sum by (cause, path, outcome) (increase(rackserve_migrations_total[{RI}]))",
                "migration {{cause}} {{path}} {{outcome}}",
            ),
            q(
                f"sum by (role, outcome) (increase(rackserve_retries_total[{RI}]))",
                "retry {{role}} {{outcome}}",
            ),
        ],
    )
    b.panel(
        "Worker failures seen by the frontend",
        [q(rate("rackserve_frontend_worker_failures_total", "role, code"), "{{role}} {{code}}")],
    )
    b.row("Planner: pool sizes")
    b.panel(
        "Replicas per pool: desired vs actual",
        [
            q("max by (pool) (rackserve_planner_desired_replicas)", "desired {{pool}}"),
            q("max by (pool) (rackserve_planner_actual_replicas)", "actual {{pool}}"),
            q("max by (pool) (rackserve_planner_target_replicas)", "target {{pool}} (undamped)"),
            q("max by (pool) (rackserve_planner_floor_replicas) > 0", "floor {{pool}} (--floor window)"),
        ],
        description="What the planner asks for (one step per interval, held down), what runs, where its best "
        "candidate would go at once, and the floor an operator's --floor window holds the pools at. Desired "
        "above actual for long: workers fail to start.",
    )
    b.panel(
        "Binding SLO and predicted p90",
        [
            q("max by (slo) (rackserve_planner_binding_slo) > 0", "binding: {{slo}}"),
            q("max by (slo) (rackserve_planner_predicted_p90_seconds)", "predicted p90 {{slo}} (s)"),
        ],
        description="The SLO that sizes the cluster now (ttft: the prefill pool; itl: the decode pool) and the "
        "simulator's p90s for the chosen sizes.",
    )
    b.panel(
        "Planner decisions by outcome",
        [
            q(f"sum by (outcome) (increase(rackserve_planner_decisions_total[{RI}]))", "{{outcome}}"),
            q("sum(rackserve_planner_leader)", "replicas leading"),
        ],
        description="hold, scale_up, scale_down, rebalance (capacity moved between pools), idle (too few "
        "requests to size on), standby (decisions a replica did not take: another leads). Replicas leading "
        "is 1 while the election works; 0 for longer than a lease TTL: no planner acts.",
    )
    return b


def diagnostics() -> Board:
    b = Board(
        "rackserve-diagnostics",
        "rackserve — diagnostics",
        "Three panels for the three questions: TTFT high while prefill is idle; ITL worse with concurrency; "
        "disaggregated throughput below aggregated. Each puts the symptom beside its usual causes.",
    )
    b.row("Diagnostics")
    b.panel(
        "TTFT high while prefill is idle?",
        [
            q(quantile(0.9, "rackserve_time_to_first_token_seconds"), "TTFT p90 (s)"),
            q('sum(rackserve_requests_running{role="prefill"})', "prefill running (requests)"),
            q(mean("rackserve_request_phase_seconds", "phase"), "mean {{phase}} (s)"),
            q(quantile(0.9, "rackserve_route_seconds"), "route p90 (s)"),
            q(
                f"{rate('rackserve_prefix_cache_hits_total')} / {rate('rackserve_prefix_cache_queries_total')}",
                "prefix hit rate",
            ),
            q(quantile(0.9, "rackserve_kv_transfer_seconds", "backend"), "transfer p90 {{backend}} (s)"),
        ],
        "short",
        description="TTFT rising while prefill workers run nothing points at the path around prefill: time "
        "queued before routing, a slow router, cache misses (hit rate falling), or the transfer path.",
    )
    b.panel(
        "ITL worse with concurrency?",
        [
            q(quantile(0.9, "rackserve_inter_token_latency_seconds"), "ITL p90 (s)"),
            q('sum(rackserve_requests_running{role="decode"})', "decode running (requests)"),
            q('avg(rackserve_batch_size{role="decode"})', "decode batch size"),
            q('max(rackserve_kv_usage_ratio{role="decode"})', "decode KV usage"),
            q(mean("rackserve_request_generation_tokens"), "mean output tokens"),
            q(quantile(0.9, "rackserve_engine_step_seconds", labels='role="decode"'), "decode step p90 (s)"),
            q(rate("rackserve_preemptions_total", labels='role="decode"'), "preemptions/s"),
        ],
        "short",
        description="ITL follows the decode step; the step grows with the batch, with KV pressure "
        "(preemptions when it is full) and with long outputs holding the batch.",
    )
    b.panel(
        "Disaggregated throughput below aggregated?",
        [
            q(rate("rackserve_generation_tokens_total"), "generated tokens/s"),
            q(
                f"{rate('rackserve_router_decisions_total', labels=DISAGG)} / "
                f"{rate('rackserve_router_decisions_total')}",
                "disagg share",
            ),
            q(
                f"{rate('rackserve_kv_transfer_bytes_sum')} / {rate('rackserve_kv_transfer_seconds_sum')} / 1e9",
                "transfer GB/s",
            ),
            q(
                f"{rate('rackserve_kv_transfer_bytes_sum')} / {rate('rackserve_kv_transfer_bytes_count')}",
                "bytes per transfer",
            ),
            q(
                'max(rackserve_healthy_workers{role="prefill"}) / max(rackserve_healthy_workers{role="decode"})',
                "prefill:decode workers",
            ),
        ],
        "short",
        description="Disaggregation pays when the transfer is cheap next to the prefill it saves: watch bytes "
        "per transfer, measured GB/s, the disagg share and the prefill:decode ratio.",
    )
    return b


BOARDS = {"rackserve-overview.json": overview, "rackserve-diagnostics.json": diagnostics}


def render() -> dict[str, str]:
    return {name: json.dumps(make().json(), indent=2) + "\n" for name, make in BOARDS.items()}


def main(out_dir: str = HERE) -> int:
    for name, text in render().items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
