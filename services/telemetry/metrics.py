"""Every Prometheus metric rackserve exports: each name, label and bucket lives here and nowhere else.

Prefix `rackserve_`, histograms in seconds (docs/design.md). Each service process imports this module and
updates the metrics that belong to its role; the objects register in prometheus-client's default registry
(once per process) and `/metrics` serves that registry — on the frontend's own HTTP port, on the small
`--metrics-port` server of router, prefill and decode (services.telemetry.http). Deploy files
(deploy/grafana, deploy/prometheus) name these metrics; tests scrape a running cluster to prove every name a
dashboard or rule uses is exported.

Labels stay low-cardinality: a role, an endpoint, a status, a backend, a reason with its numbers scrubbed —
never a request id, a worker id or a prompt length.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Buckets that suit LLM serving: TTFT and end-to-end span milliseconds (cached, short) to minutes (long
# generations on a CPU); token gaps and engine steps live between a millisecond and a few seconds.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# KV of a prompt: a few KiB (one block of a small model) to GiBs (a long prompt of a large model).
TRANSFER_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(0, 12))  # 1 KiB … 4 GiB

ROLES = ("frontend", "router", "prefill", "decode")
PHASES = ("queued", "routed", "prefilling", "transferring", "decoding", "migrating")

# The role this process serves, a label on metrics observed deep in shared code (the engine thread) that
# does not know which service it runs in. ServiceHost sets it once at start.
process_role = "unknown"

# ---- requests, at the frontend ------------------------------------------------------------------------------

REQUESTS = Counter(
    "rackserve_frontend_requests",
    "Finished API requests by endpoint and status: the HTTP status sent, or for a stream that failed after "
    "its headers, the status its error event carries; 499 = the client went away.",
    ["endpoint", "status"],
)
REQUEST_ERRORS = Counter(
    "rackserve_frontend_request_errors",
    "Failed API requests by status and error type (the OpenAI error `code`, e.g. no_workers, timeout)",
    ["status", "error_type"],
)
REQUESTS_IN_FLIGHT = Gauge(
    "rackserve_frontend_requests_in_flight", "API requests being served now", ["endpoint"]
)
TTFT_S = Histogram(
    "rackserve_time_to_first_token_seconds",
    "From the request's arrival to the first generated token reaching the frontend",
    buckets=LATENCY_BUCKETS_S,
)
INTER_TOKEN_S = Histogram(
    "rackserve_inter_token_latency_seconds",
    "Gap between consecutive generated tokens arriving at the frontend",
    buckets=TOKEN_GAP_BUCKETS_S,
)
E2E_S = Histogram(
    "rackserve_e2e_request_latency_seconds",
    "From the request's arrival to its last token (successful generations only)",
    buckets=LATENCY_BUCKETS_S,
)
PHASE_S = Histogram(
    "rackserve_request_phase_seconds",
    "Time a finished request spent in each coordinator phase (queued = arrival to routed)",
    ["phase"],
    buckets=LATENCY_BUCKETS_S,
)
OUTPUT_TOKENS_PER_REQUEST = Histogram(
    "rackserve_request_generation_tokens",
    "Generated tokens per finished request",
    buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
PROMPT_TOKENS = Counter("rackserve_prompt_tokens", "Prompt tokens of accepted requests")
PROMPT_TOKENS_PER_REQUEST = Histogram(
    "rackserve_request_prompt_tokens",
    "Prompt tokens per accepted request (the planner replays this distribution)",
    buckets=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072),
)
GENERATION_TOKENS = Counter("rackserve_generation_tokens", "Tokens generated and received by the frontend")
CACHED_PROMPT_TOKENS = Counter(
    "rackserve_cached_prompt_tokens", "Prompt tokens that a worker served from its prefix cache"
)
PULLED_PROMPT_TOKENS = Counter(
    "rackserve_pulled_prompt_tokens",
    "Of the cached prompt tokens: those whose KV the prefilling worker pulled from a peer (PrefixPull)",
)
WORKER_FAILURES = Counter(
    "rackserve_frontend_worker_failures",
    "Failed calls to a router or worker, reported by the frontend",
    ["role", "code"],
)
MIGRATIONS = Counter(
    "rackserve_migrations",
    "Requests moved off a failed worker, by cause (decode_failed, decode_stalled, prefill_failed, "
    "prefill_stalled, transfer_failed), path (re-transfer, rebuild; none when it was refused) and outcome "
    "(resumed, failed, limit_exceeded, deadline_exceeded)",
    ["cause", "path", "outcome"],
)
MIGRATION_RECOVERY_S = Histogram(
    "rackserve_migration_recovery_seconds",
    "From a worker failing a request to the first token or chunk from its new worker, by path",
    ["path"],
    buckets=LATENCY_BUCKETS_S,
)
RETRIES = Counter(
    "rackserve_retries",
    "Calls the frontend repeated on another router or worker, by role and outcome (ok | failed)",
    ["role", "outcome"],
)
HEALTHY_WORKERS = Gauge(
    "rackserve_healthy_workers",
    "Workers live in discovery (registered, lease renewed, not suppressed) as this process sees them",
    ["role"],
)

# ---- routing, at the router ---------------------------------------------------------------------------------

# The names and labels of the router's policy metrics are the ones its policy code uses (`metrics.DECISIONS`,
# …); `reason` is the plan's reason as a small set of words (numbers scrubbed, see reason_label).
DECISIONS = Counter(
    "rackserve_router_decisions",
    "Routing decisions by policy, reason (cache_hit, least_queue, topology, local_prefill, …) and shape "
    "(agg: the decode worker prefills; disagg: a prefill worker does)",
    ["policy", "reason", "shape"],
)
NO_WORKER = Counter(
    "rackserve_router_no_worker", "Route calls answered UNAVAILABLE: no eligible decode worker"
)
INDEXED_BLOCKS = Gauge(
    "rackserve_router_indexed_blocks", "(worker, KV block) entries in the global prefix index"
)
INDEX_DROPPED_BLOCKS = Gauge(
    "rackserve_router_index_dropped_blocks",
    "Stored blocks not indexed since the router started because the index was at --index-max-blocks",
)
ROUTE_S = Histogram(
    "rackserve_route_seconds", "Time the router took to answer one Route()", buckets=TRANSFER_BUCKETS_S
)

# ---- the planner (services/planner) ---------------------------------------------------------------------------

POOLS = ("prefill", "decode")
PLANNER_DESIRED = Gauge(
    "rackserve_planner_desired_replicas", "Workers the planner wants in each pool (after damping)", ["pool"]
)
PLANNER_TARGET = Gauge(
    "rackserve_planner_target_replicas",
    "Workers the planner's best candidate has in each pool (before damping and the hold-down)",
    ["pool"],
)
PLANNER_ACTUAL = Gauge(
    "rackserve_planner_actual_replicas", "Workers live in discovery in each pool", ["pool"]
)
PLANNER_FLOOR = Gauge(
    "rackserve_planner_floor_replicas",
    "The floor an operator's --floor window holds each pool at now (0 outside every window)",
    ["pool"],
)
PLANNER_BINDING_SLO = Gauge(
    "rackserve_planner_binding_slo",
    "1 for the SLO that sizes the cluster at the last decision (ttft | itl | none when idle), else 0",
    ["slo"],
)
PLANNER_PREDICTED_P90_S = Gauge(
    "rackserve_planner_predicted_p90_seconds",
    "The simulator's p90 for the chosen candidate at the last decision, by SLO (ttft | itl)",
    ["slo"],
)
PLANNER_CORRECTION = Gauge(
    "rackserve_planner_correction",
    "With --correction: measured p90 over the replay's for the pools that ran, smoothed (the SLO is divided by it)",
    ["slo"],
)
PLANNER_LEADER = Gauge(
    "rackserve_planner_leader",
    "1 while this planner replica leads (decides and acts), 0 while it stands by for another",
)
PLANNER_DECISIONS = Counter(
    "rackserve_planner_decisions",
    "Planning intervals by outcome (hold | scale_up | scale_down | rebalance | idle | no_data | standby)",
    ["outcome"],
)
PLANNER_SCALE_ERRORS = Counter(
    "rackserve_planner_scale_errors",
    "Failed attempts to apply a decision (kubernetes mode), by pool",
    ["pool"],
)
PLANNER_DECISION_S = Histogram(
    "rackserve_planner_decision_seconds",
    "Time one planning interval took: scrape, replay every candidate, decide",
    buckets=LATENCY_BUCKETS_S,
)

# ---- workers: queue, prefill, transfer, engine ----------------------------------------------------------------

QUEUE_S = Histogram(
    "rackserve_queue_seconds",
    "Time a request waited before its first compute, by the role that queued it",
    ["role"],
    buckets=LATENCY_BUCKETS_S,
)
PREFILL_S = Histogram(
    "rackserve_prefill_seconds",
    "Prompt compute from first schedule to first token, by role (decode = aggregated local prefill)",
    ["role"],
    buckets=LATENCY_BUCKETS_S,
)
PREFIX_CACHE_QUERIES = Counter(
    "rackserve_prefix_cache_queries",
    "Prompt tokens looked up in a worker's prefix cache (requests it ran the prompt of)",
    ["role"],
)
PREFIX_CACHE_HITS = Counter(
    "rackserve_prefix_cache_hits", "Prompt tokens a worker found in its prefix cache", ["role"]
)
KV_TRANSFER_S = Histogram(
    "rackserve_kv_transfer_seconds",
    "One KV pull by a decode worker, measured from request to last byte, by backend",
    ["backend"],
    buckets=TRANSFER_BUCKETS_S,
)
KV_TRANSFER_BYTES = Histogram(
    "rackserve_kv_transfer_bytes",
    "Bytes of one KV pull on the wire (after transfer-only compression), by backend",
    ["backend"],
    buckets=TRANSFER_BYTES_BUCKETS,
)
KV_TRANSFER_BANDWIDTH = Gauge(
    "rackserve_kv_transfer_bandwidth_gbps",
    "Measured bandwidth of the last KV pull, GB/s (1e9 bytes per second), by backend",
    ["backend"],
)
KV_PULLED_RESIDENT_BYTES = Gauge(
    "rackserve_kv_pulled_resident_bytes",
    "Bytes of pulled KV a worker holds outside its KV cache (waiting for blocks or being written), by memory "
    "(host | device: a device-direct pull, within --kv-device-pull-bytes)",
    ["memory"],
)
KV_TRANSFER_FAILURES = Counter(
    "rackserve_kv_transfer_failures",
    "KV pulls that failed, by reason (unavailable | data_loss | precondition)",
    ["reason"],
)
# Prefix pulls between workers (runtime/prefix_pull.py): a worker about to prefill copies a prompt's cached prefix
# blocks from a peer's pool instead of recomputing them; the peer exports them (PrefillWorker.ExportPrefix).
PEER_PULL_OUTCOMES = (
    "pulled",
    "local",
    "fallback_mismatch",
    "fallback_prefix_gone",
    "fallback_empty",
    "fallback_unavailable",
    "fallback_deadline",
    "fallback_refused",
    "fallback_data_loss",
    "fallback_layout",
    "fallback_no_space",
)
PEER_PULLS = Counter(
    "rackserve_peer_pulls",
    "Prefix pulls a worker was planned to make, by role and outcome (pulled | local: the blocks were already "
    "here | fallback_<cause>: recomputed instead)",
    ["role", "outcome"],
)
PEER_PULL_BLOCKS = Counter(
    "rackserve_peer_pull_blocks",
    "KV blocks a worker copied from a peer's pool into its own, by role",
    ["role"],
)
PEER_PULL_S = Histogram(
    "rackserve_peer_pull_seconds",
    "One successful prefix pull: ExportPrefix, transfer and import into the pool, by role",
    ["role"],
    buckets=TRANSFER_BUCKETS_S,
)
PREFIX_EXPORTS = Counter(
    "rackserve_prefix_exports",
    "ExportPrefix calls a prefill worker served, by outcome (held: blocks published | empty: none cached)",
    ["outcome"],
)
PREFIX_EXPORT_BLOCKS = Counter(
    "rackserve_prefix_export_blocks", "KV blocks a prefill worker held and published for peers' prefix pulls"
)
# The KV cache's tiers: the primary pool (the paged cache the model reads), the host tier 2 (engine/kv_tier.py) and
# the local-disk tier below it (engine/kv_disk.py).
KV_TIERS = ("primary", "host", "disk")
KV_TIER_RESTORE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
KV_TIER_RESTORE_S = Histogram(
    "rackserve_kv_tier_restore_seconds",
    "Restoring one request's prefix blocks from a KV tier into the primary pool (decode + write), by role and tier",
    ["role", "tier"],
    buckets=KV_TIER_RESTORE_BUCKETS_S,
)
ENGINE_STEP_S = Histogram(
    "rackserve_engine_step_seconds",
    "One engine step (a batch of decode rows and prefill chunks), by role: role=decode is the decode step",
    ["role"],
    buckets=TOKEN_GAP_BUCKETS_S,
)

# Read from the engine at scrape time (EngineCollector), so the hot path never updates them.
REQUESTS_RUNNING = "rackserve_requests_running"
REQUESTS_WAITING = "rackserve_requests_waiting"
KV_USAGE_RATIO = "rackserve_kv_usage_ratio"
KV_FREE_BLOCKS = "rackserve_kv_free_blocks"
KV_TOTAL_BLOCKS = "rackserve_kv_total_blocks"
BATCH_SIZE = "rackserve_batch_size"
PREEMPTIONS = "rackserve_preemptions"
KV_TIER_CAPACITY_BYTES = "rackserve_kv_tier_capacity_bytes"
KV_TIER_USED_BYTES = "rackserve_kv_tier_used_bytes"
KV_TIER_BLOCKS = "rackserve_kv_tier_blocks"
KV_TIER_HITS = "rackserve_kv_tier_hits"  # counters: exported with the _total suffix
KV_TIER_MISSES = "rackserve_kv_tier_misses"
KV_TIER_RESTORES_OVERLAPPED = "rackserve_kv_tier_restores_overlapped"
ENGINE_MEMORY_BYTES = "rackserve_engine_memory_bytes"


class EngineCollector(Collector):
    """The engine's gauges, read from its latest stats snapshot whenever Prometheus scrapes."""

    def __init__(self) -> None:
        self.role = ""
        self.stats: Callable[[], Any] | None = None  # () -> EngineStats (duck-typed: no engine import here)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self.stats is None:
            return
        s = self.stats()
        gauges = (
            (REQUESTS_RUNNING, "Requests in the engine's running batch", s.running),
            (REQUESTS_WAITING, "Requests waiting to be scheduled", s.waiting),
            (KV_USAGE_RATIO, "Fraction of KV cache blocks in use (0..1)", s.kv_usage),
            (KV_FREE_BLOCKS, "KV cache blocks free now", s.free_blocks),
            (KV_TOTAL_BLOCKS, "KV cache blocks in all", s.total_blocks),
            (BATCH_SIZE, "Sequences in the last engine step", s.batch_size),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], float(value))
            yield family
        preempted = CounterMetricFamily(
            PREEMPTIONS, "Sequences preempted for lack of KV blocks", labels=["role"]
        )
        preempted.add_metric([self.role], float(s.preemptions))
        yield preempted
        yield self._memory(s)
        yield from self._tiers(s)

    def _memory(self, s: Any) -> GaugeMetricFamily:
        """How the engine's memory is shared out: weights and KV cache on every worker; on a GPU worker also its
        start-up plan (device total, what was in use before the engine, the profiled activation peak, KV copies
        in transit set aside)."""
        family = GaugeMetricFamily(
            ENGINE_MEMORY_BYTES,
            "Engine memory by part: weights, kv_cache; on a GPU also device_total, before_engine, "
            "activation_peak, kv_in_transit (the start-up plan)",
            labels=["role", "part"],
        )
        parts = [
            ("weights", getattr(s, "weight_bytes", 0)),
            ("kv_cache", s.total_blocks * getattr(s, "block_bytes", 0)),
        ]
        plan = getattr(s, "memory_plan", None)
        if plan is not None:
            parts += [
                ("device_total", plan.total_bytes),
                ("before_engine", plan.other_bytes),
                ("activation_peak", plan.activation_peak_bytes),
                ("kv_in_transit", plan.reserved_bytes),
            ]
        for part, value in parts:
            family.add_metric([self.role, part], float(value))
        return family

    def _tiers(self, s: Any) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Per KV tier: capacity and occupancy; hits and misses of tier 2 (the primary pool's hits are
        rackserve_prefix_cache_hits). A worker without tier 2 exports the primary tier only."""
        block = float(getattr(s, "block_bytes", 0))
        rows: dict[str, list[tuple[str, float]]] = {
            KV_TIER_CAPACITY_BYTES: [("primary", s.total_blocks * block)],
            KV_TIER_USED_BYTES: [("primary", (s.total_blocks - s.free_blocks) * block)],
            KV_TIER_BLOCKS: [("primary", float(s.total_blocks - s.free_blocks))],
        }
        t2 = getattr(s, "tier2", None)
        if t2 is not None:
            rows[KV_TIER_CAPACITY_BYTES].append(("host", float(t2.capacity_bytes)))
            rows[KV_TIER_USED_BYTES].append(("host", float(t2.used_bytes)))
            rows[KV_TIER_BLOCKS].append(("host", float(t2.blocks)))
        disk = getattr(s, "disk", None)
        if disk is not None:
            rows[KV_TIER_CAPACITY_BYTES].append(("disk", float(disk.capacity_bytes)))
            rows[KV_TIER_USED_BYTES].append(("disk", float(disk.used_bytes)))
            rows[KV_TIER_BLOCKS].append(("disk", float(disk.blocks)))
        docs = {
            KV_TIER_CAPACITY_BYTES: "Bytes a KV tier can hold, by tier (primary pool | host tier 2 | disk)",
            KV_TIER_USED_BYTES: "Bytes of a KV tier in use (primary: blocks allocated; host, disk: blocks kept)",
            KV_TIER_BLOCKS: "KV blocks in a tier now (primary: allocated; host, disk: kept for a later hit)",
        }
        for name, values in rows.items():
            family = GaugeMetricFamily(name, docs[name], labels=["role", "tier"])
            for tier, value in values:
                family.add_metric([self.role, tier], value)
            yield family
        for name, doc, attr in (
            (KV_TIER_HITS, "Prompt blocks restored from a KV tier instead of recomputed", "hits"),
            (KV_TIER_MISSES, "Prompt blocks past the primary pool's prefix that no tier held", "misses"),
            (
                KV_TIER_RESTORES_OVERLAPPED,
                "Restores written beside an engine step (not before it)",
                "overlapped",
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["role", "tier"])
            if t2 is not None:  # declared either way (dashboards name it); samples only where the tier is on
                counter.add_metric([self.role, "host"], float(getattr(t2, attr)))
            if disk is not None:
                counter.add_metric([self.role, "disk"], float(getattr(disk, attr)))
            yield counter


_engine_collector = EngineCollector()
REGISTRY.register(_engine_collector)


def export_engine(role: str, stats: Callable[[], Any]) -> None:
    """Export this process's engine gauges, read from `stats()` at scrape time (one engine per process)."""
    _engine_collector.role, _engine_collector.stats = role, stats


def export_pulled_resident(resident_bytes: Callable[[str], int]) -> None:
    """rackserve_kv_pulled_resident_bytes{memory}: read from this process's KV sink at scrape time."""
    for memory in ("host", "device"):
        KV_PULLED_RESIDENT_BYTES.labels(memory).set_function(functools.partial(resident_bytes, memory))


_NUMBER = re.compile(r"\d+(?:\.\d+)?")


class _Discovery(Protocol):
    def workers(self, role: str) -> list[Any]: ...


def export_healthy_workers(directory: _Discovery, roles: tuple[str, ...]) -> None:
    """rackserve_healthy_workers{role}: read from this process's view of discovery at scrape time."""
    for role in roles:
        HEALTHY_WORKERS.labels(role).set_function(functools.partial(_count_workers, directory, role))


def _count_workers(directory: _Discovery, role: str) -> float:
    return float(len(directory.workers(role)))


def reason_label(reason: str) -> str:
    """A RoutePlan reason as a label: numbers become N, so `prompt 300 >= 256 tokens` stays one series."""
    return _NUMBER.sub("N", reason).strip()[:80] or "none"


def exposition() -> tuple[bytes, str]:
    """The body and content type of `/metrics`."""
    return generate_latest(), CONTENT_TYPE_LATEST
