"""The router's Prometheus metrics: every name and label the router exports lives here.

Prefix `rackserve_` (DESIGN.md §7). The objects register in prometheus-client's default registry, once per
process; the router serves it on `--metrics-port` when that is set. A later change moves the names into the
shared telemetry module.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
