"""The frontend's Prometheus metrics: every name, label and bucket the frontend exports lives here.

Prefix `rackserve_`, histograms in seconds (DESIGN.md §7). The objects register in prometheus-client's default
registry, once per process; `/metrics` serves that registry. A later change moves the names into the shared
telemetry module; until then nothing else defines a `rackserve_` metric for the frontend.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

REQUESTS = Counter(
    "rackserve_frontend_requests",
    "Finished API requests by endpoint and status: the HTTP status sent, or for a stream that failed after "
    "its headers, the status its error event carries; 499 = the client went away.",
    ["endpoint", "status"],
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
PROMPT_TOKENS = Counter("rackserve_prompt_tokens", "Prompt tokens of accepted requests")
GENERATION_TOKENS = Counter("rackserve_generation_tokens", "Tokens generated and received by the frontend")
CACHED_PROMPT_TOKENS = Counter(
    "rackserve_cached_prompt_tokens", "Prompt tokens that a worker served from its prefix cache"
)
WORKER_FAILURES = Counter(
    "rackserve_frontend_worker_failures",
    "Failed calls to a router or worker, reported by the frontend",
    ["role", "code"],
)

MIGRATIONS = Counter(
    "rackserve_frontend_migrations",
    "Requests moved off a failed worker, by cause (decode_failed, decode_stalled, prefill_failed, "
    "prefill_stalled, transfer_failed), path (re-transfer, rebuild; none when it was refused) and outcome "
    "(resumed, failed, limit_exceeded, deadline_exceeded)",
    ["cause", "path", "outcome"],
)
MIGRATION_RECOVERY_S = Histogram(
    "rackserve_frontend_migration_recovery_seconds",
    "From a worker failing a request to the first token or chunk from its new worker, by path",
    ["path"],
    buckets=LATENCY_BUCKETS_S,
)


def exposition() -> tuple[bytes, str]:
    """The body and content type of `/metrics`."""
    return generate_latest(), CONTENT_TYPE_LATEST
