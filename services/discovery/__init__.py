"""Discovery: which workers exist and where to reach them, through etcd leases (docs/design.md, "Discovery").

    reg = await Registration.start(etcd_url, info)          # a worker: listed while it lives
    d = WorkerDirectory(etcd_url, roles=("prefill", "decode")); await d.start()
    d.workers("decode"); d.subscribe(cb); d.suppress(worker_id, 5.0); await d.wait_for("decode", 1, 10.0)

etcd carries liveness and endpoints only: never request data, never load or KV-block events (those flow over
the gRPC stream each router opens to each worker). Losing etcd must never stop traffic or crash a service:
registrations retry, directories freeze their last view.
"""

from services.discovery.directory import DiscoveryTimeoutError, WorkerDirectory
from services.discovery.etcd import EtcdSecurity, EtcdUnavailableError, parse_etcd_url, parse_etcd_urls
from services.discovery.keys import ROLES, WORKERS_PREFIX, decode_worker_info, encode_worker_info, worker_key
from services.discovery.registration import Registration

__all__ = [
    "ROLES",
    "WORKERS_PREFIX",
    "DiscoveryTimeoutError",
    "EtcdSecurity",
    "EtcdUnavailableError",
    "Registration",
    "WorkerDirectory",
    "decode_worker_info",
    "encode_worker_info",
    "parse_etcd_url",
    "parse_etcd_urls",
    "worker_key",
]
